"""BERT: a bidirectional Transformer encoder pretrained with masked LM and next sentence
prediction, fine-tuned for classification.

`HOOKS` declares its hooks (the model-folder contract, model_zoo/models/base.py) and
the submodule defining each, imported on first use.
"""

from model_zoo.models.base import TASK_HOOKS, lazy_hooks

HOOKS = {   # every hook of the model-folder contract, and the submodule defining it
    **dict.fromkeys(TASK_HOOKS, "tasks"),
    "ModelConfig": "model:BertConfig",
    "DataConfig": "tasks:BertDataConfig",
    "add_commands": "commands",
    "run_fill_mask": "tasks",
    "add_data_arguments": "data_command",
    "run_data_command": "data_command",
    "add_convert_arguments": "convert",
    "run_convert_command": "convert",
}
__getattr__, __dir__ = lazy_hooks(__name__, HOOKS)
