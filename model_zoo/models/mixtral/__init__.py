"""Mixtral: LLaMA's decoder with a mixture of SwiGLU experts in place of its feed-forward
(Jiang et al., 2024), a top-k router choosing each token's experts.

Made as a copy of the LLaMA folder: the decoder-only user paths are shared
(`model_zoo.causal_lm`), so this folder holds the model (`model.py`), its Hugging Face
conversion (`convert.py`), the bindings (`tasks.py`, `commands.py`) and configs. `HOOKS`
declares its hooks (the model-folder contract, model_zoo/models/base.py) and the submodule
defining each, imported on first use.
"""

from model_zoo.models.base import TASK_HOOKS, lazy_hooks

HOOKS = {   # every hook of the model-folder contract, and the submodule defining it
    **dict.fromkeys(TASK_HOOKS, "tasks"),
    "ModelConfig": "model:MixtralConfig",
    "DataConfig": "tasks:MixtralDataConfig",
    "add_commands": "commands",
    "run_generate": "tasks",
    "add_data_arguments": "tasks",
    "run_data_command": "tasks",
    "add_convert_arguments": "convert",
    "run_convert_command": "convert",
}
__getattr__, __dir__ = lazy_hooks(__name__, HOOKS)
