"""GPT-2: a decoder-only language model.

This folder is a template: copy it to `model_zoo/models/<name>` and set `model.name: <name>`.
Its hooks (the model-folder contract, model_zoo/models/base.py) live where
`base.STANDARD_LOCATIONS` says, plus those named below, each imported on first use.
"""

from model_zoo.models.base import lazy_hooks

__getattr__, __dir__ = lazy_hooks(__name__, {
    "ModelConfig": "model:GPT2Config",
    "DataConfig": "tasks:GPT2DataConfig",
    "run_generate": "tasks",
    "add_data_arguments": "tasks",
    "run_data_command": "tasks",
    "add_convert_arguments": "convert",
    "run_convert_command": "convert",
})
