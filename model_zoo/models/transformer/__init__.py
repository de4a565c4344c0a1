"""The Transformer for translation: an encoder-decoder with a joint vocabulary.

`HOOKS` declares its hooks (the model-folder contract, model_zoo/models/base.py) and
the submodule defining each, imported on first use.
"""

from model_zoo.models.base import TASK_HOOKS, lazy_hooks

HOOKS = {   # every hook of the model-folder contract, and the submodule defining it
    **dict.fromkeys(TASK_HOOKS, "tasks"),
    "ModelConfig": "model:TransformerConfig",
    "DataConfig": "tasks:TransformerDataConfig",
    "add_commands": "commands",
    "batch_tokens": "tasks",
    "run_translate": "tasks",
    "add_data_arguments": "data",
    "run_data_command": "data",
}
__getattr__, __dir__ = lazy_hooks(__name__, HOOKS)
