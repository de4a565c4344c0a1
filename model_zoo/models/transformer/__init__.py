"""The Transformer for translation: an encoder-decoder with a joint vocabulary.

Its hooks (the model-folder contract, model_zoo/models/base.py) are the names of `tasks.py`;
`commands.py` adds its verbs to the command line.
"""
