"""The Transformer for translation: an encoder-decoder with a joint vocabulary.

The names below are the model-folder contract (model_zoo/models/base.py), each imported
from its submodule on first use.
"""

from model_zoo.models.base import lazy_hooks

__getattr__, __dir__ = lazy_hooks(__name__, {
    "ModelConfig": "model:TransformerConfig",
    "DataConfig": "tasks:TransformerDataConfig",
    "build_train_network": "tasks",
    "create_train_dataset": "tasks",
    "prepare_data": "tasks",
    "evaluate": "tasks",
    "dataset_ready": "tasks",
    "plan_inputs": "tasks",
    "sample_text": "tasks",
    "batch_tokens": "tasks",
    "run_translate": "tasks",
    "add_commands": "commands",
    "add_data_arguments": "data",
    "run_data_command": "data",
})
