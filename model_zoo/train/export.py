"""`model-zoo export`: a checkpoint as MindIR graphs for inference.

The model folder's `inference_graphs(config, network, batch_size)` names the graphs
(`{name: (cell, example inputs)}`: GPT-2's logits, BERT's masked-LM or classifier logits,
the Transformer's encoder, cross-attention keys and values, and decoder step); each is
exported with MindSpore's `export` at the batch size given, and loads with
`mindspore.load(path)` + `nn.GraphCell`.
"""

import os

import mindspore as ms

from model_zoo.config import import_model
from model_zoo.errors import UserInputError
from model_zoo.files import check_output_file, make_directory
from model_zoo.checkpoint.files import load_network


def export_paths(output: str, names) -> dict:
    """{graph name: its .mindir path}: `output` itself for one graph, else
    `<output stem>_<name>.mindir` for each."""
    stem = output[:-len(".mindir")] if output.endswith(".mindir") else output
    if len(names) == 1:
        return {names[0]: stem + ".mindir"}
    return {name: f"{stem}_{name}.mindir" for name in names}


def export_checkpoint(config, ckpt: str, batch_size: int = 1, output: str = "") -> dict:
    """Export the graphs of `ckpt`'s model; returns {graph name: written path}."""
    module = import_model(config.model.name)
    if not hasattr(module, "inference_graphs"):
        raise UserInputError(f"model {config.model.name!r} has no inference graphs to export")
    if batch_size < 1:
        raise UserInputError(f"--batch-size must be >= 1, got {batch_size}")
    if output:   # before the work
        check_output_file(output, "--output")
    network = load_network(config, ckpt)
    graphs = module.inference_graphs(config, network, batch_size)
    paths = export_paths(output or os.path.splitext(ckpt)[0], list(graphs))
    for name, (cell, inputs) in graphs.items():
        cell.set_train(False)
        make_directory(os.path.dirname(os.path.abspath(paths[name])))
        # export appends the .mindir suffix itself
        ms.export(cell, *inputs, file_name=paths[name][:-len(".mindir")], file_format="MINDIR")
    return paths
