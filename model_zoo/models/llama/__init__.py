"""LLaMA: a decoder-only language model with rotary positions, RMSNorm, SwiGLU and
grouped-query attention.

Made as a copy of the GPT-2 folder: the decoder-only user paths are shared
(`model_zoo.causal_lm`), so this folder holds the model (`model.py`), its Hugging Face
conversion (`convert.py`), the bindings (`tasks.py`, `commands.py`) and configs. `HOOKS`
declares its hooks (the model-folder contract, model_zoo/models/base.py) and the submodule
defining each, imported on first use.
"""

from model_zoo.models.base import lazy_hooks

HOOKS = {   # every hook of the model-folder contract, and the submodule defining it
    "ModelConfig": "model:LlamaConfig",
    "DataConfig": "tasks:LlamaDataConfig",
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
    "run_generate": "tasks",
    "add_data_arguments": "tasks",
    "run_data_command": "tasks",
    "add_convert_arguments": "convert",
    "run_convert_command": "convert",
}
__getattr__, __dir__ = lazy_hooks(__name__, HOOKS)
