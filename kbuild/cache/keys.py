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
(arch, features, warp size, pass pipeline), the source that generates this kernel (the DSL,
the targets and the compiler, plus the kernel's own builder and what it imports: adding or
editing one kernel re-keys only it; kbuild/cache/sources.py), and the on-disk format
version. This module imports neither MLIR nor torch.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kbuild.cache.sources import builder_fingerprint
from kbuild.spec import KernelSpec
from kbuild.targets import Target

# Bump when the meaning of an entry changes (what a key covers, how meta.json reads), so old
# entries become misses instead of being misread.
CACHE_FORMAT_VERSION = 1


def _digest(payload: Any) -> str:
    """sha256 hex of the canonical JSON of `payload` (sorted keys, no whitespace)."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def source_fingerprint(kernel: str) -> str:
    """The source that generates `kernel` (a registered kernel's name), 16 hex: the shared
    code generator plus its builder's own files (kbuild/cache/sources.py)."""
    from kbuild.registry import kernel_def

    definition = kernel_def(kernel)
    return definition.source or builder_fingerprint(definition.builder)


def entry_key(spec: KernelSpec, target: Target) -> str:
    """Name WHAT is built: the spec compiled for the target by this kbuild source (32 hex)."""
    payload = {
        "format_version": CACHE_FORMAT_VERSION,
        "spec": spec.canonical_json(),
        "target": target.key_fields(),
        "source": source_fingerprint(spec.kernel),
    }
    return _digest(payload)[:32]


def toolchain_key(toolchain: dict[str, str]) -> str:
    """Name WHICH compilers built it, e.g. {"mlir": "22.1.8.4", "ptxas": "13.0.88"} (16 hex)."""
    if not isinstance(toolchain, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in toolchain.items()
    ):
        raise TypeError(f"toolchain must be a dict of str to str, got {toolchain!r}")
    return _digest(toolchain)[:16]
