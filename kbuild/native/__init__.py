"""The C++ hot path (kbuild_native.cpp): built once per torch, loaded when the ops are.

`load()` returns the extension module, or None where it cannot be had (no C++ compiler,
KBUILD_NATIVE=0); then kbuild runs its Python launch path, which computes the same results,
and says so once. The library is compiled with the C++ compiler on PATH (`$CXX`, else g++)
against the torch being imported (its headers and C++ ABI), into

    $KBUILD_NATIVE_DIR, else $XDG_CACHE_HOME/kbuild/native (~/.cache/kbuild/native),
    / <tag>/kbuild_native_<tag>.so

where the tag hashes the source, the flags, the torch version and the Python version: a torch
upgrade builds a new one beside the old. Builds are serialised across processes by a file lock
and published by rename, so DDP ranks starting together build it once. A failed build leaves
nothing behind; its compiler output is in the warning.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path

from filelock import FileLock

SOURCE = Path(__file__).with_name("kbuild_native.cpp")
# The translation unit and the parts it includes: all of them make the library's tag.
SOURCES = (SOURCE, *sorted(SOURCE.parent.glob("*.h")))
DISABLE_ENV = "KBUILD_NATIVE"  # "0": never build or load it
DIR_ENV = "KBUILD_NATIVE_DIR"


class NativeUnavailable(RuntimeError):
    """The extension could not be built or loaded (the reason is the message)."""


def _flags(torch) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        "-O2",
        "-std=c++20",
        "-fPIC",
        "-shared",
        "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f"-I{p}" for p in includes),
    ]


def _tag(torch, compiler: str, flags: list[str]) -> str:
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    digest.update("\0".join([compiler, *flags, torch.__version__, sys.version]).encode())
    return digest.hexdigest()[:16]


def _root() -> Path:
    """Not under KBUILD_CACHE_DIR: a kernel cache is shipped between machines, this library
    belongs to one machine's torch."""
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(home) / "kbuild" / "native"


def library_path() -> Path:
    """Where this torch's build lives (built or not)."""
    import torch

    compiler = os.environ.get("CXX", "g++")
    flags = _flags(torch)
    tag = _tag(torch, compiler, flags)
    return _root() / tag / f"kbuild_native_{tag}.so"


def build() -> Path:
    """The library for the torch being imported, compiled first if absent."""
    import torch

    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise NativeUnavailable(f"no C++ compiler: {compiler!r} is not on PATH (set $CXX)")
    path = library_path()
    if path.exists():
        return path
    failed = path.parent / "FAILED"
    if failed.exists():  # tried before with this compiler, source and torch: do not retry
        raise NativeUnavailable(f"{failed.read_text()}\n(delete {failed} to try again)")
    path.parent.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import TORCH_LIB_PATH

    with FileLock(str(path.parent / "build.lock")):
        if path.exists():  # another process built it while we waited
            return path
        print(
            f"kbuild: building the native extension for torch {torch.__version__} (once)",
            file=sys.stderr,
        )
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            command = [
                compiler,
                *_flags(torch),
                f"-DKBUILD_EXTENSION_NAME={path.stem}",
                str(SOURCE),
                "-o",
                str(out),
                f"-L{TORCH_LIB_PATH}",
                f"-Wl,-rpath,{TORCH_LIB_PATH}",
                "-lc10",
                "-ltorch_cpu",
                "-ltorch",
                "-ltorch_python",
                "-ldl",
            ]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                tail = "\n".join((result.stderr or result.stdout).splitlines()[-30:])
                message = f"compiling {SOURCE.name} failed:\n{tail}"
                failed.write_text(message)
                raise NativeUnavailable(message)
            os.replace(out, path)  # published whole, never half-written
    return path


def _import(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(path.stem, str(path))
    spec = importlib.util.spec_from_file_location(path.stem, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@functools.cache
def load():
    """The extension module, or None (after one warning saying why) where it cannot be had.
    The kbuild::* operator schemas must be defined first (kbuild/ops/custom_ops.py)."""
    if os.environ.get(DISABLE_ENV, "") == "0":
        return None
    import torch

    if torch.version.hip is not None:  # its launches are CUDA driver calls
        warnings.warn(
            "kbuild: the C++ hot path is CUDA-only so far; on ROCm kbuild uses its Python "
            "launch path (runtime/hip.py)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    try:
        return _import(build())
    except (NativeUnavailable, OSError, ImportError) as exc:
        warnings.warn(
            f"kbuild: the C++ hot path is unavailable, using the Python launch path "
            f"(same results, more host time per call): {exc}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
