"""GPT-2's hooks (the model-folder contract, model_zoo/models/base.py): the model and data
sections, data preparation, the training network, evaluation, generation, conversion.
Everything but the model, the training network and the converter is what decoder-only
folders share (`model_zoo.causal_lm`), bound here by name: the trainer and the command line
reach a model only through the names of this module, so a copy of this folder is a new
model.
"""

from dataclasses import dataclass

from model_zoo.causal_lm import data, tasks
from model_zoo.config import Config

from . import convert
from .model import GPT2Config, GPT2ForTraining


@dataclass
class GPT2DataConfig(tasks.CausalLMDataConfig):
    """GPT-2's `data` section (`CausalLMDataConfig`)."""

    dataset_dir: str = "datasets/gpt2"


ModelConfig = GPT2Config
DataConfig = GPT2DataConfig


def build_train_network(config: Config, compute_dtype):
    """The cell the trainer optimises: token ids (batch, seq_length + 1) -> mean loss."""
    return GPT2ForTraining(config.model, config.parallel, compute_dtype)


# The hooks decoder-only folders share (`model_zoo.causal_lm`), bound by name.
dataset_ready = tasks.dataset_ready
prepare_data = tasks.prepare_data
plan_inputs = tasks.plan_inputs
random_batch = tasks.random_batch
inference_graphs = tasks.inference_graphs
create_train_dataset = tasks.create_train_dataset
create_heldout_dataset = tasks.create_heldout_dataset
evaluate = tasks.evaluate
sample_text = tasks.sample_text
run_generate = tasks.run_generate
add_data_arguments = data.add_data_arguments
run_data_command = data.run_data_command
add_convert_arguments = convert.add_convert_arguments
run_convert_command = convert.run_convert_command
