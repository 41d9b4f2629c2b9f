"""Cache keys: what a binary is (the entry key) and which compilers made it (the toolchain key).

The full key of a disk entry is the pair (entry_key, toolchain_key), kept as two path levels
rather than one hash, because the two kinds of machine that read the cache know different
things:

- a machine that only runs kernels (offline, no MLIR installed) cannot compute the toolchain
  fingerprint, since it has none of the compilers. It looks up by entry key alone and takes
  the entry the newest toolchain wrote.
- a machine that compiles knows its toolchain and looks up the exact pair, so it never reuses
  a binary that other compiler versions built.

The entry key covers everything that changes the binary apart from the compilers: the kernel
name and every builder parameter (floats by their exact bits, see KernelSpec), the target
(arch, features, warp size, pass pipeline), kbuild's own code-generating source, and the
on-disk format version. This module imports neither MLIR nor torch.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from kbuild.spec import KernelSpec
from kbuild.targets import Target

# Bump when the meaning of an entry changes (what a key covers, how meta.json reads), so old
# entries become misses instead of being misread.
CACHE_FORMAT_VERSION = 1

# What generates code, relative to the package: edits here must invalidate every entry.
# The runtime, the cache and the ops are left out, since they never change a binary. The set
# is closed under imports: whatever these modules import from kbuild is in it too (the trace
# layout the kernels write by, the Artifact the compiler returns), which
# tests/test_fingerprint_cpu.py checks.
_SOURCE_DIRS = ("kernels", "dsl", "targets")
_SOURCE_FILES = ("spec.py", "compiler.py", "dtypes.py", "trace_layout.py", "artifact.py")


def _digest(payload: Any) -> str:
    """sha256 hex of the canonical JSON of `payload` (sorted keys, no whitespace)."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def source_files(package: Path) -> list[tuple[str, Path]]:
    """The code-generating `*.py` files under `package`, as sorted (relative path, path)."""
    files = [path for name in _SOURCE_DIRS for path in (package / name).rglob("*.py")]
    files += [package / name for name in _SOURCE_FILES if (package / name).is_file()]
    return sorted((path.relative_to(package).as_posix(), path) for path in files)


def fingerprint_tree(package: Path) -> str:
    """Hash the code-generating `*.py` files under `package`, each with its relative path.

    Paths are hashed too, so renaming or moving a file counts as a change; each part is
    length-prefixed so no two different trees can produce the same byte stream.
    """
    digest = hashlib.sha256()
    for rel, path in source_files(package):
        data = path.read_bytes()
        digest.update(f"{len(rel)}:{rel}:{len(data)}:".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


@functools.cache
def source_fingerprint() -> str:
    """kbuild's own code-generating source, hashed once per process (16 hex chars)."""
    return fingerprint_tree(Path(__file__).parents[1])


def entry_key(spec: KernelSpec, target: Target) -> str:
    """Name WHAT is built: the spec compiled for the target by this kbuild source (32 hex)."""
    payload = {
        "format_version": CACHE_FORMAT_VERSION,
        "spec": spec.canonical_json(),
        "target": target.key_fields(),
        "source": source_fingerprint(),
    }
    return _digest(payload)[:32]


def toolchain_key(toolchain: dict[str, str]) -> str:
    """Name WHICH compilers built it, e.g. {"mlir": "22.1.8.4", "ptxas": "13.0.88"} (16 hex)."""
    if not isinstance(toolchain, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in toolchain.items()
    ):
        raise TypeError(f"toolchain must be a dict of str to str, got {toolchain!r}")
    return _digest(toolchain)[:16]
