"""One rank of the multi-process gradient-norm test (tests/test_parallel_step.py).

Each rank holds, of a random gradient set of a tiny GPT-2, the pieces a layout gives it
(`replication.device_piece`), runs the train step's GradientNorm in graph mode with a real
all-reduce over the world group, and prints one JSON line per case with what it got and
numpy's norm of the whole set. Then rank 3 plants an inf in one of its pieces: every rank
must decide the step is not finite.
"""

import json
import sys

import numpy as np
import mindspore as ms
from mindspore import Tensor
from mindspore.communication import get_group_size, get_rank, init

LAYOUTS = {
    "dp2-mp2": {"data_parallel": 2, "model_parallel": 2},
    "mp2-pp2": {"model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 2},
    "dp2-mp2-shard": {"data_parallel": 2, "model_parallel": 2, "optimizer_shard": True},
}


def layout_params(parallel_section):
    from model_zoo.config import config_from_dict
    from model_zoo.cost.build import build_plan
    raw = {"model": {"name": "gpt2", "num_layers": 2, "hidden_size": 256, "num_heads": 4,
                     "seq_length": 16, "vocab_size": 512},
           "parallel": {"vocab_emb_dp": False, **parallel_section},
           "train": {"global_batch_size": 16}, "data": {"dataset_dir": "unused"}}
    plan = build_plan(config_from_dict(raw, layout_checked=False))
    assert not plan.violations, plan.violations
    return plan.config.parallel, list(plan.recording.params.values())


def main():
    init()
    rank, size = get_rank(), get_group_size()
    from model_zoo.parallel.replication import device_piece, norm_weights, stage_of_rank
    from model_zoo.train.step import GradientNorm
    for name, section in LAYOUTS.items():
        parallel, params = layout_params(section)
        assert parallel.device_num == size, (name, parallel.device_num, size)
        ms.set_context(mode=ms.GRAPH_MODE)
        grads = [np.random.default_rng(index).standard_normal(p.shape).astype(np.float32)
                 for index, p in enumerate(params)]
        expected = float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads)))
        pieces = [device_piece(p, parallel, rank) for p in params]
        local = [g[piece] if piece is not None else np.zeros(1, np.float32)
                 for g, piece in zip(grads, pieces)]
        norm_cell = GradientNorm(norm_weights(params, parallel, stage_of_rank(rank, parallel)),
                                 all_reduce=True)
        norm, finite = norm_cell(tuple(Tensor(g) for g in local))
        if rank == 3:
            held = next(i for i, piece in enumerate(pieces) if piece is not None)
            local[held] = local[held].copy()
            local[held].flat[0] = np.inf
        _, finite_after_inf = norm_cell(tuple(Tensor(g) for g in local))
        print(json.dumps({"layout": name, "rank": rank, "norm": float(norm.asnumpy()),
                          "expected": expected, "finite": bool(finite.asnumpy()),
                          "finite_after_inf": bool(finite_after_inf.asnumpy()),
                          "pieces_held": sum(piece is not None for piece in pieces)}),
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
