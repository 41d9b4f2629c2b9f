"""The C++ hot path (kbuild_native.cpp): built once per torch, loaded at the first CUDA call.

`load()` returns the extension module, or None where it cannot be had (no C++ compiler,
KBUILD_NATIVE=0); then kbuild runs its Python launch path, which computes the same results,
and says so once. Only CUDA calls use it, so it is built and imported lazily: by the first
kbuild call that reaches a CUDA tensor (a public function, or a kbuild::* operator's CUDA
kernel through the dispatcher), and never in a process that only runs on the CPU (the first
call there would spend a minute compiling a library it never uses). `load(force=True)`
builds and loads it anyway (CPU tests drive its kernels through a launch hook); so does
KBUILD_NATIVE=1, at import. Loading it registers its CUDA and Autograd kernels with torch
(TORCH_LIBRARY_IMPL); what kbuild registered in their place until then is taken away first
and the module wired in after, by the hooks `on_load` collects (kbuild/ops). The library is
compiled with the C++ compiler on PATH (`$CXX`, else g++) against the torch being imported
(its headers and C++ ABI), into

    $KBUILD_NATIVE_DIR, else $XDG_CACHE_HOME/kbuild/native (~/.cache/kbuild/native),
    / <tag>/kbuild_native_<tag>.so

where the tag hashes the source, the flags, the torch version and the Python version: a torch
upgrade builds a new one beside the old. Builds are serialised across processes by a file lock
and published by rename, so DDP ranks starting together build it once. A failed build leaves
nothing behind; its compiler output is in the warning.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock

SOURCE = Path(__file__).with_name("kbuild_native.cpp")
# The translation unit and the parts it includes: all of them make the library's tag.
SOURCES = (SOURCE, *sorted(SOURCE.parent.glob("*.h")))
DISABLE_ENV = "KBUILD_NATIVE"  # "0": never build or load it; "1": load it even without CUDA
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


# (before, after) pairs, called around the library's import (see on_load).
_HOOKS: list[tuple[Callable[[], None], Callable[[Any], None]]] = []
_LOCK = threading.RLock()
_LOADED: list = []  # [the module or None] once a load was tried
_LOADING: list = []  # non-empty while this process loads it (a hook must not load again)


def on_load(before: Callable[[], None], after: Callable[[Any], None]) -> None:
    """Call `before()` just before the library is imported (the Python kernels its
    registrations replace are taken away, so torch never sees two kernels for one key) and
    `after(module)` once it is, or with None where the import failed (put them back). Hooks
    added after a load run at once: `after` with the loaded module (or None)."""
    with _LOCK:
        if _LOADED:
            after(_LOADED[0])
            return
        _HOOKS.append((before, after))


def loaded() -> Any:
    """The module if it is loaded, else None; never builds (cheap)."""
    return _LOADED[0] if _LOADED else None


def load(force: bool = False) -> Any:
    """The extension module, built and imported on the first call that wants it, or None
    (after one warning saying why, where it was wanted but cannot be had). Wanted where CUDA
    is available (kbuild calls this at its first CUDA call), or with `force` or
    KBUILD_NATIVE=1 (a CPU machine: tests of its kernels through the launch hook); never
    with KBUILD_NATIVE=0. Not wanted, it returns None and builds nothing, and a later call may
    still load it. The kbuild::* operator schemas must be defined first (importing kbuild
    defines them: kbuild/kernels/norms/custom_ops.py)."""
    if _LOADED:
        return _LOADED[0]
    setting = os.environ.get(DISABLE_ENV, "")
    import torch

    if not (force or setting in ("0", "1") or torch.cuda.is_available()):
        return None
    with _LOCK:
        if _LOADED:
            return _LOADED[0]
        if _LOADING:
            raise RuntimeError("kbuild.native.load called again while it loads (from a hook)")
        _LOADING.append(True)
        try:
            _LOADED.append(None if setting == "0" else _load(torch))
            if setting == "0":  # settled: the Python launch path, no warning
                for _, after in _HOOKS:
                    after(None)
        finally:
            _LOADING.clear()
        return _LOADED[0]


def _unavailable(reason: str) -> None:
    warnings.warn(
        f"kbuild: the C++ hot path is unavailable, using the Python launch path "
        f"(same results, more host time per call): {reason}",
        RuntimeWarning,
        stacklevel=4,
    )


def _load(torch) -> Any:
    """Build, then import between the hooks; None (one warning) where it cannot be had."""
    if torch.version.hip is not None:  # its launches are CUDA driver calls
        warnings.warn(
            "kbuild: the C++ hot path is CUDA-only so far; on ROCm kbuild uses its Python "
            "launch path (runtime/hip.py)",
            RuntimeWarning,
            stacklevel=4,
        )
        module = None
    else:
        try:
            path = build()
        except (NativeUnavailable, OSError) as exc:
            _unavailable(str(exc))
            module = None
        else:
            for before, _ in _HOOKS:
                before()
            try:
                module = _import(path)
            except (OSError, ImportError) as exc:
                _unavailable(str(exc))
                module = None
    for _, after in _HOOKS:
        after(module)
    return module
