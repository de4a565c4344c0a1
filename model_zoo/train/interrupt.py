"""Stopping a run cleanly on SIGINT (Ctrl-C), SIGTERM (batch schedulers, cloud jobs) or
SIGHUP (a dropped ssh session).

The first signal asks the training loop to stop after the step it is running: the loop
saves a checkpoint, says where and how to resume, and the process exits 128 + the signal
number (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP). A second signal exits at once.
MindSpore installs native handlers of its own (its dataset iterator's, and after the first
step one that turns SIGINT into SIGTERM), which end the process without a word, so the loop
installs these when the iterator exists and again after the first step (`install`).
"""

import os
import signal
import stat
import sys

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
BAD_STEPS_STATUS = 3   # the exit status after TooManyBadSteps (the launcher's too)


class TrainingInterrupted(Exception):
    """Raised by the loop after the checkpoint of an interrupted run is saved. `signum` is
    None on a rank that stops because another rank was signalled."""

    def __init__(self, signum, step: int, checkpoint: str, agreed: bool = True):
        cause = signal.Signals(signum).name if signum else "another rank's signal"
        super().__init__(f"stopped by {cause} after step {step}; saved {checkpoint}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        # every rank stops here (the step's vote); False for a signal after the last step,
        # which only the signalled ranks see
        self.agreed = agreed

    @property
    def exit_status(self) -> int:
        return 128 + (self.signum or signal.SIGTERM)


class TooManyBadSteps(TrainingInterrupted):
    """Raised by the loop after `train.max_bad_steps` bad steps in a row were skipped, once
    the checkpoint of the last step is saved (its weights are those before the bad steps)."""

    def __init__(self, reason: str, step: int, checkpoint: str):
        Exception.__init__(self, f"{reason}; stopped after step {step}, saved {checkpoint}")
        self.signum, self.step, self.checkpoint, self.agreed = None, step, checkpoint, True

    @property
    def exit_status(self) -> int:
        return BAD_STEPS_STATUS


class Stopped(BaseException):
    """A stop signal outside the training loop (imports, a dataset build, an evaluation,
    the other commands): `model-zoo` ends with one line instead of a traceback or silence.
    A BaseException, as KeyboardInterrupt is, so that cleanups (write_atomically's) run."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def leave_a_hung_up_terminal(signum):
    """After SIGHUP the terminal may be gone, and every write to it fails (EIO): standard
    output and error on a terminal now go to /dev/null (as under nohup), so that the run
    can still save and stop. Files and pipes are left as they are."""
    if signum != signal.SIGHUP:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            try:
                if stat.S_ISCHR(os.fstat(fd).st_mode):   # a terminal (or /dev/null itself)
                    os.dup2(devnull, fd)
            except OSError:
                pass
    finally:
        os.close(devnull)


def _raise_stopped(signum, frame):
    leave_a_hung_up_terminal(signum)
    raise Stopped(signum)


_dropped_stop = None   # the signal of a Stopped that Python could not raise


def _keep_dropped_stop(unraisable):
    """sys.unraisablehook: a Stopped raised where Python cannot raise it (in a weakref
    callback, as the import machinery's module locks have, or a `__del__`) would be printed
    as "Exception ignored" and lost, the command going on; it is kept for
    `raise_dropped_stop` instead. (Sending the signal again from here would raise it here,
    where it is dropped again.)"""
    global _dropped_stop
    if isinstance(unraisable.exc_value, Stopped):
        _dropped_stop = unraisable.exc_value.signum
    else:
        sys.__unraisablehook__(unraisable)


def raise_dropped_stop():
    """Raise the Stopped that Python dropped, if any: the command's next safe point (the
    training loop before its first step, the end of any command) stops as the signal asked."""
    if _dropped_stop is not None:
        raise Stopped(_dropped_stop)


def stop_at_once():
    """Make SIGINT, SIGTERM and SIGHUP raise Stopped (MindSpore's own handlers end the process
    without a word); the training loop's StopRequests replaces them while it runs."""
    global _dropped_stop
    _dropped_stop = None
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stopped)
    sys.unraisablehook = _keep_dropped_stop


class StopRequests:
    """While active, SIGINT, SIGTERM and SIGHUP set `signum` instead of ending the process;
    the loop checks `requested` after each step, the evaluation after the steps `check`. A
    second signal exits at once."""

    def __init__(self):
        self.signum = None
        self._previous = {}
        self._done = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def steps_done(self, step: int, checkpoint: str):
        """Training ended at `step` with `checkpoint` saved: what follows (the evaluation)
        has nothing to save, so a signal now stops it at its next `check` (and one that
        came during the last step, too late for the step's vote, stops the run now)."""
        self._done = (step, checkpoint)
        self.check()

    def check(self):
        """After the steps, between the evaluation's parts: TrainingInterrupted if a signal
        came, else the handlers installed again (MindSpore's dataset iterators install
        their own). The handler itself raises nothing then: raised inside MindSpore's
        graph compile, an exception is reported as a failed compile, or lost."""
        if self.signum is not None:
            raise TrainingInterrupted(self.signum, *self._done, agreed=False)
        self.install()

    def _handle(self, signum, frame):
        leave_a_hung_up_terminal(signum)
        if self.signum is not None:
            os._exit(128 + signum)
        self.signum = signum
        doing = ("stopping after this step and saving a checkpoint" if self._done is None else
                 "the last checkpoint is saved; stopping the evaluation")
        print(f"received {signal.Signals(signum).name}: {doing} (send it again to stop at "
              f"once)", file=sys.stderr, flush=True)

    def install(self):
        """(Re)install the handlers over whatever native code installed since."""
        for signum in STOP_SIGNALS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def __enter__(self):
        raise_dropped_stop()   # before the first step: nothing to save yet
        self.install()
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False
