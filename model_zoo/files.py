"""Writing files safely: whole or not at all, and one writer at a time.

Outputs that a crash must not leave half-written (configs, manifests, tokenizers, rank
tables) are written to a temporary file beside their target and renamed into place.
"""

import contextlib
import fcntl
import json
import os
import tempfile


def write_atomically(path, content):
    """Write text or bytes to `path` via a temporary file in the same directory."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.",
                                         suffix=".tmp")
    try:
        mode, encoding = ("wb", None) if isinstance(content, bytes) else ("w", "utf-8")
        with os.fdopen(handle, mode, encoding=encoding) as out:
            out.write(content)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def write_json_atomically(path, value, indent: int = 2):
    write_atomically(path, json.dumps(value, indent=indent) + "\n")


@contextlib.contextmanager
def exclusive_lock(path):
    """Hold an exclusive lock on `path` (created if needed): of several processes on one
    machine that want to build the same thing, one builds while the others wait."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
