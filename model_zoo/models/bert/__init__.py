"""BERT: a bidirectional Transformer encoder pretrained with masked LM and next sentence
prediction, fine-tuned for classification.

Its hooks (the model-folder contract, model_zoo/models/base.py) live where
`base.STANDARD_LOCATIONS` says, plus those named below, each imported on first use.
"""

from model_zoo.models.base import lazy_hooks

__getattr__, __dir__ = lazy_hooks(__name__, {
    "ModelConfig": "model:BertConfig",
    "DataConfig": "tasks:BertDataConfig",
    "run_fill_mask": "tasks",
    "add_data_arguments": "data_command",
    "run_data_command": "data_command",
    "add_convert_arguments": "convert",
    "run_convert_command": "convert",
})
