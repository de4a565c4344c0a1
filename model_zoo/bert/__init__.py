"""BERT: a bidirectional Transformer encoder pretrained with masked LM and next sentence
prediction, fine-tuned for classification.

The names below are what the trainer and the command line use.
"""

from .convert import add_convert_arguments, run_convert_command
from .data import add_data_arguments, run_data_command
from .model import BertConfig as ModelConfig
from .tasks import BertDataConfig as DataConfig
from .tasks import (build_train_network, create_train_dataset, evaluate, plan_inputs, prepare_data,
                    run_eval, run_fill_mask, sample_text)
