"""Errors caused by the user's input.

The command line reports them as one line (no traceback) and exits with status 2. They are
raised before any expensive work starts, so nothing already written is touched.
"""


class UserInputError(Exception):
    """Bad input from the user: reported as one line, before expensive work starts."""


class ConfigError(UserInputError):
    """A YAML file, a `--set` override or a config value is wrong."""


class DataError(UserInputError):
    """A data file or directory is missing, unreadable or unsuitable."""


class CheckpointError(UserInputError):
    """A checkpoint is missing, corrupt or does not match the model."""
