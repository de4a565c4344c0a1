"""BERT: a bidirectional Transformer encoder pretrained with masked LM and next sentence
prediction, fine-tuned for classification.

Its hooks (the model-folder contract, model_zoo/models/base.py) are the names of `tasks.py`;
`commands.py` adds its verbs to the command line.
"""
