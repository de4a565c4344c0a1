"""The Transformer for translation: an encoder-decoder with a joint vocabulary.

The names below are what the trainer and the command line use.
"""

from .data import add_data_arguments, run_data_command
from .model import TransformerConfig as ModelConfig
from .tasks import TransformerDataConfig as DataConfig
from .tasks import (batch_tokens, build_train_network, create_train_dataset, evaluate, plan_inputs,
                    prepare_data, run_eval, run_translate, sample_text)
