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
