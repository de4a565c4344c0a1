"""Errors the user can act on: bad input, and files that cannot be written.

The command line reports them as one line (no traceback) and exits with status 2. Input
errors are raised before any expensive work starts, so nothing already written is touched.
"""


class UserInputError(Exception):
    """Bad input from the user: reported as one line, before expensive work starts."""


class ConfigError(UserInputError):
    """A YAML file, a `--set` override or a config value is wrong."""


class DataError(UserInputError):
    """A data file or directory is missing, unreadable or unsuitable."""


class CheckpointError(UserInputError):
    """A checkpoint is missing, corrupt or does not match the model."""


class DiskError(UserInputError):
    """A file cannot be written (a full disk, no permission); what was written before it,
    older checkpoints included, is kept."""


def at_least(minimum, kind=int):
    """An argparse `type` for a number of `kind` (int or float) no smaller than `minimum`:
    anything else is argparse's one usage error (exit 2) naming the flag."""
    import argparse

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value >= minimum:   # also refuses nan
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value
    parse.__name__ = kind.__name__   # argparse names the type in its messages
    return parse
