"""The generated sections of docs/parallelism.md: every sharded layer's strategies in terms
of dp and mp, and every shipped layout with its memory (`model-zoo plan --update-docs`)."""

import os
from typing import Dict, List, Optional

import mindspore as ms
from mindspore import nn

from model_zoo.parallel.config import ParallelConfig
from model_zoo.config import load_config
from model_zoo.cost.build import Plan, build_plan
from model_zoo.plan.report import count_text, gib
from model_zoo.layout.recording import PlanError, strategy_of
from model_zoo.layout.trace import primitives

MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")

# --- the strategy table of docs/parallelism.md (generated, so it cannot drift) ---------------

SYMBOL_DP, SYMBOL_MP = 3, 5     # distinct primes: every strategy value decodes to dp/mp


def _layer_examples():
    """(layer, variant, factory(parallel_config)) for every sharded layer of model_zoo/nn/.

    Sizes are multiples of SYMBOL_MP so that every layer builds with mp = 5; the table shows
    the layers as Ascend builds them (`backend.kernels_for`).
    """
    from model_zoo.nn import attention, grouped_attention as G, layers as L, loss, rotary
    h, heads, ffn, vocab, seq = 60, 5, 120, 60, 8
    return [
        ("Linear", 'split="column"', lambda pc: L.Linear(h, ffn, split="column",
                                                           parallel_config=pc)),
        ("Linear", 'split="column", activation="gelu"',
         lambda pc: L.Linear(h, ffn, split="column", activation="gelu", parallel_config=pc)),
        ("Linear", 'split="row"', lambda pc: L.Linear(ffn, h, split="row", parallel_config=pc)),
        ("Linear", 'split="row", sequence_parallel', lambda pc: L.Linear(
            ffn, h, split="row", parallel_config=_with(pc, sequence_parallel=True))),
        ("Linear", 'split="none"', lambda pc: L.Linear(h, h, parallel_config=pc)),
        ("ExactGELU", "strategy (dp, mp)", lambda pc: L.ExactGELU((pc.dp, pc.mp))),
        ("Dropout", "strategy (dp, 1, 1)", lambda pc: L.Dropout(0.1, (pc.dp, 1, 1))),
        ("Dropout", "stream_dropout, sequence_parallel", lambda pc: L.stream_dropout(
            0.1, _with(pc, sequence_parallel=True))),
        ("LayerNorm", "", lambda pc: L.LayerNorm(h, parallel_config=pc)),
        ("LayerNorm", "sequence_parallel", lambda pc: L.LayerNorm(
            h, parallel_config=_with(pc, sequence_parallel=True))),
        ("VocabEmbedding", "vocab_emb_dp: true", lambda pc: L.VocabEmbedding(
            vocab, h, parallel_config=_with(pc, vocab_emb_dp=True))),
        ("VocabEmbedding", "vocab_emb_dp: false", lambda pc: L.VocabEmbedding(
            vocab, h, parallel_config=_with(pc, vocab_emb_dp=False))),
        ("PositionEmbedding", "", lambda pc: L.PositionEmbedding(seq, h, parallel_config=pc)),
        ("SinusoidalPositionEncoding", "",
         lambda pc: L.SinusoidalPositionEncoding(seq, h, parallel_config=pc)),
        ("MultiHeadAttention", "causal=True", lambda pc: attention.MultiHeadAttention(
            h, heads, parallel_config=pc, causal=True, max_seq_length=seq,
            attention_dropout=0.1, hidden_dropout=0.1)),
        ("MultiHeadAttention", "causal=True, flash=True (910B)",
         lambda pc: attention.MultiHeadAttention(80, heads, parallel_config=pc, causal=True,
                                         max_seq_length=seq, compute_dtype=ms.float16,
                                         flash=True)),
        ("DotProductAttention", "10 query heads, 5 key/value heads, causal",
         lambda pc: attention.DotProductAttention(2 * heads, h // heads, parallel_config=pc,
                                                  num_kv_heads=heads, causal=True,
                                                  max_seq_length=seq)),
        ("FlashAttention", "padding mask (not causal), 910B",
         lambda pc: attention.FlashAttention(heads, 16, parallel_config=pc, causal=False,
                                             attention_dropout=0.0,
                                             compute_dtype=ms.float16)),
        ("FeedForward", 'activation="gelu"', lambda pc: L.FeedForward(
            h, ffn, parallel_config=pc, hidden_dropout=0.1)),
        ("GatedFeedForward", "SwiGLU", lambda pc: L.GatedFeedForward(
            h, ffn, parallel_config=pc)),
        ("RMSNorm", "", lambda pc: L.RMSNorm(h, parallel_config=pc)),
        ("RMSNorm", "sequence_parallel", lambda pc: L.RMSNorm(
            h, parallel_config=_with(pc, sequence_parallel=True))),
        ("RotaryEmbedding", "", lambda pc: rotary.RotaryEmbedding(h // heads, parallel_config=pc)),
        ("GroupedQueryAttention", "10 query heads, 5 key/value heads",
         lambda pc: G.GroupedQueryAttention(h, 2 * heads, heads, parallel_config=pc,
                                            max_seq_length=seq)),
        ("GroupedQueryAttention", "10 query heads of 16, 5 key/value heads, flash=True (910B)",
         lambda pc: G.GroupedQueryAttention(160, 2 * heads, heads, parallel_config=pc,
                                            max_seq_length=seq, compute_dtype=ms.float16,
                                            flash=True)),
        ("PaddingBias", "", lambda pc: L.PaddingBias(parallel_config=pc)),
        ("ResidualAdd", "", lambda pc: L.ResidualAdd(parallel_config=pc)),
        ("ResidualAdd", "sequence_parallel", lambda pc: L.ResidualAdd(
            parallel_config=_with(pc, sequence_parallel=True))),
        ("VocabProjection", "vocab_emb_dp: true", lambda pc: L.VocabProjection(
            h, parallel_config=_with(pc, vocab_emb_dp=True))),
        ("VocabProjection", "vocab_emb_dp: false", lambda pc: L.VocabProjection(
            h, parallel_config=_with(pc, vocab_emb_dp=False))),
        ("VocabProjection", "untied (a table of its own), vocab_emb_dp: false",
         lambda pc: L.VocabProjection(h, parallel_config=_with(pc, vocab_emb_dp=False),
                                      vocab_size=vocab)),
        ("CrossEntropy", "class_split=1", lambda pc: loss.CrossEntropy(parallel_config=pc)),
        ("CrossEntropy", "class_split=mp (vocabulary-split head)",
         lambda pc: loss.CrossEntropy(parallel_config=pc, class_split=pc.mp)),
    ]


def _with(parallel: ParallelConfig, **changes) -> ParallelConfig:
    import dataclasses
    return dataclasses.replace(parallel, **changes)


# cells of model_zoo/nn/ without strategies of their own, and why
NOT_SHARDED = {"AttentionLayer": "the base of the attention layers, which are shown",
               "FusedCpuAttention": "CPU kernels, which take no strategy",
               "DecodeBlockPart": "CPU kernels of a decoding step, which take no strategy",
               "AttentionBlockPart": "CPU kernels of a decoding step",
               "GroupedAttentionBlockPart": "CPU kernels of a decoding step",
               "FeedForwardBlockPart": "CPU kernels of a decoding step",
               "GatedFeedForwardBlockPart": "CPU kernels of a decoding step",
               "MatMulProduct": "the product of Linear and VocabProjection, shown there",
               "LayerNormOperators": "the operators of LayerNorm, shown there",
               "RMSNormOperators": "the operators of RMSNorm, shown there",
               "StreamAdd": "the operators of ResidualAdd, shown there"}


def sharded_layer_names() -> List[str]:
    """Every nn.Cell subclass defined in model_zoo/nn/ (layers, attention, grouped attention,
    loss) but those of NOT_SHARDED."""
    from model_zoo.nn import attention, grouped_attention, layers, loss, rotary
    return sorted(name for module in (layers, attention, grouped_attention, loss, rotary)
                  for name, value in vars(module).items()
                  if isinstance(value, type) and issubclass(value, nn.Cell)
                  and value.__module__ == module.__name__ and name not in NOT_SHARDED)


def _symbol(value: int) -> str:
    names = []
    for prime, name in ((SYMBOL_DP, "dp"), (SYMBOL_MP, "mp")):
        while value % prime == 0:
            names.append(name)
            value //= prime
    if value != 1:
        names.append(str(value))
    return "·".join(names) or "1"


def _symbolic(strategy) -> str:
    parts = ["(" + ", ".join(_symbol(v) for v in part) + ("," if len(part) == 1 else "") + ")"
             for part in strategy]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def _communication_note(prim, strategy) -> str:
    name = prim.name
    try:
        if name in ("MatMul", "BatchMatMul"):
            notes = []
            x, w = strategy
            tb = bool(prim.attrs.get("transpose_b", False))
            ta = bool(prim.attrs.get("transpose_a", False))
            k = x[-2] if ta else x[-1]
            n = w[-2] if tb else w[-1]
            m = x[-1] if ta else x[-2]
            out = strategy_of(prim, "out_strategy")
            if k != 1 and out and out[0][0] == m * k:
                notes.append(f"forward reduce-scatter over {_symbol(k)} (output "
                             f"`{_symbolic(out)}`), backward all-gather of its gradient")
            elif k != 1:
                notes.append(f"forward all-reduce over {_symbol(k)}")
            if n != 1:
                notes.append(f"backward all-reduce of the input gradient over {_symbol(n)} "
                             f"(with sequence parallel: the reduce-scatter of its gathered "
                             f"input)")
            return "; ".join(notes) or "none"
        if name == "Gather" and strategy[0][0] != 1:
            return f"vocabulary split: masked lookup, all-reduce over {_symbol(strategy[0][0])}"
        if name in ("ReduceSum", "ReduceMean") and any(v != 1 for v in strategy[0]):
            return "all-reduce of the partial sums when a reduced axis is split"
        if name in ("ReduceMax", "ReduceMin") and any(v != 1 for v in strategy[0]):
            return "all-reduce (max / min) when a reduced axis is split"
    except (IndexError, TypeError, ValueError):
        pass
    return "none"


def strategy_table() -> str:
    """Markdown: every sharded layer's operators and strategies in terms of dp and mp."""
    from model_zoo.nn.backend import kernels_for
    parallel = ParallelConfig(data_parallel=SYMBOL_DP, model_parallel=SYMBOL_MP,
                              vocab_emb_dp=False)
    lines = ["| layer | variant | operator (attribute) | strategy | communication |",
             "|---|---|---|---|---|"]
    for layer, variant, factory in _layer_examples():
        with kernels_for("Ascend", described_only=True):
            cell = factory(parallel)
        for name, _, attr, prim in primitives(cell):
            strategy = strategy_of(prim)
            if strategy is None:
                continue
            where = f"{name}.{attr}" if name else attr
            lines.append(f"| `{layer}` | {variant} | {prim.name} (`{where}`) | "
                         f"`{_symbolic(strategy)}` | {_communication_note(prim, strategy)} |")
    return "\n".join(lines)


def plan_config_files() -> List[str]:
    """Every shipped layout config: model_zoo/models/<model>/configs/plan/*.yaml, sorted."""
    import glob
    return sorted(glob.glob(os.path.join(MODELS_DIR, "*", "configs", "plan", "*.yaml")))


CPU_CONFIGS = ("tiny.yaml", "finetune.yaml")   # the configs each model trains on a CPU


def cluster_config_files() -> List[str]:
    """Every shipped config meant for a cluster: model_zoo/models/<model>/configs/*.yaml
    but the CPU ones, then the layout configs (`plan_config_files`)."""
    import glob
    found = sorted(path for path in glob.glob(os.path.join(MODELS_DIR, "*", "configs",
                                                           "*.yaml"))
                   if os.path.basename(path) not in CPU_CONFIGS)
    return found + plan_config_files()


def shown_path(path: str) -> str:
    """A shipped config's path as the docs show it: model_zoo/models/<model>/configs/..."""
    return os.path.relpath(path, os.path.dirname(os.path.dirname(MODELS_DIR)))


def layout_table(plans: Optional[Dict[str, Plan]] = None) -> str:
    """Markdown: every shipped layout config with its devices, estimated memory, the
    communication of its busiest stage and the predicted step time, on the device it is
    planned on by default (`cost.build.default_device`)."""
    lines = ["| config | parameters | dp x mp x pp | devices | micro batches x accumulation | "
             "device | memory per device (worst stage) | fits | pipeline bubble | "
             "communication per device a step (busiest stage) | predicted step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in plan_config_files():
        relative = shown_path(path)
        plan = (plans or {}).get(relative)
        if plan is None:
            plan = build_plan(load_config(path, layout_checked=False), relative)
        p, accumulation = plan.config.parallel, plan.config.train.grad_accumulation
        lines.append(f"| `{relative}` | {count_text(plan.parameter_count)} | "
                     f"{p.dp} x {p.mp} x {p.pipeline_stage} | {plan.device_num} | "
                     f"{p.micro_batch_num} x {accumulation} | {plan.profile.name} | "
                     f"{gib(plan.worst_stage.total)} GiB (stage {plan.worst_stage.stage}) | "
                     f"{'yes' if plan.fits else 'NO'} | {100 * plan.bubble:.0f}% | "
                     f"{gib(max(c.total for c in plan.communication))} GiB | "
                     f"{plan.time.step:.3g} s ({plan.time.tokens_per_s:,.0f} tokens/s) |")
    return "\n".join(lines)


def _marker(name: str, end: bool = False) -> str:
    if end:
        return f"<!-- END GENERATED {name} -->"
    return (f"<!-- BEGIN GENERATED {name}: `model-zoo plan --update-docs` writes this "
            f"section; do not edit it by hand -->")


def generated_sections(plans=None) -> Dict[str, str]:
    return {"strategies": strategy_table(), "layouts": layout_table(plans)}


def render_doc(text: str, sections: Dict[str, str], path: str) -> str:
    """`text` (the file at `path`) with every generated section replaced by its current
    content."""
    for name, body in sections.items():
        begin, end = _marker(name), _marker(name, end=True)
        if begin not in text or end not in text:
            raise PlanError(f"{path} lacks the markers of the generated section {name!r}")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{body}\n{end}{tail}"
    return text
