"""The steps of a run, fed two ways, and what the loop does between them.

`TrainingLoop` is the bookkeeping at each read of the steps' results: progress line and
metrics.jsonl, held-out evaluation, checkpoints, and the stops, taken after the same step
on every rank. Two feeds run the steps and call it:
- `run_fed_steps`: the host passes each batch to the train step (CPU, and any run whose
  steps are not sunk); it reads after every `read_every` steps and at the loop's own steps;
- `SinkFeed`: MindSpore's `Model.train` in dataset sink mode (Ascend): the batches go
  to the device through MindSpore's data queue and each call runs a sink of `sink_size`
  steps, after which the loop reads, as PanGu-alpha (`train.py`: `Model.train(...,
  sink_size=callback_size, dataset_sink_mode=True)`) and MindFormers train.

A read waits for the device. Between reads the host queues steps, and the loop learns what
they did from the train step's StepTally, so a read per sink loses no step.
"""

import json
import math
import time
from collections import deque

from mindspore.train import Callback, Model

from model_zoo.checkpoint.files import save_checkpoint
from model_zoo.train.interrupt import TooManyBadSteps, TrainingInterrupted
from model_zoo.train.metrics import progress_line
from model_zoo.train.step import BAD_STEP_REASONS


def log(message: str):
    """Every rank logs: each has its own log file and output folder."""
    print(message, flush=True)


def sink_size_of(train, device_target: str, start_step: int) -> int:
    """Steps per call when the steps run in dataset sink mode (`SinkFeed`), 0 when the
    host feeds them (`run_fed_steps`). train.dataset_sink null (the default) sinks on Ascend
    and not on CPU, which has no device data queue (there `true` runs the same Model.train
    path fed from the host, MindSpore's fallback: what the CPU tests use).

    A sink must end at every step the loop acts after (logs, evaluations, saves, the last
    step), so its size is the greatest common divisor of their intervals and of the
    resumed step. A size of 1 is fed from the host instead: a sink of one step saves no
    host work, and MindFormers refuses it with sliced checkpoints to load
    (`transform_and_load_checkpoint`: sink_size 1 with epochs > 1)."""
    sink = train.dataset_sink if train.dataset_sink is not None else device_target != "CPU"
    if not sink:
        return 0
    size = math.gcd(train.log_steps, train.save_steps, train.eval_steps, start_step,
                    train.steps)
    return size if size > 1 or device_target == "CPU" else 0


def outputs_read_every(config, device_target: str) -> int:
    """How often the host feed reads the steps' results: every step on CPU, whose steps run
    as they are called; elsewhere once per log interval, so the host does not wait for the
    device after every step (PanGu-alpha and MindFormers read the loss once per sink)."""
    return 1 if device_target == "CPU" else config.train.log_steps


def bad_step_reason(train, code: float) -> str:
    """StepTally's reason code as words."""
    reason = BAD_STEP_REASONS[int(code)]
    if int(code) == 3:
        reason += f" (above {train.loss_spike_factor:g} x the running average)"
    return reason


def step_times(elapsed: float, in_step: float, steps: int) -> dict:
    """An interval's wall time per step (`step_ms`) and the part of it outside the train
    step's call (`outside_step_ms`: the next batch, reading the outputs, the progress line,
    metrics.jsonl): what the training loop adds to the step itself, which a machine's drift
    from run to run does not blur."""
    return {"step_ms": 1e3 * elapsed / steps,
            "outside_step_ms": 1e3 * max(elapsed - in_step, 0.0) / steps}


class TrainingLoop:
    """What happens between steps. When `stop` (StopRequests) is requested on any rank,
    every rank saves a checkpoint after the same step (the train step's StopVote) and
    raises TrainingInterrupted; after more than train.max_bad_steps bad steps in a row
    (skipped by the step itself, counted by its StepTally) TooManyBadSteps. Every
    train.eval_steps steps before the last, `evaluate()` gives the held-out metrics logged
    in `metrics` (the last step's are the trainer's). `path`: the last checkpoint saved."""

    def __init__(self, config, step_cell, metrics, output_dir, start_step, on_save,
                 stop=None, sliced_checkpoints=False, evaluate=None):
        self.train, self.step_cell, self.metrics = config.train, step_cell, metrics
        # each mixture-of-experts layer's record of its last routing (`nn.moe`)
        self.routing = [(param, params.get(name[:-len("load")] + "dropped"))
                        for params in [dict(step_cell.parameters_and_names())]
                        for name, param in params.items() if name.endswith(".expert_load")]
        self.output_dir, self.start_step, self.on_save = output_dir, start_step, on_save
        self.stop, self.sliced_checkpoints, self.evaluate = stop, sliced_checkpoints, evaluate
        self.path = None
        self.last_read = start_step
        self.last_bad = ""
        self.bad_seen = 0   # the StepTally's count of bad steps at the last read
        self.first = None   # (started, seconds, tokens, steps) of the first call
        self._start_interval(time.perf_counter())

    def _start_interval(self, now: float):
        self.interval_start, self.interval_steps, self.interval_tokens = now, 0, 0
        self.interval_in_step = 0.0
        self.skipped = 0

    def before_steps(self):
        """Before a call of the train step: pass a stop request on to the stop vote."""
        if self.stop is not None and self.stop.requested:
            self.step_cell.stop_vote.request()

    def first_call(self, steps: int, seconds: float, tokens: int):
        """The first call of the train step, which compiled it, timed alone (the caller
        waited for its result)."""
        log(f"compiled and ran the first {'step' if steps == 1 else f'{steps} steps'} "
            f"in {seconds:.1f} s")
        if self.stop is not None:
            self.stop.install()
        now = time.perf_counter()
        self.first = (now - seconds, seconds, tokens, steps)
        self._start_interval(now)

    def ran(self, steps: int, tokens: int, seconds: float):
        """A later call: `steps` steps over `tokens` tokens, `seconds` in the call."""
        self.interval_steps += steps
        self.interval_tokens += tokens
        self.interval_in_step += seconds

    def acts_after(self, step: int) -> bool:
        """Whether the loop logs, evaluates or saves after `step`."""
        return self._logging(step) or self._evaluating(step) or self._saving(step)

    def _saving(self, step: int) -> bool:
        return step % self.train.save_steps == 0 or step == self.train.steps

    def _logging(self, step: int) -> bool:
        return step % self.train.log_steps == 0 or step == self.train.steps

    def _evaluating(self, step: int) -> bool:
        return bool(self.evaluate is not None and self.train.eval_steps
                    and step % self.train.eval_steps == 0 and step < self.train.steps)

    def read(self, step: int, outputs):
        """After `step`, whose train step returned `outputs`: read the tally of the steps
        since the last read, then log, evaluate, save and stop as `step` asks."""
        train = self.train
        read_at = time.perf_counter()
        tally = self.step_cell.step_tally.read()
        loss, _, scale, grad_norm, lr, stop_voted, finite = outputs
        read, self.last_read = step - self.last_read, step
        bad, self.bad_seen = int(tally["bad"]) - self.bad_seen, int(tally["bad"])
        self.skipped += bad
        if bad:
            self.last_bad = bad_step_reason(train, tally["last_bad"])
            where = (f"step {step} skipped" if read == 1 else
                     f"steps {step - read + 1}-{step}: {bad} skipped, the last")
            log(f"{where}: {self.last_bad} ({int(tally['bad_in_row'])} in a row; the run "
                f"stops after {train.max_bad_steps})")
        # the longest run of bad steps so far: once past the limit the run stops at this read
        failing = tally["most_bad_in_row"] > train.max_bad_steps
        stopping = bool(stop_voted.asnumpy()[0] > 0)
        # waiting here for steps the host queued is the device's time, not the loop's
        self.interval_in_step += time.perf_counter() - read_at
        if self._logging(step):
            self._log(step, tally, loss, scale, grad_norm, lr, finite)
        if self._evaluating(step):
            evaluated_at = time.perf_counter()
            self.step_cell.set_train(False)
            result = self.evaluate()
            self.step_cell.set_train(True)
            self.metrics.write({"step": step, "heldout": result})
            log(f"held-out evaluation at step {step} "
                f"({time.perf_counter() - evaluated_at:.1f} s): {json.dumps(result)}")
            self.interval_start += time.perf_counter() - evaluated_at   # not training time
        if self._saving(step) or stopping or failing:
            self.path = save_checkpoint(self.step_cell, self.output_dir, step,
                                        train.keep_checkpoints, sliced=self.sliced_checkpoints,
                                        file_format=train.checkpoint_format)
            log(f"saved {self.path}")
            if self.on_save is not None:
                self.on_save(self.output_dir)
            if failing:
                raise TooManyBadSteps(f"more than {train.max_bad_steps} steps in a row were "
                                      f"skipped (the last: {self.last_bad}); lower train.lr "
                                      f"or check the data of these steps", step, self.path)
            if stopping:
                raise TrainingInterrupted(self.stop.signum if self.stop is not None else None,
                                          step, self.path)

    def _log(self, step, tally, loss, scale, grad_norm, lr, finite):
        if self.interval_steps == 0:   # only the first call so far: time it alone
            self.interval_start, self.interval_in_step, self.interval_tokens, \
                self.interval_steps = self.first
        now = time.perf_counter()
        elapsed = max(now - self.interval_start, 1e-9)
        entry = {"step": step,
                 "loss": (tally["loss_sum"] / tally["applied"] if tally["applied"]
                          else loss.asnumpy().item()),
                 "lr": lr.asnumpy().item(),
                 "loss_scale": scale.asnumpy().item(),
                 "grad_norm": grad_norm.asnumpy().item(),
                 "finite": bool(finite.asnumpy().item()),
                 **({"skipped_steps": self.skipped} if self.skipped else {}),
                 "samples_per_s": self.interval_steps * self.train.global_batch_size / elapsed,
                 "tokens_per_s": self.interval_tokens / elapsed,
                 **step_times(elapsed, self.interval_in_step, self.interval_steps)}
        entry.update(routing_metrics(self.routing))
        self.metrics.write(entry)
        log(progress_line(entry, self.train.steps))
        # the next interval starts where this one was timed: the reads and the line above
        # count in it, so a progress line every step shows what it costs
        self._start_interval(now)


def routing_metrics(routing) -> dict:
    """The experts' routing of the logged step (its last micro batch) on the layers this
    rank runs (its pipeline stage's), from their records (`nn.moe`): per layer the choices
    each expert received
    (`expert_load`) and their max over their mean (`expert_load_max_over_mean`: 1 is an
    even load, E one expert taking every token), and with a capacity the share of the
    choices dropped over all layers (`expert_drop_rate`)."""
    # a layer of another pipeline stage is built here but never runs: its record stays 0
    routing = [(load.asnumpy(), dropped) for load, dropped in routing]
    routing = [(load, dropped) for load, dropped in routing if load.sum() > 0]
    if not routing:
        return {}
    loads = [load for load, _ in routing]
    entry = {"expert_load": [[round(float(v)) for v in load] for load in loads],
             "expert_load_max_over_mean": [float(load.max() / max(load.mean(), 1e-9))
                                           for load in loads]}
    dropped = [float(record.asnumpy()[0]) for _, record in routing if record is not None]
    if dropped:
        choices = sum(float(load.sum()) for load in loads)
        entry["expert_drop_rate"] = sum(dropped) / max(choices, 1.0)
    return entry


def run_fed_steps(loop: TrainingLoop, runnable, batches, tokens_of, read_every: int = 1):
    """Run the steps left, the host passing each batch of `batches` to `runnable`; read after
    every `read_every` steps and after the steps the loop acts on. Returns the last
    checkpoint saved."""
    for step in range(loop.start_step + 1, loop.train.steps + 1):
        batch = next(batches)
        loop.before_steps()
        started = time.perf_counter()
        outputs = runnable(*batch)
        if step == loop.start_step + 1:
            outputs[0].asnumpy()   # the compile, timed alone
            loop.first_call(1, time.perf_counter() - started, tokens_of(batch))
        else:
            loop.ran(1, tokens_of(batch), time.perf_counter() - started)
        if step % read_every == 0 or loop.acts_after(step):
            loop.read(step, outputs)
    return loop.path


class SunkSteps(Callback):
    """Model.train's callback that hands each call's results to the loop: at the end of a
    sink of steps (on CPU, MindSpore's fallback: of every step fed from the host). An
    exception the loop raises (a stop) is kept and the training stopped the way MindSpore
    documents (`request_stop`), so Model.train ends its data feed itself."""

    def __init__(self, loop: TrainingLoop, tokens_of, sunk_tokens=None):
        super().__init__()
        self.loop, self.tokens_of, self.sunk_tokens = loop, tokens_of, sunk_tokens
        self.done, self.started, self.raised = loop.start_step, 0.0, None

    def on_train_step_begin(self, run_context):
        self.loop.before_steps()
        self.started = time.perf_counter()

    def on_train_step_end(self, run_context):
        params = run_context.original_args()
        step = self.loop.start_step + params.cur_step_num
        steps, self.done = step - self.done, step
        batch = getattr(params, "train_dataset_element", None)
        if batch is not None:     # fed from the host
            tokens = self.tokens_of(batch)
        else:                     # sunk: counted as the batches left for the device
            tokens = sum(self.sunk_tokens.popleft() for _ in range(steps))
        if step - steps == self.loop.start_step:
            params.net_outputs[0].asnumpy()
            self.loop.first_call(steps, time.perf_counter() - self.started, tokens)
        else:
            self.loop.ran(steps, tokens, time.perf_counter() - self.started)
        try:
            self.loop.read(step, params.net_outputs)
        except TrainingInterrupted as stop:
            self.raised = stop
            run_context.request_stop()
        if step == self.loop.train.steps:
            run_context.request_stop()


class SinkFeed:
    """The loop's steps left, run by Model.train in dataset sink mode, `sink_size` steps a
    call (`sink_size_of`). On Ascend the batches are counted on the host as they leave for
    the device (a sink hides them from the loop); on CPU MindSpore feeds them from the host,
    a step a call. `compile()` compiles the sunk step before training (Ascend only: Model.build,
    as MindFormers compiles before loading sliced checkpoints); `run()` trains."""

    def __init__(self, runnable, dataset, loop: TrainingLoop, sink_size: int,
                 device_target: str, tokens_of):
        steps = loop.train.steps - loop.start_step
        self.sunk = device_target != "CPU"
        # the train datasets repeat without end (a `take` would drain them forever once
        # done): Model.train runs `epochs` sinks, and the callback stops it after the last
        # step when MindSpore feeds from the host
        self.dataset = dataset
        sunk_tokens = None
        if self.sunk:
            sunk_tokens = deque()
            columns = self.dataset.get_col_names()

            def count(*batch):
                sunk_tokens.append(tokens_of(batch))
                return batch if len(batch) > 1 else batch[0]
            self.dataset = self.dataset.map(count, input_columns=columns,
                                            output_columns=columns)
        self.epochs = steps // sink_size if self.sunk else 1
        self.sink_size = sink_size
        self.callback = SunkSteps(loop, tokens_of, sunk_tokens)
        self.model = Model(runnable)

    def compile(self):
        self.model.build(train_dataset=self.dataset, epoch=self.epochs,
                         sink_size=self.sink_size)

    def run(self):
        """Train; returns the last checkpoint saved, or raises the loop's stop."""
        self.model.train(self.epochs, self.dataset, callbacks=[self.callback],
                         dataset_sink_mode=self.sunk, sink_size=self.sink_size)
        if self.callback.raised is not None:
            raise self.callback.raised
        return self.callback.loop.path
