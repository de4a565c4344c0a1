"""BERT: a bidirectional Transformer encoder pretrained with masked LM and next sentence
prediction, fine-tuned for classification.

`HOOKS` declares its hooks (the model-folder contract, model_zoo/models/base.py) and
the submodule defining each, imported on first use.
"""

from model_zoo.models.base import lazy_hooks

HOOKS = {   # every hook of the model-folder contract, and the submodule defining it
    "ModelConfig": "model:BertConfig",
    "DataConfig": "tasks:BertDataConfig",
    "build_train_network": "tasks",
    "create_train_dataset": "tasks",
    "prepare_data": "tasks",
    "dataset_ready": "tasks",
    "evaluate": "tasks",
    "plan_inputs": "tasks",
    "sample_text": "tasks",
    "inference_graphs": "tasks",
    "create_heldout_dataset": "tasks",
    "add_commands": "commands",
    "run_fill_mask": "tasks",
    "add_data_arguments": "data_command",
    "run_data_command": "data_command",
    "add_convert_arguments": "convert",
    "run_convert_command": "convert",
}
__getattr__, __dir__ = lazy_hooks(__name__, HOOKS)
