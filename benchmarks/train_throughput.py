"""Training throughput side by side with the reference implementation, on this machine.

One run measures, each side in its own process so that neither's threads or memory
disturb the other:
- ours: the model folder's training network and the trainer's TrainStep (AdamW, gradient
  clipping), in the trainer's MindSpore context;
- the reference at the same shapes, dropout, optimizer and clipping: Hugging Face
  GPT2LMHeadModel / BertForPreTraining, or `torch.nn.Transformer` with a tied embedding
  and output projection for the translation model;
- the machine's GEMM peak: the best of torch's, MindSpore's and our 2048x2048 float32
  matmul, measured before each round (the best round counts);
- our data pipeline's tokens/s on the real dataset (skip with --skip-data);
- with --trainer, `model-zoo train` itself at the same configuration on the real dataset,
  with a progress line every step and every 100 steps: its step rate against ours above,
  and the share of its own wall time spent outside the step's call (the time the trainer
  adds: data, logging, host reads), which a machine's drift between runs does not blur.

Both sides train on the same fixed random batch. Tokens/s is the median over the timed
steps after warm-up, from the faster of `--rounds` runs per side (the sides alternate); the
first step (MindSpore's graph compilation) is reported apart. On a virtual machine the
report adds the share of CPU time the host gave to its other guests during each side's
rounds ("steal"): figures taken while it is high say more about the host than the code.

Model FLOPs (MFU = model FLOPs per second / GEMM peak) count the matrix products the
model needs, 2*m*n*k each, times 3 for forward plus backward:
- per self-attention layer over s tokens of width d: 8*s*d^2 (Q, K, V, output) plus
  4*s^2*d (scores and context, the whole square: the same count for both sides,
  although ours skips the masked blocks of causal attention over 128 positions or more);
- per cross-attention layer (s_t queries over s_s keys): 4*s_t*d^2 + 4*s_s*d^2 + 4*s_t*s_s*d;
- per feed-forward: 4*s*d*f;
- output projection: 2*s*d*V per predicted position (GPT-2, Transformer: every target
  position; BERT: the masked positions, plus their d x d transform, the pooler and NSP).
Embedding lookups, norms, softmax and the optimizer are not counted.

Usage:
    python benchmarks/train_throughput.py --model gpt2 --size small
    python benchmarks/train_throughput.py --model bert --config my.yaml --steps 30
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = ("gpt2", "llama", "mixtral", "bert", "transformer")
DECODERS = ("gpt2", "llama", "mixtral")
# "small" is the shape of the issue that set the goal: 4 layers, hidden 256, 4 heads,
# sequence 128, batch 8, vocabulary 8192 (on top of the model's tiny config).
SMALL = ["model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
         "model.seq_length=128", "model.vocab_size=8192", "train.global_batch_size=8"]
SIZE_OVERRIDES = {
    "tiny": {model: [] for model in MODELS},
    # LLaMA: 4 query heads over 2 key/value heads, SwiGLU width 2/3 of 4 x hidden (rounded)
    "small": {"gpt2": SMALL, "llama": SMALL + ["model.num_kv_heads=2",
                                               "model.ffn_hidden_size=704"],
              # 4 experts of LLaMA's width, 2 a token (twice LLaMA's feed-forward work)
              "mixtral": SMALL + ["model.num_kv_heads=2", "model.ffn_hidden_size=704"],
              "transformer": SMALL + ["model.ffn_hidden_size=1024"],
              "bert": SMALL + ["data.max_predictions_per_seq=20"]},
}


def benchmark_config_source(args):
    """(config path, overrides) of the benchmarked configuration."""
    path = args.config or os.path.join(ROOT, "model_zoo", "models", args.model, "configs",
                                       "tiny.yaml")
    overrides = [] if args.config else list(SIZE_OVERRIDES[args.size][args.model]) + [
        f"data.dataset_dir=datasets/benchmark-{args.model}-{args.size}"]
    # no warmup, and a cosine decay over the config's steps: the learning rate stays within
    # 1% of train.lr over a benchmark, as in the reference, so both losses are comparable
    overrides += ["train.warmup_steps=0", "train.lr_schedule=cosine"]
    return path, overrides + list(args.set)


def load_benchmark_config(args):
    from model_zoo.config import load_config
    path, overrides = benchmark_config_source(args)
    config = load_config(path, overrides)
    if config.model.name != args.model:
        raise SystemExit(f"--config {path} is a {config.model.name} config, not {args.model}")
    return config


# ----------------------------------------------------------------------------------------
# Batches and FLOPs: one definition per model, shared by both sides.

def synthetic_batch(config, seed=0):
    """The model's batch columns (numpy, the dataset's order) with random tokens."""
    rng = np.random.default_rng(seed)
    model, batch = config.model, config.train.global_batch_size
    seq, vocab = model.seq_length, model.vocab_size
    if model.name in DECODERS:
        return [rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32)]
    if model.name == "bert":
        predictions = config.data.max_predictions_per_seq
        positions = np.stack([np.sort(rng.choice(np.arange(1, seq), predictions, replace=False))
                              for _ in range(batch)]).astype(np.int32)
        return [rng.integers(5, vocab, (batch, seq), dtype=np.int32),
                (np.arange(seq)[None, :] >= seq // 2).repeat(batch, 0).astype(np.int32),
                np.ones((batch, seq), np.int32), positions,
                rng.integers(5, vocab, (batch, predictions), dtype=np.int32),
                np.ones((batch, predictions), np.float32),
                rng.integers(0, 2, (batch,), dtype=np.int32)]
    # transformer: sources and targets of random lengths in [seq/2, seq], padded with 0
    columns = []
    for _ in range(2):
        lengths = rng.integers(seq // 2, seq + 1, batch)
        mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
        columns.append((rng.integers(4, vocab, (batch, seq), dtype=np.int32) * mask, mask))
    (source_ids, source_mask), (target_ids, target_mask) = columns
    decoder_input = np.concatenate([np.full((batch, 1), 2, np.int32), target_ids[:, :-1]], 1)
    return [source_ids, source_mask, decoder_input * target_mask, target_mask, target_ids]


def batch_tokens(config, batch) -> int:
    """Tokens one step trains on: real source plus target tokens for translation."""
    if config.model.name == "transformer":
        return int(batch[1].sum() + batch[3].sum())
    return config.train.global_batch_size * config.model.seq_length


def train_flops(config, batch) -> float:
    """Model FLOPs of one training step (see the module docstring)."""
    model = config.model
    d, f, layers, vocab = model.hidden_size, model.ffn_size, model.num_layers, model.vocab_size
    samples, seq = config.train.global_batch_size, model.seq_length

    def self_attention(s):
        return 8 * s * d * d + 4 * s * s * d

    def feed_forward(s):
        return 4 * s * d * f

    if model.name == "gpt2":
        forward = layers * (self_attention(seq) + feed_forward(seq)) + 2 * seq * d * vocab
    elif model.name in ("llama", "mixtral"):   # grouped key/value projections, SwiGLU
        kv = 2 * d * model.kv_heads // model.num_heads
        attention = 4 * seq * d * d + 2 * seq * d * kv + 4 * seq * seq * d
        if model.name == "mixtral":   # the router, and k experts' SwiGLU a token
            experts = 2 * seq * d * model.num_experts + 6 * seq * d * model.expert_size \
                * model.num_experts_per_tok
        else:
            experts = 6 * seq * d * f
        forward = layers * (attention + experts) + 2 * seq * d * vocab
    elif model.name == "bert":
        predictions = config.data.max_predictions_per_seq
        forward = (layers * (self_attention(seq) + feed_forward(seq))
                   + predictions * (2 * d * d + 2 * d * vocab) + 2 * d * d + 4 * d)
    else:  # transformer: both sides are padded to seq_length and computed whole
        cross = 4 * seq * d * d + 4 * seq * d * d + 4 * seq * seq * d
        forward = (layers * (self_attention(seq) + feed_forward(seq))
                   + layers * (self_attention(seq) + cross + feed_forward(seq))
                   + 2 * seq * d * vocab)
    return 3.0 * forward * samples


# ----------------------------------------------------------------------------------------
# The sides. Each runs in a child process and prints one JSON line.

def time_steps(run_step, steps, warmup):
    """(first step seconds, [timed step seconds], first loss, last loss)."""
    started = time.perf_counter()
    first_loss = run_step()
    first = time.perf_counter() - started
    times, loss = [], first_loss
    for index in range(warmup + steps):
        started = time.perf_counter()
        loss = run_step()
        if index >= warmup:
            times.append(time.perf_counter() - started)
    return first, times, first_loss, loss


def rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(config, batch, steps, warmup, profile_dir=None):
    import mindspore as ms
    from model_zoo.config import import_model
    from model_zoo.parallel.context import init_parallel
    from model_zoo.nn.layers import dtype_of
    from model_zoo.train.trainer import build_train_step

    context = init_parallel(config.parallel, "CPU")
    ms.set_seed(config.train.seed)
    baseline = rss_mb()
    module = import_model(config.model.name)
    network = module.build_train_network(config, dtype_of(config.train.precision))
    step_cell = build_train_step(config, network, context)
    step_cell.set_train(True)
    tensors = [ms.Tensor(column) for column in batch]

    def run_step():
        return float(step_cell(*tensors)[0].asnumpy())

    timing = time_steps(run_step, steps, warmup)
    operators = profile_operators(run_step, profile_dir) if profile_dir else None
    return timing, baseline, operators


PROFILED_STEPS = 5


def profile_operators(run_step, output_dir, top=15):
    """Run a few more steps under MindSpore's profiler; [(operator type, ms per step, calls
    per step)] for the costliest operator types (the profiler's full output stays in
    output_dir)."""
    import csv
    import glob
    from mindspore.profiler import Profiler
    profiler = Profiler(output_path=output_dir)
    for _ in range(PROFILED_STEPS):
        run_step()
    profiler.stop()
    profiler.analyse()
    table = sorted(glob.glob(os.path.join(output_dir, "*", "FRAMEWORK", "cpu_op_type_info_*.csv")),
                   key=os.path.getmtime)[-1]
    with open(table, newline="", encoding="utf-8") as handle:
        rows = [(row["op_type"], float(row["total_compute_time"]) / PROFILED_STEPS,
                 int(row["execution_frequency(per-step)"])) for row in csv.DictReader(handle)]
    return sorted(rows, key=lambda row: -row[1])[:top]


def run_reference(config, batch, steps, warmup, profile_dir=None):
    import torch
    torch.manual_seed(config.train.seed)
    baseline = rss_mb()
    model, loss_of = reference_model(config, [torch.from_numpy(column) for column in batch])
    model.train()
    train = config.train
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)

    def run_step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of()
        loss.backward()
        if train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        return float(loss.detach())

    return time_steps(run_step, steps, warmup), baseline, None


def reference_model(config, batch):
    """(torch module, closure computing the loss on `batch`) for config's model."""
    import torch
    model = config.model
    if model.name in DECODERS:
        net = reference_decoder(model)
        (ids,) = batch
        inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].reshape(-1).long()

        def loss_of():
            if model.name == "mixtral":   # with the load-balancing loss, as ours trains
                out = net(input_ids=inputs, output_router_logits=True)
                return torch.nn.functional.cross_entropy(
                    out.logits.reshape(-1, model.vocab_size), labels) \
                    + model.router_aux_loss_coef * out.aux_loss
            logits = net(input_ids=inputs).logits
            return torch.nn.functional.cross_entropy(logits.reshape(-1, model.vocab_size), labels)
        return net, loss_of
    if model.name == "bert":
        from transformers import BertConfig, BertForPreTraining
        net = BertForPreTraining(BertConfig(
            vocab_size=model.vocab_size, hidden_size=model.hidden_size,
            num_hidden_layers=model.num_layers, num_attention_heads=model.num_heads,
            intermediate_size=model.ffn_size, hidden_dropout_prob=model.dropout,
            attention_probs_dropout_prob=model.attention_dropout,
            max_position_embeddings=model.seq_length, layer_norm_eps=model.layer_norm_eps))
        ids, types, mask, positions, masked_ids, _weights, nsp = batch
        labels = torch.full(ids.shape, -100, dtype=torch.long)
        labels.scatter_(1, positions.long(), masked_ids.long())

        def loss_of():
            return net(input_ids=ids.long(), token_type_ids=types.long(), attention_mask=mask,
                       labels=labels, next_sentence_label=nsp.long()).loss
        return net, loss_of
    net = ReferenceTranslationModel(model)
    source, source_mask, decoder_input, decoder_mask, labels = (column.long() for column in batch)
    targets = torch.where(decoder_mask.bool(), labels, torch.full_like(labels, -100)).reshape(-1)

    def loss_of():
        logits = net(source, source_mask, decoder_input)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, model.vocab_size), targets,
                                                 ignore_index=-100,
                                                 label_smoothing=model.label_smoothing)
    return net, loss_of


def reference_decoder(model):
    """Hugging Face's GPT2LMHeadModel, LlamaForCausalLM or MixtralForCausalLM with
    `model`'s shape."""
    if model.name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        return GPT2LMHeadModel(GPT2Config(
            vocab_size=model.vocab_size, n_positions=model.seq_length, n_embd=model.hidden_size,
            n_layer=model.num_layers, n_head=model.num_heads, n_inner=model.ffn_size,
            resid_pdrop=model.dropout, embd_pdrop=model.dropout,
            attn_pdrop=model.attention_dropout, layer_norm_epsilon=model.layer_norm_eps))
    if model.name == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM
        return MixtralForCausalLM(MixtralConfig(
            vocab_size=model.vocab_size, hidden_size=model.hidden_size,
            intermediate_size=model.expert_size, num_hidden_layers=model.num_layers,
            num_attention_heads=model.num_heads, num_key_value_heads=model.kv_heads,
            num_local_experts=model.num_experts,
            num_experts_per_tok=model.num_experts_per_tok,
            router_aux_loss_coef=model.router_aux_loss_coef,
            max_position_embeddings=model.seq_length, rms_norm_eps=model.rms_norm_eps,
            rope_theta=model.rope_theta, tie_word_embeddings=model.tie_word_embeddings,
            attention_dropout=model.attention_dropout))
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size,
        intermediate_size=model.ffn_size, num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads, num_key_value_heads=model.kv_heads,
        max_position_embeddings=model.seq_length, rms_norm_eps=model.rms_norm_eps,
        rope_theta=model.rope_theta, tie_word_embeddings=model.tie_word_embeddings,
        attention_dropout=model.attention_dropout))


def ReferenceTranslationModel(model_config):
    """torch.nn.Transformer with a shared, sqrt(d)-scaled embedding, sinusoidal positions
    and the output projection tied to the embedding: the translation model's structure."""
    import torch
    from model_zoo.nn.layers import sinusoid_table

    class Translation(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            d = config.hidden_size
            self.scale = d ** 0.5
            self.embedding = torch.nn.Embedding(config.vocab_size, d)
            torch.nn.init.normal_(self.embedding.weight, std=d ** -0.5)
            self.register_buffer("positions",
                                 torch.from_numpy(sinusoid_table(config.seq_length, d)))
            self.dropout = torch.nn.Dropout(config.dropout)
            self.transformer = torch.nn.Transformer(
                d_model=d, nhead=config.num_heads, num_encoder_layers=config.num_layers,
                num_decoder_layers=config.num_layers, dim_feedforward=config.ffn_size,
                dropout=config.dropout, activation=config.activation.replace("_exact", ""),
                layer_norm_eps=config.layer_norm_eps, batch_first=True,
                norm_first=config.norm_placement == "pre")

        def embed(self, ids):
            return self.dropout(self.embedding(ids) * self.scale
                                + self.positions[: ids.shape[1]])

        def forward(self, source, source_mask, decoder_input):
            causal = torch.nn.Transformer.generate_square_subsequent_mask(
                decoder_input.shape[1])
            padding = source_mask == 0
            hidden = self.transformer(self.embed(source), self.embed(decoder_input),
                                      tgt_mask=causal, src_key_padding_mask=padding,
                                      memory_key_padding_mask=padding)
            return hidden @ self.embedding.weight.T

    return Translation(model_config)


def model_gemm_shapes(config):
    """(name, m, k, n) of the model's forward products, m the tokens of a batch."""
    model = config.model
    d, f, vocab = model.hidden_size, model.ffn_size, model.vocab_size
    tokens = config.train.global_batch_size * model.seq_length
    return [("QKV", tokens, d, 3 * d), ("feed-forward in", tokens, d, f),
            ("feed-forward out", tokens, f, d), ("vocabulary", tokens, d, vocab)]


def run_gemm(config, size=2048, repeats=10):
    """Best GFLOP/s of float32 products y = x w^T: size x size in torch, in MindSpore's
    MatMul and in our dense kernel (graph mode; the peak is the best of the three), and
    the same at the model's shapes (each MindSpore figure includes one graph call)."""
    import torch
    import mindspore as ms
    from mindspore import nn, ops
    from model_zoo.nn import cpu_kernels
    from model_zoo.parallel.context import set_run_context
    set_run_context("CPU")

    class Product(nn.Cell):
        def __init__(self, kernel):
            super().__init__()
            self.kernel = kernel

        def construct(self, x, w):
            return self.kernel(x, w)

    kernels = {"mindspore": Product(ops.MatMul(transpose_b=True))}
    if cpu_kernels.has_dense():
        kernels["ours"] = Product(cpu_kernels.dense(False))

    def rates(m, k, n):
        x, w = torch.randn(m, k), torch.randn(n, k)
        found = {"torch": best_rate(lambda: torch.nn.functional.linear(x, w), m * k * n,
                                    repeats)}
        tensors = ms.Tensor(x.numpy()), ms.Tensor(w.numpy())
        for name, kernel in kernels.items():
            found[name] = best_rate(lambda: kernel(*tensors).asnumpy(), m * k * n, repeats)
        return found

    square = rates(size, size, size)
    shapes = [dict(name=name, m=m, k=k, n=n, **rates(m, k, n))
              for name, m, k, n in model_gemm_shapes(config)]
    return {"torch_gflops": square["torch"], "mindspore_gflops": square["mindspore"],
            "ours_gflops": square.get("ours"), "peak_gflops": max(square.values()),
            "size": size, "model_shapes": shapes}


def best_rate(run, multiply_adds, repeats):
    run()
    best = min(timed(run) for _ in range(repeats))
    return 2 * multiply_adds / best / 1e9


def timed(run):
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


TRAINER_LOG_STEPS = (1, 100)


def run_trainer(args, log_steps):
    """`model-zoo train` at the benchmark's configuration, on the real dataset (built on first
    use), with a progress line every `log_steps` steps: its steps/s and tokens/s over every
    step after the first (the compilation), from the run's metrics.jsonl."""
    import tempfile
    path, overrides = benchmark_config_source(args)
    overrides += [f"train.steps={args.trainer_steps}", f"train.log_steps={log_steps}",
                  f"train.save_steps={args.trainer_steps}", "train.eval_steps=0"]
    with tempfile.TemporaryDirectory(prefix="trainer-") as output_dir:
        command = [sys.executable, "-m", "model_zoo", "train", path, "--output-dir", output_dir]
        for override in overrides:
            command += ["--set", override]
        run_child(f"model-zoo train, log_steps {log_steps}", command, "model-zoo train")
        with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as handle:
            entries = [entry for entry in map(json.loads, handle) if "samples_per_s" in entry]
    # each entry times the steps since the one before it; the first step is timed alone
    steps = seconds = tokens = outside = 0.0
    previous = 1
    for entry in entries:
        if entry["step"] <= previous:
            continue
        count = entry["step"] - previous
        elapsed = count * entry["step_ms"] / 1e3
        steps, seconds = steps + count, seconds + elapsed
        tokens += entry["tokens_per_s"] * elapsed
        outside += count * entry["outside_step_ms"] / 1e3
        previous = entry["step"]
    # the share of the trainer's own wall time outside the step's call (data, reads, the
    # progress line): what the trainer adds, measured in one process, so that the
    # machine's drift between this run and the benchmark's does not blur it
    return {"log_steps": log_steps, "steps": int(steps), "steps_per_s": steps / seconds,
            "tokens_per_s": tokens / seconds, "outside_step_ms": 1e3 * outside / steps,
            "outside_step_share": outside / seconds}


def run_data(config, steps):
    """Tokens/s our data pipeline delivers from the real dataset (built on first use)."""
    from model_zoo.config import import_model
    from model_zoo.parallel.context import DataShard
    module = import_model(config.model.name)
    module.prepare_data(config)
    shard = DataShard(num_shards=1, shard_id=0, batch_size=config.train.global_batch_size)
    dataset = module.create_train_dataset(config, shard)
    count = getattr(module, "batch_tokens", None)
    per_batch = config.train.global_batch_size * config.model.seq_length
    batches = dataset.create_tuple_iterator(num_epochs=1)
    next(batches)  # the pipeline's start-up
    started, tokens = time.perf_counter(), 0
    for _ in range(steps):
        batch = next(batches)
        tokens += count(batch) if count else per_batch
    elapsed = time.perf_counter() - started
    return {"batches": steps, "tokens_per_s": tokens / elapsed}


def worker(args):
    config = load_benchmark_config(args)
    if args.worker == "gemm":
        result = run_gemm(config)
    elif args.worker == "data":
        result = run_data(config, args.data_batches)
    else:
        batch = synthetic_batch(config)
        runner = run_ours if args.worker == "ours" else run_reference
        (first, times, first_loss, last_loss), baseline, operators = runner(
            config, batch, args.steps, args.warmup, args.profile)
        median = statistics.median(times)
        result = {"first_step_s": first, "median_step_s": median,
                  "mean_step_s": statistics.mean(times),
                  "tokens_per_s": batch_tokens(config, batch) / median,
                  "tflops_per_step": train_flops(config, batch) / 1e12,
                  "first_loss": first_loss, "last_loss": last_loss,
                  "baseline_rss_mb": baseline, "peak_rss_mb": peak_rss_mb()}
        if operators:
            result["operators"] = operators
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------
# The parent: run the sides, combine, print, save.

def run_side(args, side):
    command = [sys.executable, os.path.abspath(__file__), "--worker", side, "--model", args.model,
               "--size", args.size, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--data-batches", str(args.data_batches)]
    command += ["--config", args.config] if args.config else []
    if args.profile and side == "ours":
        command += ["--profile", os.path.abspath(args.profile)]
    for override in args.set:
        command += ["--set", override]
    env = dict(os.environ, GLOG_v=os.environ.get("GLOG_v", "3"))
    times_before = cpu_times()
    process = run_child(side, command, f"the {side} side", env)
    lines = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        child_failed(f"the {side} side", process)
    return dict(json.loads(lines[-1][len("RESULT "):]),
                steal_share=steal_share(times_before, cpu_times()))


def cpu_times():
    """The machine's CPU time counters (the first line of /proc/stat), or None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            return [int(value) for value in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def steal_share(before, after):
    """The share of CPU time between two cpu_times() readings that the hypervisor gave to
    other guests ("steal", the 8th counter): on a shared host, the part of a run's slowness
    that is not the code's."""
    if not before or not after or len(before) < 8 or len(after) < 8:
        return None
    spent = [late - early for early, late in zip(before, after)]
    return spent[7] / sum(spent) if sum(spent) > 0 else 0.0


def best_gemm(runs):
    """The best figure of each product over the GEMM runs (one before each round): the
    machine's peak is what it can do, and a slow spell lowers a single run's figure."""
    best = dict(runs[0])
    for key in ("torch_gflops", "mindspore_gflops", "ours_gflops"):
        if best.get(key) is not None:
            best[key] = max(run[key] for run in runs)
    best["peak_gflops"] = max(run["peak_gflops"] for run in runs)
    best["round_peak_gflops"] = [run["peak_gflops"] for run in runs]
    best["model_shapes"] = [
        {key: max(run["model_shapes"][index][key] for run in runs)
         if isinstance(value, float) else value for key, value in shape.items()}
        for index, shape in enumerate(runs[0]["model_shapes"])]
    return best


def run_child(label, command, what, env=None):
    """Run `command` from the repository's root with its output captured; exit with the
    tail of that output if it fails (`what` names it in the message)."""
    print(f"[{label}] running ...", flush=True)
    process = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if process.returncode != 0:
        child_failed(what, process)
    return process


def child_failed(what, process):
    sys.stderr.write(process.stdout[-4000:] + process.stderr[-4000:])
    raise SystemExit(f"{what} failed (exit code {process.returncode})")


def summarize(args, config, results):
    peak = results["gemm"]["peak_gflops"]
    report = {"model": args.model, "size": args.config or args.size, "rounds": args.rounds,
              "shape": {"layers": config.model.num_layers, "hidden": config.model.hidden_size,
                        "heads": config.model.num_heads, "seq_length": config.model.seq_length,
                        "vocab": config.model.vocab_size,
                        "batch": config.train.global_batch_size,
                        "precision": config.train.precision},
              "gemm": results["gemm"], "timed_steps": args.steps, "warmup_steps": args.warmup}
    for side in ("ours", "reference"):
        side_result = dict(results[side])
        side_result["mfu"] = (side_result["tflops_per_step"] * 1e3 / side_result["median_step_s"]
                              / peak)
        report[side] = side_result
    report["speedup"] = report["ours"]["tokens_per_s"] / report["reference"]["tokens_per_s"]
    if "trainer" in results:
        # against the benchmark's median step (its figure above) and its mean (the trainer's
        # rate is a mean: an occasional slow step counts in it)
        report["trainer"] = [dict(run, vs_benchmark=run["steps_per_s"]
                                  * report["ours"]["median_step_s"],
                                  vs_benchmark_mean=run["steps_per_s"]
                                  * report["ours"]["mean_step_s"])
                             for run in results["trainer"]]
    if "data" in results:
        report["data"] = dict(results["data"], times_training=(
            results["data"]["tokens_per_s"] / report["ours"]["tokens_per_s"]))
    return report


def print_report(report):
    shape = report["shape"]
    print(f"\n{report['model']} {report['size']}: {shape['layers']} layers, hidden "
          f"{shape['hidden']}, {shape['heads']} heads, seq {shape['seq_length']}, vocab "
          f"{shape['vocab']}, batch {shape['batch']}, {shape['precision']}")
    gemm = report["gemm"]
    ours = f", ours {gemm['ours_gflops']:.1f}" if gemm.get("ours_gflops") else ""
    print(f"GEMM peak {gemm['peak_gflops']:.1f} GFLOP/s (torch {gemm['torch_gflops']:.1f}, "
          f"MindSpore {gemm['mindspore_gflops']:.1f}{ours}; {gemm['size']}^3; best of the "
          f"rounds' {_rounded(gemm['round_peak_gflops'])})")
    print(f"  at the model's shapes, GFLOP/s: {'m x k x n':>18}{'torch':>8}{'MindSpore':>11}"
          f"{'ours':>8}")
    for shape in gemm["model_shapes"]:
        size = f"{shape['m']} x {shape['k']} x {shape['n']}"
        ours = f"{shape['ours']:8.1f}" if "ours" in shape else f"{'-':>8}"
        print(f"  {shape['name']:<30}{size:>20}{shape['torch']:8.1f}{shape['mindspore']:11.1f}"
              f"{ours}")
    print(f"{'side':<10}{'tokens/s':>10}{'step ms':>9}{'MFU':>7}{'first step s':>14}"
          f"{'peak MB':>9}{'loss first->last':>20}")
    for side in ("ours", "reference"):
        r = report[side]
        print(f"{side:<10}{r['tokens_per_s']:>10.0f}{r['median_step_s'] * 1e3:>9.1f}"
              f"{r['mfu']:>7.1%}{r['first_step_s']:>14.1f}{r['peak_rss_mb']:>9.0f}"
              f"{r['first_loss']:>11.3f} -> {r['last_loss']:.3f}")
    print(f"ours / reference: {report['speedup']:.2f}x (median step ms per round: ours "
          f"{_rounded(report['ours']['round_step_ms'])}, reference "
          f"{_rounded(report['reference']['round_step_ms'])})")
    steal = [(side, report[side].get("steal_share")) for side in ("ours", "reference")]
    if all(share is not None for _, share in steal):
        print("CPU time taken by the host's other guests (steal) in the rounds kept: " +
              ", ".join(f"{side} {share:.1%}" for side, share in steal))
    if "operators" in report["ours"]:
        print(f"our costliest operators (MindSpore profiler, {PROFILED_STEPS} steps):")
        for name, ms_per_step, calls in report["ours"]["operators"]:
            print(f"  {name:<34}{ms_per_step:8.2f} ms/step  {calls:4d} calls/step")
    for run in report.get("trainer", []):
        print(f"model-zoo train, real data, log_steps {run['log_steps']}: "
              f"{run['tokens_per_s']:.0f} tokens/s over {run['steps']} steps, "
              f"{run['vs_benchmark']:.3f}x the step rate above (its median step; "
              f"{run['vs_benchmark_mean']:.3f}x its mean step); outside the step's call "
              f"{run['outside_step_ms']:.2f} ms a step, {run['outside_step_share']:.1%} of "
              f"its time")
    if "data" in report:
        print(f"data pipeline: {report['data']['tokens_per_s']:.0f} tokens/s, "
              f"{report['data']['times_training']:.1f}x what our training consumes")


def _rounded(values):
    return ", ".join(f"{value:.1f}" for value in values)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--size", choices=sorted(SIZE_OVERRIDES), default="tiny",
                        help="tiny: the model's configs/tiny.yaml; small: 4 layers, hidden 256, "
                             "seq 128, batch 8, vocab 8192")
    parser.add_argument("--config", help="a YAML config instead of --size")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. train.precision=fp16")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating runs of each side; each side keeps its fastest")
    parser.add_argument("--data-batches", type=int, default=200,
                        help="batches read to time the data pipeline")
    parser.add_argument("--skip-data", action="store_true", help="do not time the data pipeline")
    parser.add_argument("--profile", metavar="DIR",
                        help="also profile our step with MindSpore's profiler (output in DIR) "
                             "and list the costliest operators")
    parser.add_argument("--trainer", action="store_true",
                        help="also run `model-zoo train` at this configuration on the real "
                             "dataset, with log_steps 1 and 100, and compare its step rate")
    parser.add_argument("--trainer-steps", type=int, default=201,
                        help="steps of each `model-zoo train` run (default 201)")
    parser.add_argument("--output", help="JSON file for the results "
                                         "(default benchmarks/results/MODEL-SIZE.json)")
    parser.add_argument("--worker", choices=("ours", "reference", "gemm", "data"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.data_batches < 1 or args.rounds < 1 or \
            args.trainer_steps < 2:
        parser.error("--steps, --rounds and --data-batches must be >= 1, --trainer-steps >= 2, "
                     "--warmup >= 0")
    if args.worker:
        return worker(args)
    config = load_benchmark_config(args)  # a bad config or override fails here, before any run
    # the sides take turns after a GEMM run, and each keeps its fastest round (the GEMM its
    # best figures): a slow spell of a shared machine then penalises no side alone
    rounds = {"gemm": [], "ours": [], "reference": []}
    for _ in range(args.rounds):
        for side in rounds:
            rounds[side].append(run_side(args, side))
    results = {"gemm": best_gemm(rounds.pop("gemm"))}
    for side, runs in rounds.items():
        results[side] = dict(min(runs, key=lambda run: run["median_step_s"]),
                             round_step_ms=[run["median_step_s"] * 1e3 for run in runs])
    if args.trainer:
        results["trainer"] = [run_trainer(args, log_steps)
                              for log_steps in TRAINER_LOG_STEPS]
    if not args.skip_data:
        results["data"] = run_side(args, "data")
    report = summarize(args, config, results)
    print_report(report)
    name = os.path.splitext(os.path.basename(args.config))[0] if args.config else args.size
    output = args.output or os.path.join(ROOT, "benchmarks", "results",
                                         f"{args.model}-{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)
    print(f"results: {output}")


if __name__ == "__main__":
    main()
