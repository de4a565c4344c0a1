"""Stand-in CUDA libraries that let the MindSpore wheel's GPU plugin load on a machine
without a GPU, so that its semi-auto-parallel compiler can run a dry run (`dryrun`).

MindSpore's parallel pass refuses the CPU target, and its Ascend plugin needs the CANN
libraries; the GPU plugin the pip wheel ships (`mindspore/lib/plugin/libmindspore_gpu.so.*`
and its `gpu*/` helpers) needs only the CUDA 11 libraries to be openable and a `nvcc` that
prints its release. At simulation level 0 nothing in those libraries is ever called, so a
library per soname that exports every symbol the plugin imports (same names, same symbol
versions, each returning an error code) is enough. They are generated from the installed
plugin's own dynamic symbol table (`readelf`), compiled with `gcc`, and cached like the CPU
kernels (`$MODEL_ZOO_KERNEL_CACHE/dryrun-cuda/<key>`, rebuilt when the wheel changes);
nothing binary is kept in the repository.
"""

import ctypes
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

from model_zoo.errors import UserInputError

# the CUDA 11 libraries the plugin links against (sonames); undefined symbols without a
# version belong to the driver library, libcuda.so.1
LIBRARIES = ("libcudart.so.11.0", "libcublas.so.11", "libcurand.so.10", "libcudnn.so.8",
             "libcusolver.so.11", "libcufft.so.10", "libcusparse.so.11", "libnvrtc.so.11.2",
             "libcuda.so.1")
DRIVER = "libcuda.so.1"
NVCC_RELEASE = "11.6"   # the release the plugin's loader asks `nvcc --version` for
CUDA_SYMBOL = re.compile(r"^(cu|nvrtc)\w*$")


class DryRunUnavailable(UserInputError):
    """This machine cannot run MindSpore's dry run (no GPU plugin, no gcc or readelf)."""


def plugin_dir() -> Path:
    spec = importlib.util.find_spec("mindspore")
    if spec is None or not spec.submodule_search_locations:
        raise DryRunUnavailable("mindspore is not installed (pip install mindspore==2.10.0)")
    return Path(spec.submodule_search_locations[0]) / "lib" / "plugin"


def plugin_files() -> list:
    """The GPU plugin's shared libraries in the installed wheel (main plugin first)."""
    folder = plugin_dir()
    main = sorted(folder.glob("libmindspore_gpu.so.*"))
    if not main:
        raise DryRunUnavailable(
            f"the installed MindSpore has no GPU plugin ({folder}/libmindspore_gpu.so.*), "
            f"which the dry run compiles with; install the pip wheel mindspore==2.10.0 for "
            f"x86_64 Linux, which ships it")
    helpers = sorted(folder.glob("gpu*/*.so*"))
    return main + helpers


def _tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        raise DryRunUnavailable(f"the dry run builds stand-in CUDA libraries with {name}, "
                                f"which is not on PATH (install gcc and binutils)")
    return path


def _cache_root() -> Path:
    from model_zoo.nn.cpu_kernels import cache_dir
    return cache_dir() / "dryrun-cuda"


def _key(files: list) -> str:
    digest = hashlib.sha1(Path(__file__).read_bytes())
    for path in files:
        stat = path.stat()
        digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def imported_symbols(files: list) -> dict:
    """{soname: {(symbol, kind)}} of the CUDA symbols the plugin files import."""
    readelf = _tool("readelf")
    wanted = defaultdict(set)
    for path in files:
        found = subprocess.run([readelf, "--dyn-syms", "-W", str(path)], capture_output=True,
                               text=True)
        if found.returncode:
            raise DryRunUnavailable(f"readelf cannot read {path}: {found.stderr.strip()[-200:]}")
        table = found.stdout
        for line in table.splitlines():
            fields = line.split()
            # Num: Value Size Type Bind Vis Ndx Name[@version (n)]
            if len(fields) < 8 or fields[6] != "UND":
                continue
            name, _, version = fields[7].partition("@")
            version = version.lstrip("@")
            if version in LIBRARIES:
                wanted[version].add((name, fields[3]))
            elif not version and CUDA_SYMBOL.match(name):
                wanted[DRIVER].add((name, fields[3]))
    versioned = {name for library, symbols in wanted.items() if library != DRIVER
                 for name, _ in symbols}
    wanted[DRIVER] = {item for item in wanted[DRIVER] if item[0] not in versioned}
    return wanted


def _source(symbols) -> str:
    """C source exporting `symbols`: data objects as zeroed buffers, functions returning a
    CUDA error code (999, unknown) or, for the *GetErrorString family, a message."""
    lines = ["/* stand-in for a CUDA library: nothing here runs at MindSpore's simulation "
             "level 0 */"]
    for name, kind in sorted(symbols):
        if kind == "OBJECT":
            lines.append(f"char {name}[256];")
        elif "ErrorString" in name or "ErrorName" in name:
            lines.append(f'const char *{name}(void) {{ return "no CUDA device (dry run)"; }}')
        else:
            lines.append(f"int {name}(void) {{ return 999; }}")
    return "\n".join(lines) + "\n"


def fake_cuda_home() -> Path:
    """The folder to use as CUDA_HOME (with `bin/nvcc` and `lib/` of stand-in libraries),
    built on first use."""
    files = plugin_files()
    target = _cache_root() / _key(files)
    if (target / "lib" / DRIVER).is_file():
        return target
    gcc = _tool("gcc")
    wanted = imported_symbols(files)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # built beside the target and renamed: dry runs starting together never see half
        # a folder
        staging = Path(tempfile.mkdtemp(dir=target.parent))
    except OSError as err:
        raise DryRunUnavailable(f"cannot build the stand-in CUDA libraries in "
                                f"{target.parent}: {err.strerror}; set MODEL_ZOO_KERNEL_CACHE "
                                f"to a writable folder")
    try:
        (staging / "bin").mkdir()
        (staging / "lib").mkdir()
        nvcc = staging / "bin" / "nvcc"
        nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {NVCC_RELEASE}, "
                        f"V{NVCC_RELEASE}.0 (model-zoo dry run stand-in)'\n")
        nvcc.chmod(0o755)
        for library in LIBRARIES:
            source = staging / f"{library}.c"
            source.write_text(_source(wanted.get(library, ())))
            command = [gcc, "-shared", "-fPIC", "-o", str(staging / "lib" / library),
                       str(source), f"-Wl,-soname,{library}"]
            if library != DRIVER:   # the plugin asks for these symbols at this version
                script = staging / f"{library}.map"
                script.write_text(f"{library} {{ global: *; }};\n")
                command.append(f"-Wl,--version-script={script}")
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode:
                raise DryRunUnavailable(f"gcc could not build the stand-in {library}: "
                                        f"{result.stderr.strip()[-300:]}")
        try:
            os.rename(staging, target)
        except OSError:   # another process built it first
            if not (target / "lib" / DRIVER).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load(cuda_home: Path):
    """Load the stand-in libraries into this process (before MindSpore loads its plugin),
    so that the plugin's dlopen finds them by soname."""
    for library in LIBRARIES:
        ctypes.CDLL(str(cuda_home / "lib" / library), mode=ctypes.RTLD_GLOBAL)
