"""The compile cache: keys, the disk store and the per-device memory tier.

Nothing here imports MLIR or torch, so a machine with neither compiler nor GPU can fill,
list and ship a cache (see keys.py for how such a machine looks entries up).
"""

from kbuild.cache.disk import DiskCache, default_cache_dir
from kbuild.cache.keys import entry_key, source_fingerprint, toolchain_key
from kbuild.cache.memory import MemoryCache

__all__ = [
    "DiskCache",
    "MemoryCache",
    "default_cache_dir",
    "entry_key",
    "source_fingerprint",
    "toolchain_key",
]
