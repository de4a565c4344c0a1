"""Run outputs for people and machines: the progress line, metrics.jsonl and the loss curve."""

import json
import os

from model_zoo.errors import DataError, DiskError
from model_zoo.files import write_atomically


class MetricsLog:
    """Appends one JSON object per logged step to `metrics.jsonl`.

    `loss` is the mean over the steps since the previous entry; throughput is measured over
    the same steps. With `train.eval_steps`, held-out evaluations are entries of their own:
    {"step": N, "heldout": {the model folder's metrics}}.

    On resume, entries after the resumed step are dropped first, so the file reads as one
    uninterrupted run.
    """

    def __init__(self, path: str, resume_step: int = 0):
        self.path = path
        kept = [entry for entry in read_metrics(path) if entry.get("step", 0) <= resume_step]
        write_atomically(path, "".join(json.dumps(entry) + "\n" for entry in kept))

    def write(self, entry: dict):
        try:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(entry) + "\n")
        except OSError as err:
            raise DiskError(f"cannot append step {entry.get('step')} to {self.path}: "
                            f"{err.strerror or err}") from None


def read_metrics(path: str) -> list:
    """The entries of a metrics.jsonl. A last line that is not JSON is an append cut short
    (a full disk, a kill mid-write): it is left out, and `MetricsLog`'s rewrite on resume
    drops it. Any other line that is not JSON is a DataError naming the file and line."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as handle:
        lines = handle.read().splitlines()
    entries = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise DataError(f"{path} line {number} is not a JSON entry ({line[:40]!r}); "
                            f"remove that line to continue") from None
    return entries


def progress_line(entry: dict, total_steps: int) -> str:
    return (f"step {entry['step']}/{total_steps} | loss {entry['loss']:.4f} | "
            f"lr {entry['lr']:.2e} | loss scale {entry['loss_scale']:g} | "
            f"grad norm {entry['grad_norm']:.3f} | {entry['tokens_per_s']:.0f} tokens/s | "
            f"{entry['samples_per_s']:.1f} samples/s | {entry['step_ms']:.1f} ms/step, "
            f"{entry['outside_step_ms']:.1f} outside the step"
            + ("" if entry.get("finite", True) else " | overflow: step skipped")
            + ("" if "expert_load_max_over_mean" not in entry else
               f" | experts max/mean {max(entry['expert_load_max_over_mean']):.2f}")
            + ("" if "expert_drop_rate" not in entry else
               f", {100 * entry['expert_drop_rate']:.1f}% dropped"))


HELDOUT_CURVES = ("loss", "bleu", "mlm_accuracy", "accuracy")   # the first one found is drawn


def plot_loss_curve(metrics_path: str, png_path: str, title: str):
    """Save the loss curve of a run as a PNG (matplotlib without a display), with the
    held-out evaluations as points: their loss on the same axis, else their first metric of
    HELDOUT_CURVES on a second one."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    entries = read_metrics(metrics_path)
    training = [e for e in entries if "loss" in e]
    heldout = [e for e in entries if "heldout" in e]
    if not training:
        return None
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot([e["step"] for e in training], [e["loss"] for e in training],
              label="training loss")
    metric = next((key for key in HELDOUT_CURVES if heldout and key in heldout[0]["heldout"]),
                  None)
    if metric is not None:
        target = axes if metric == "loss" else axes.twinx()
        target.plot([e["step"] for e in heldout], [e["heldout"][metric] for e in heldout],
                    "o-", color="tab:orange", label=f"held-out {metric}")
        if target is not axes:
            target.set_ylabel(f"held-out {metric}")
        figure.legend(loc="upper right")
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
    return png_path
