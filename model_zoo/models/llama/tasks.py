"""LLaMA's hooks (the model-folder contract, model_zoo/models/base.py): its model, data
section, training network and converter, and what decoder-only folders share (as GPT-2's)."""

from dataclasses import dataclass

from model_zoo.causal_lm import data, tasks
from model_zoo.config import Config

from . import convert
from .model import LlamaConfig, LlamaForTraining


@dataclass
class LlamaDataConfig(tasks.CausalLMDataConfig):
    """LLaMA's `data` section (`CausalLMDataConfig`)."""

    dataset_dir: str = "datasets/llama"


ModelConfig = LlamaConfig
DataConfig = LlamaDataConfig


def build_train_network(config: Config, compute_dtype):
    """The cell the trainer optimises: token ids (batch, seq_length + 1) -> mean loss."""
    return LlamaForTraining(config.model, config.parallel, compute_dtype)


# The hooks decoder-only folders share (`model_zoo.causal_lm`), bound by name.
# Copied from model_zoo.models.gpt2.tasks
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
