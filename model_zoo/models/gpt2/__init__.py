"""GPT-2: a decoder-only language model.

This folder is a template: copy it to `model_zoo/models/<name>` and set `model.name: <name>`.
`HOOKS` declares its hooks (the model-folder contract, model_zoo/models/base.py) and
the submodule defining each, imported on first use.
"""

from model_zoo.models.base import TASK_HOOKS, lazy_hooks

HOOKS = {   # every hook of the model-folder contract, and the submodule defining it
    **dict.fromkeys(TASK_HOOKS, "tasks"),
    "ModelConfig": "model:GPT2Config",
    "DataConfig": "tasks:GPT2DataConfig",
    "add_commands": "commands",
    "run_generate": "tasks",
    "add_data_arguments": "tasks",
    "run_data_command": "tasks",
    "add_convert_arguments": "convert",
    "run_convert_command": "convert",
}
__getattr__, __dir__ = lazy_hooks(__name__, HOOKS)
