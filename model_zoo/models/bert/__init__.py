"""BERT: a bidirectional Transformer encoder pretrained with masked LM and next sentence
prediction, fine-tuned for classification.

The names below are the model-folder contract (model_zoo/models/base.py), each imported
from its submodule on first use.
"""

from model_zoo.models.base import lazy_hooks

__getattr__, __dir__ = lazy_hooks(__name__, {
    "ModelConfig": "model:BertConfig",
    "DataConfig": "tasks:BertDataConfig",
    "build_train_network": "tasks",
    "create_train_dataset": "tasks",
    "prepare_data": "tasks",
    "evaluate": "tasks",
    "dataset_ready": "tasks",
    "plan_inputs": "tasks",
    "sample_text": "tasks",
    "run_fill_mask": "tasks",
    "add_commands": "commands",
    "add_data_arguments": "data",
    "run_data_command": "data",
    "add_convert_arguments": "convert",
    "run_convert_command": "convert",
})
