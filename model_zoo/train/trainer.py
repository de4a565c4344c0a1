"""The training loop: checks, data, model, train step, progress, checkpoints, resume."""

import functools
import hashlib
import itertools
import json
import os
import socket
import time

import numpy as np
import mindspore as ms

from model_zoo.config import Config, import_model, read_yaml, save_config
from model_zoo.errors import CheckpointError, DataError, UserInputError
from model_zoo.data.manifest import building, dataset_digests, verify_dataset
from model_zoo.files import directory_in_use
from model_zoo.parallel.compiled_layouts import check_compiled_layouts
from model_zoo.parallel.context import (data_shard, eval_network_compiles, gathered_rows,
                                        gradient_reducer, init_parallel,
                                        micro_batch_network, micro_batching, parameter_init,
                                        sync_shared_parameters, wrap_eval_network,
                                        wrap_train_step)
from model_zoo.nn.attention import check_flash_attention_device
from model_zoo.nn.backend import kernels_for
from model_zoo.nn.layers import check_precision_device, dtype_of
from model_zoo.parallel.replication import layouts_by_name, norm_weights, stage_of_rank
from model_zoo.checkpoint.files import list_checkpoints, load_weights
from model_zoo.checkpoint.resume import resume_from_checkpoint, restore_sliced, sharded_resume
from model_zoo.train.interrupt import StopRequests
from model_zoo.train.loop import (SinkFeed, TrainingLoop, log, outputs_read_every,
                                  run_fed_steps, sink_size_of)
from model_zoo.train.metrics import MetricsLog, plot_loss_curve, read_metrics
from model_zoo.train.schedule import build_schedule
from model_zoo.train.step import (GradientNorm, StopVote, TrainStep, build_optimizer,
                                  loss_weight_of, uses_float_status)


HOST_BYTES = 64   # of each rank's host name, told to the others with its dataset's digests


def default_output_dir(config_path: str) -> str:
    name = os.path.splitext(os.path.basename(config_path))[0]
    return os.path.join("outputs", name)


# what a run writes in its output directory: name -> whether it is a directory
RUN_OUTPUTS = {"checkpoints": True, "strategy": True, "metrics.jsonl": False,
               "config.yaml": False, "run_info.json": False}


def check_output_dir(output_dir: str, config: Config, resume: bool, distributed: bool = False):
    """Refuse to start where it would overwrite a previous run, or resume an incompatible one.
    A resumed run keeps the learning-rate schedule length of the run it continues. A rank
    of a distributed run may have no checkpoint of its own (the run had fewer ranks): it
    resumes from the others' (`checkpoint.resume`), and checks
    against rank 0's config."""
    for name, directory in RUN_OUTPUTS.items():   # what the run writes must fit there
        path = os.path.join(output_dir, name)
        if os.path.exists(path) and os.path.isdir(path) != directory:
            raise UserInputError(
                f"--output-dir {output_dir}: {path} is a {'file' if directory else 'directory'}"
                f" where the run keeps its {name}; move it away or choose another --output-dir")
    checkpoints = list_checkpoints(output_dir)
    if checkpoints and not resume:
        raise UserInputError(
            f"{output_dir} already holds a run (newest checkpoint: step {checkpoints[-1][0]}); "
            f"pass --resume to continue it, or choose another --output-dir")
    if resume and not checkpoints and not distributed:
        raise UserInputError(f"--resume: no checkpoint in {output_dir}/checkpoints to resume from")
    saved_path = os.path.join(output_dir, "config.yaml")
    if distributed and not os.path.exists(saved_path):
        saved_path = os.path.join(os.path.dirname(output_dir), "rank_0", "config.yaml")
    if resume and os.path.exists(saved_path):
        saved = read_yaml(saved_path)
        saved_model = saved.get("model", {})
        for key, value in config.to_dict()["model"].items():
            if saved_model.get(key) != value:
                raise UserInputError(
                    f"--resume: model.{key} is {value!r} but the run in {output_dir} used "
                    f"{saved_model.get(key)!r}")
        keep_schedule_length(config, saved.get("train", {}))


def check_same_dataset(dataset_dir: str, device_num: int):
    """DataError on every rank unless all ranks hold the same dataset: their servers' copies
    of dataset.json and the tokenizer (`dataset_digests`) are exchanged in one all-gather
    with each rank's host name, so a server with another copy is named before step 1."""
    digests = dataset_digests(dataset_dir)
    names = list(digests)
    own = b"".join(bytes.fromhex(digests[name]) for name in names)
    host = socket.gethostname().encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
    rows = gathered_rows(np.frombuffer(own + host, np.uint8), device_num).astype(np.uint8)
    hosts = [bytes(row[len(own):]).rstrip(b"\0").decode(errors="replace") for row in rows]
    for rank, row in enumerate(rows[1:], start=1):
        for index, name in enumerate(names):
            theirs, first = (bytes(r[32 * index:32 * (index + 1)]).hex() for r in (row, rows[0]))
            if theirs != first:
                raise DataError(
                    f"the dataset of data.dataset_dir ({dataset_dir}) differs between the "
                    f"ranks: rank {rank} (server {hosts[rank]}) has another {name} than rank "
                    f"0 (server {hosts[0]}), SHA-256 {theirs[:12]}... against {first[:12]}...; "
                    f"every server needs the same dataset: build it once and copy the folder "
                    f"to each")


def keep_schedule_length(config: Config, saved_train: dict):
    """Unless train.lr_schedule_steps is given, span the schedule over as many steps as the
    run being resumed did, so a longer train.steps does not move the learning rate."""
    saved_length = saved_train.get("lr_schedule_steps") or saved_train.get("steps")
    train = config.train
    if train.lr_schedule_steps or not saved_length or saved_length == train.steps:
        return
    train.lr_schedule_steps = saved_length
    if train.lr_schedule == "cosine":
        log(f"the learning-rate schedule keeps its length of {saved_length} steps (train.steps "
            f"is now {train.steps}); set train.lr_schedule_steps to change it")


def train(config: Config, output_dir: str, resume: bool = False, on_save=None,
          verify_data: bool = False) -> dict:
    """Train `config`'s model; returns the final evaluation. Outputs go to `output_dir`
    (`rank_<i>/` inside it when several ranks run); `on_save(output_dir)` is called after
    each checkpoint and at the end (cloud jobs copy the outputs out there). `verify_data`
    checks the dataset's files against their recorded SHA-256 before training."""
    module = import_model(config.model.name)
    context = init_parallel(config.parallel, config.train.device_target)
    if getattr(config.model, "flash_attention", False):
        check_flash_attention_device(context.device_target, context.ascend_910b())
    check_precision_device(config.train.precision, context.device_target,
                           context.ascend_910b())
    if context.distributed:
        output_dir = os.path.join(output_dir, f"rank_{context.rank}")
    with directory_in_use(output_dir):
        return _train(module, config, context, output_dir, resume, on_save, verify_data)


def _train(module, config: Config, context, output_dir: str, resume: bool, on_save,
           verify_data: bool) -> dict:
    """`train` once this process holds `output_dir`."""
    check_output_dir(output_dir, config, resume, context.distributed)
    shard = data_shard(config.parallel, context.rank, config.train.global_batch_size)
    try:
        with building(config.data.dataset_dir):
            module.prepare_data(config)
    except OSError as err:
        # a built dataset on a read-only mount trains as it is (its lock cannot be taken)
        if not module.dataset_ready(config):
            raise DataError(f"data.dataset_dir {config.data.dataset_dir!r}: cannot build the "
                            f"dataset there ({err.strerror or err}); free space or give a "
                            f"writable directory") from None
    verify_dataset(config.data.dataset_dir, getattr(config.data, "sources", None), verify_data)
    if context.distributed:
        check_same_dataset(config.data.dataset_dir, context.device_num)

    os.makedirs(output_dir, exist_ok=True)
    ms.set_seed(config.train.seed)
    network, step_cell = build_model(module, config, context)
    start_step = 0
    resume_path = resharded_from = None
    if context.semi_auto and resume:   # loaded once the step is compiled (restore_sliced)
        resume_path, resharded_from, start_step = sharded_resume(output_dir, config,
                                                                 context.device_num)
    elif resume:
        start_step = resume_from_checkpoint(step_cell, output_dir, context)
    elif config.train.init_checkpoint:
        if os.path.isdir(config.train.init_checkpoint):
            raise CheckpointError(f"train.init_checkpoint {config.train.init_checkpoint!r} is "
                                  f"a sliced checkpoint, which a sharded run loads; merge it "
                                  f"for this one: model-zoo checkpoint merge "
                                  f"{config.train.init_checkpoint} --output FULL.ckpt")
        missing = load_weights(network, config.train.init_checkpoint, strict=False)
        log(f"initialised from {config.train.init_checkpoint}"
            + (f"; new parameters: {', '.join(missing)}" if missing else ""))
    dataset = module.create_train_dataset(config, shard, skip_batches=start_step)
    strategy_file = os.path.join(output_dir, "strategy", "param_strategy.ckpt")
    runnable = wrap_train_step(step_cell, config.parallel, context, strategy_file)
    save_config(config, os.path.join(output_dir, "config.yaml"))
    batches = dataset.create_tuple_iterator(num_epochs=1)
    first_batch = next(batches)
    write_run_info(output_dir, config, context, shard, first_batch)

    metrics = MetricsLog(os.path.join(output_dir, "metrics.jsonl"), resume_step=start_step)
    if context.semi_auto:
        sharded = evaluate = sharded_evaluation(module, config, network, context, shard)
    else:
        sharded, evaluate = None, lambda: module.evaluate(config, network)
    tokens_of = tokens_counter(module, config, shard)
    with StopRequests() as stop:
        loop = TrainingLoop(config, step_cell, metrics, output_dir, start_step, on_save, stop,
                            sliced_checkpoints=context.semi_auto, evaluate=evaluate)
        step_cell.set_train(True)
        sink_size = sink_size_of(config.train, context.device_target, start_step)
        if sink_size:
            batches.stop()   # the host read the first batch only (run_info.json)
            feed = SinkFeed(runnable, module.create_train_dataset(config, shard, start_step),
                            loop, sink_size, context.device_target, tokens_of)
            log(f"dataset sink mode: {sink_size} steps a call"
                + ("" if feed.sunk else " (on CPU MindSpore feeds them from the host)"))
            compile_step = feed.compile
        else:
            compile_step = lambda: runnable.compile(*first_batch)   # noqa: E731
        if context.semi_auto:
            checked = functools.partial(compile_checked, compile_step, runnable, step_cell,
                                        config, context.rank)
            if resume or config.train.init_checkpoint:
                restore_sliced(checked, step_cell, network, config, context.rank, output_dir,
                               strategy_file, resume_path, resharded_from)
            else:
                checked()
        if sink_size:
            final_checkpoint = feed.run()
        else:
            final_checkpoint = run_fed_steps(loop, runnable,
                                             itertools.chain([first_batch], batches),
                                             tokens_of, outputs_read_every(
                                                 config, context.device_target))
        stop.steps_done(config.train.steps,
                        final_checkpoint or list_checkpoints(output_dir)[-1][1])
        return evaluate_run(module, config, network, output_dir, on_save, metrics,
                            semi_auto=context.semi_auto, sharded=sharded, check=stop.check)


def sharded_evaluation(module, config: Config, network, context, shard):
    """A semi-auto run's held-out evaluation: the mean loss of the model's held-out batches
    (`create_heldout_dataset`, this rank's shard) through the network compiled in the
    parallel context (`wrap_eval_network`: this rank's slices, the last stage's loss on
    every rank). The model's own `evaluate` would run the whole network on slices. A
    callable returning the metrics; None when the model folder has no held-out batches."""
    heldout_dataset = getattr(module, "create_heldout_dataset", None)
    if heldout_dataset is None or not eval_network_compiles(config.parallel):
        return None
    held_out = wrap_eval_network(network, config.parallel, context,
                                 config.train.grad_accumulation)

    def evaluate() -> dict:
        losses = []
        for batch in heldout_dataset(config, shard).create_tuple_iterator():
            if not losses:
                sync_shared_parameters(held_out, config.parallel, batch)
            losses.append(float(held_out(*batch).asnumpy()))
        return {"split": "heldout", "batches": len(losses),
                "samples": len(losses) * config.train.global_batch_size,
                "loss": round(float(np.mean(losses)), 4) if losses else None}
    return evaluate


def evaluate_run(module, config: Config, network, output_dir: str, on_save,
                 metrics=None, semi_auto=False, sharded=None, check=lambda: None) -> dict:
    """After the last step: held-out metrics (also in metrics.jsonl with train.eval_steps),
    loss curve, a sample of the model's output. A semi-auto run evaluates with `sharded`
    (`sharded_evaluation`; the whole model exists on no rank, so no sample), or not at all
    when the model folder gives no held-out batches. `check()` between the parts stops
    them on a signal (`StopRequests.check`)."""
    metrics_path = os.path.join(output_dir, "metrics.jsonl")
    network.set_train(False)
    if sharded is not None:
        result = sharded()
    elif semi_auto:
        result = {"split": "heldout", "loss": None}
        log("no held-out evaluation on this sharded run (a model folder without "
            "create_heldout_dataset, or interleaved pipeline stages, whose evaluation "
            "network MindSpore 2.10 does not compile): collect and merge the "
            "checkpoint, then model-zoo eval")
    else:
        result = module.evaluate(config, network)
    check()
    if config.train.eval_steps and metrics is not None and not any(
            "heldout" in entry and entry["step"] == config.train.steps
            for entry in read_metrics(metrics_path)):   # a resumed finished run has it
        metrics.write({"step": config.train.steps, "heldout": result})
    png = plot_loss_curve(metrics_path, os.path.join(output_dir, "loss_curve.png"),
                          f"{config.model.name}: training loss")
    log(f"loss curve: {png}")
    log("held-out evaluation: " + json.dumps(result))
    sample = getattr(module, "sample_text", None)
    if sample is not None and not semi_auto:
        text = sample(config, network)
        check()
        log("sample: " + text)
    if on_save is not None:
        on_save(output_dir)
    return result


def build_model(module, config: Config, context):
    """The model folder's training network and the train step around it, built for `context`
    (on semi-auto parallel runs without allocating the weights: `parameter_init`)."""
    with parameter_init(context), kernels_for(context.device_target):
        network = module.build_train_network(config, dtype_of(config.train.precision))
        step_cell = build_train_step(config, network, context)
    return network, step_cell


def build_train_step(config: Config, network, context) -> TrainStep:
    train, parallel = config.train, config.parallel
    schedule = build_schedule(train)
    batching = micro_batching(parallel, context, train.grad_accumulation)
    optimizer = build_optimizer(network, train, schedule)
    return TrainStep(
        micro_batch_network(network, batching), optimizer, schedule,
        grad_reducer=gradient_reducer(optimizer.parameters, context),
        dynamic_loss_scale=train.precision == "fp16", loss_scale=train.loss_scale,
        scale_window=train.loss_scale_window, grad_clip=train.grad_clip,
        accumulation=batching.in_step, micro_batches=batching.micro_batches,
        accumulated_by_compiler=bool(batching.wrapper),  # wrappers exist on semi-auto only
        optimizer_shard=parallel.optimizer_shard,
        gradient_norm=gradient_norm(config, network, optimizer, context),
        stop_vote=StopVote(distributed=context.distributed, loss_weight=loss_weight_of(
            context.rank, context.device_num, parallel if context.semi_auto else None)),
        loss_spike_factor=train.loss_spike_factor, log_steps=train.log_steps)


def compile_checked(compile_step, runnable, step_cell, config: Config, rank: int):
    """Semi-auto runs: compile the step before step 1 (`compile_step()`), then hold the
    layouts MindSpore compiled against those the gradient-norm weights were computed from
    (`compiled_layouts.check_compiled_layouts`): a difference stops the run here."""
    started = time.perf_counter()
    compile_step()
    check_compiled_layouts(runnable.parameter_layout_dict,
                           step_cell.gradient_norm.planned_layouts, config.parallel, rank)
    log(f"compiled the train step in {time.perf_counter() - started:.1f} s; its parameters' "
        f"layouts are those the gradient norm is weighted by")


def gradient_norm(config: Config, network, optimizer, context) -> GradientNorm:
    """The step's GradientNorm: on semi-auto parallel runs, weighted by where each
    parameter's slices live (from a recorded forward pass, as `model-zoo plan` sees the
    layout) and summed over all devices; elsewhere over the whole local gradients."""
    float_status = uses_float_status(context)
    if not context.semi_auto:
        return GradientNorm(float_status=float_status)
    from model_zoo.layout.network import parameter_layouts
    started = time.perf_counter()
    layouts = parameter_layouts(config, network)
    names = [param.name for param in optimizer.parameters]
    weighted = layouts_by_name(layouts, names)
    weights = norm_weights(weighted, config.parallel, stage_of_rank(context.rank,
                                                                    config.parallel))
    log(f"gradient norm: {sum(w > 0 for w in weights)} of {len(weights)} parameters on this "
        f"stage, layouts recorded in {time.perf_counter() - started:.1f} s")
    norm = GradientNorm(weights, all_reduce=True, float_status=float_status)
    # what the weights were computed from, held against the compiled step's layouts
    norm.planned_layouts = dict(zip(names, weighted))
    return norm


def tokens_counter(module, config, shard):
    """Tokens of a global step: the model folder's `batch_tokens(batch)` (real tokens of this
    rank's batch) times the ranks reading distinct data, else batch x seq_length."""
    count = getattr(module, "batch_tokens", None)
    if count is None:
        tokens = config.train.global_batch_size * config.model.seq_length
        return lambda batch: tokens
    return lambda batch: count(batch) * shard.num_shards


def write_run_info(output_dir, config, context, shard, first_batch):
    """Record what this rank is and which data it reads.

    The first batch's fingerprint tells at a glance whether ranks that should read
    different slices really do.
    """
    digest = hashlib.sha1()
    for column in first_batch:
        digest.update(column.asnumpy().tobytes())
    info = {"rank": context.rank, "device_num": context.device_num,
            "device_target": context.device_target, "num_shards": shard.num_shards,
            "shard_id": shard.shard_id, "batch_size_per_rank": shard.batch_size,
            "global_batch_size": config.train.global_batch_size,
            "first_batch_sha1": digest.hexdigest()}
    with open(os.path.join(output_dir, "run_info.json"), "w", encoding="utf-8") as handle:
        json.dump(info, handle, indent=2)
