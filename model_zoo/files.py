"""Writing files safely: whole or not at all, and one writer at a time.

Outputs that a crash must not leave half-written (configs, manifests, tokenizers, rank
tables) are written to a temporary file beside their target and renamed into place.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile

from model_zoo.errors import UserInputError

LOCK_FILE = ".lock"


def check_file(path, what: str, error=UserInputError, empty_ok: bool = True):
    """`error` naming `what` (e.g. "checkpoint") and `path` unless `path` is an existing
    file (non-empty unless `empty_ok`)."""
    if os.path.isdir(path):
        raise error(f"{what} {path!r} is a directory, not a file")
    if not os.path.isfile(path):
        raise error(f"{what} {path!r} does not exist")
    if not empty_ok and os.path.getsize(path) == 0:
        raise error(f"{what} {path!r} is empty (0 bytes)")


def read_text_lines(path, what: str, error=UserInputError) -> list:
    """The lines of the UTF-8 text file `path` (without their line ends); `error` naming
    `what` (e.g. "--input") when it is missing or is not UTF-8 text."""
    check_file(path, what, error)
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().splitlines()
    except UnicodeDecodeError as err:
        raise error(f"{what} {path!r} is not UTF-8 text: byte {err.start} is "
                    f"{err.object[err.start:err.start + 1]!r}; convert it (e.g. iconv -t "
                    f"UTF-8)") from None


def sha256_of(path) -> str:
    """The SHA-256 of a file's bytes, read in 4 MB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def make_directory(directory) -> str:
    """os.makedirs(directory, exist_ok=True), or a UserInputError naming the file that
    stands where a directory of the path must be."""
    directory = os.path.abspath(os.fspath(directory))
    try:
        os.makedirs(directory, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocking = directory
        while os.path.dirname(blocking) != blocking and not os.path.isfile(blocking):
            blocking = os.path.dirname(blocking)
        raise UserInputError(f"cannot create the directory {directory}: {blocking} is a "
                             f"file, not a directory") from None
    return directory


def check_output_file(path, flag: str):
    """Before the work whose result goes to `path` (given as `flag`): its directory made, and
    a UserInputError if that cannot be or if `path` is a directory."""
    if os.path.isdir(path):
        raise UserInputError(f"{flag} {os.fspath(path)!r} is a directory; give a file path")
    make_directory(os.path.dirname(os.path.abspath(path)))


def write_atomically(path, content):
    """Write text or bytes to `path` via a temporary file in the same directory."""
    path = os.fspath(path)
    directory = make_directory(os.path.dirname(os.path.abspath(path)))
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


def read_json_or_none(path):
    """The JSON object in `path`, or None if there is none or it cannot be read (a note
    that is rewritten when missing, e.g. of a build's progress)."""
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


@contextlib.contextmanager
def exclusive_lock(path):
    """Hold an exclusive lock on `path` (created if needed): of several processes on one
    machine that want to build the same thing, one builds while the others wait. The lock
    file is removed on the way out."""
    with _locked_file(path, blocking=True):
        yield


@contextlib.contextmanager
def directory_in_use(directory: str):
    """Claim `directory` for this process: a second process that asks for it while this one
    runs gets a UserInputError naming this one's pid. The lock is the kernel's (flock), so
    a crash or a kill releases it; the lock file is removed on the way out (a kill leaves
    it, and the next run takes it over)."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UserInputError(f"--output-dir {directory!r} is a file, not a directory")
    path = os.path.join(directory, LOCK_FILE)
    with contextlib.ExitStack() as stack:
        try:
            os.makedirs(directory, exist_ok=True)
            handle = stack.enter_context(_locked_file(path, blocking=False))
        except BlockingIOError:
            raise UserInputError(f"{directory} is in use by another run (pid "
                                 f"{_read_holder(path)}); wait for it to end, or choose "
                                 f"another --output-dir") from None
        except OSError as err:   # read-only, no permission, a full disk
            raise UserInputError(f"--output-dir {directory!r}: cannot write there "
                                 f"({err.strerror}); choose a writable --output-dir") from None
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield


def _read_holder(path) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip() or "unknown"
    except OSError:
        return "unknown"


@contextlib.contextmanager
def _locked_file(path, blocking: bool):
    """An open handle of `path` holding its flock; BlockingIOError if not `blocking` and
    another process holds it. Removing the file on release is safe because a process that
    locked a file then removed checks, once it holds the lock, that `path` still names the
    file it locked, and starts over if not."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    while True:
        handle = open(path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BaseException:
            handle.close()
            raise
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and current.st_ino == os.fstat(handle.fileno()).st_ino:
            break
        handle.close()   # removed by its previous holder while this one waited
    try:
        handle.seek(0)
        yield handle
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
        handle.close()
