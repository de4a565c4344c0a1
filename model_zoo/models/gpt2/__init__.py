"""GPT-2: a decoder-only language model.

This folder is a template: copy it to `model_zoo/models/<name>` and set `model.name: <name>`.
Its hooks (the model-folder contract, model_zoo/models/base.py) are the names of `tasks.py`;
`commands.py` adds its verbs to the command line.
"""
