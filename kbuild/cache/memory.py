"""MemoryCache: the per-process tier of kernels already loaded onto a device.

Keys are `(spec, device_index)` tuples (anything hashable works). The device index is part
of the key because a loaded module belongs to one device's context: a module loaded on cuda:0
must never be launched on cuda:1, so each device loads its own copy.

`get` runs on every kernel launch, so it is the bound `OrderedDict.get` itself: one C-level
dict lookup, no Python frame, no reordering. The bound therefore evicts the entry inserted
longest ago rather than the one used longest ago. With thousands of slots it is a guard
against unbounded growth (a service that sees many distinct row sizes), not a working-set
policy: an evicted kernel that is still in use only costs a reload from the disk tier.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

DEFAULT_CAPACITY = 4096
CAPACITY_ENV = "KBUILD_MEMORY_CACHE_SIZE"


def _capacity_from_env() -> int:
    text = os.environ.get(CAPACITY_ENV, "")
    if not text:
        return DEFAULT_CAPACITY
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{CAPACITY_ENV} must be a positive integer, got {text!r}") from None


class MemoryCache:
    """A bounded map from `(spec, device_index)` to a loaded kernel (an opaque object).

    `capacity` defaults to $KBUILD_MEMORY_CACHE_SIZE, else 4096 entries. `get(key)` returns
    the loaded object or None.
    """

    def __init__(self, capacity: int | None = None) -> None:
        capacity = _capacity_from_env() if capacity is None else capacity
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        # Puts are rare (one per kernel and device); the lock keeps eviction consistent when
        # two threads load kernels at once. `get` needs none: a dict lookup is atomic.
        self._lock = threading.Lock()
        self.get: Callable[[Hashable], Any] = self._entries.get

    def put(self, key: Hashable, value: Any) -> None:
        """Insert or replace `key`, then evict the oldest entries beyond capacity."""
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every loaded kernel (the dict is emptied in place, so `get` stays bound)."""
        with self._lock:
            self._entries.clear()

    def keys(self) -> list[Hashable]:
        """A snapshot of the keys, oldest first."""
        return list(self._entries)
