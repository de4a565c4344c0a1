"""The Transformer for translation: an encoder-decoder with a joint vocabulary.

Its hooks (the model-folder contract, model_zoo/models/base.py) live where
`base.STANDARD_LOCATIONS` says, plus those named below, each imported on first use.
"""

from model_zoo.models.base import lazy_hooks

__getattr__, __dir__ = lazy_hooks(__name__, {
    "ModelConfig": "model:TransformerConfig",
    "DataConfig": "tasks:TransformerDataConfig",
    "batch_tokens": "tasks",
    "run_translate": "tasks",
})
