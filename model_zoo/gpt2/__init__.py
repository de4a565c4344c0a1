"""GPT-2: a decoder-only language model.

This folder is a template: copy it to `model_zoo/<name>` and set `model.name: <name>`.
The names below are what the trainer and the command line use.
"""

from .convert import add_convert_arguments, run_convert_command
from .data import add_data_arguments, run_data_command
from .model import GPT2Config as ModelConfig
from .tasks import GPT2DataConfig as DataConfig
from .tasks import (build_train_network, create_train_dataset, evaluate, plan_inputs, prepare_data,
                    run_eval, run_generate, sample_text)
