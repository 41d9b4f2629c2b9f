"""The memories a launch sees: global memory (the CPU tensors' own bytes), each block's shared
memory, mbarriers, and the race check that keeps lockstep honest.

Global memory is the host memory of CPU tensors. The driver knows every allocation; here the
allocation table is filled by `note(tensor)`, which `torch.Tensor.data_ptr` calls while
the interpreter is on (a kernel's pointer arguments come from data_ptr), so every access is
checked against a live tensor's storage: an address outside all of them is a `KernelFault`
naming the kernel, the thread and the address, as compute-sanitizer names them.

Shared memory is one byte array per block, filled with 0xff at launch (NaN as floats, -1 as
integers), so a read of a word no thread wrote shows. Its addresses are offsets into the
block's window; an address in another block of the cluster (`mapa`) carries that block's rank
above bit 24.

Lockstep runs every thread of a block (and every block of a cluster) at the same instruction,
which hides a missing barrier: a thread reads what another wrote a moment earlier, where the
GPU would not order the two. So each shared word remembers who last wrote and read it, and
when (the owning block's barrier epoch, advanced by block and cluster barriers and by a
completed mbarrier wait); two accesses by different threads within one epoch, one a write,
are a `RaceError`.
"""

from __future__ import annotations

import collections

import numpy as np

CLUSTER_RANK_SHIFT = 24  # a DSMEM address: (rank + 1) << 24 | offset


def cluster_address(rank, offset):
    """The address of shared offset `offset` in block `rank` of the cluster (what mapa
    gives)."""
    return ((rank + 1) << CLUSTER_RANK_SHIFT) | offset


def split_cluster_address(addr):
    """(rank, offset) of shared addresses: rank -1 for an address in the block's own window."""
    return (addr >> CLUSTER_RANK_SHIFT) - 1, addr & ((1 << CLUSTER_RANK_SHIFT) - 1)


class KernelFault(RuntimeError):
    """What the GPU would report as an illegal address, barrier divergence or hang, found by
    the interpreter and named by kernel, block, thread and address."""


class RaceError(KernelFault):
    """Two threads touch one shared word, one of them writing, with no barrier between."""


class Allocations:
    """The allocation table: live CPU tensor storages by start address (the driver's view
    of memory). Holds the most recent `capacity` storages."""

    def __init__(self, capacity: int = 4096) -> None:
        self._storages: collections.OrderedDict[int, tuple[int, object]] = collections.OrderedDict()
        self._capacity = capacity

    def note(self, tensor) -> None:
        if tensor.device.type != "cpu":
            return
        storage = tensor.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        if size == 0:
            return
        known = self._storages.get(start)
        if known is not None and known[0] == size:
            self._storages.move_to_end(start)
            return
        import torch

        holder = torch.empty(0, dtype=torch.uint8).set_(storage)
        self._storages[start] = (size, holder)
        while len(self._storages) > self._capacity:
            self._storages.popitem(last=False)

    def snapshot(self) -> GlobalMemory:
        return GlobalMemory(sorted((s, n, h) for s, (n, h) in self._storages.items()))


ALLOCATIONS = Allocations()


class GlobalMemory:
    """Byte-addressed access to the allocations of one launch."""

    def __init__(self, regions: list[tuple[int, int, object]]) -> None:
        self.starts = np.array([s for s, _, _ in regions], dtype=np.int64)
        self.ends = np.array([s + n for s, n, _ in regions], dtype=np.int64)
        self.buffers = [h.numpy() for _, _, h in regions]

    def locate(self, addr: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        """(region index, offset) of each address; region -1 where [addr, addr + size) is
        not inside one allocation."""
        idx = np.searchsorted(self.starts, addr, side="right") - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        if len(self.starts):
            ok &= addr + size <= self.ends[safe]
        else:
            ok[:] = False
        return np.where(ok, idx, -1), addr - (self.starts[safe] if len(self.starts) else 0)

    def read(self, region: np.ndarray, offset: np.ndarray, size: int) -> np.ndarray:
        out = np.empty((len(region), size), np.uint8)
        span = np.arange(size)
        for r in np.unique(region):
            sel = region == r
            out[sel] = self.buffers[r][offset[sel][:, None] + span]
        return out

    def write(self, region: np.ndarray, offset: np.ndarray, raw: np.ndarray) -> None:
        span = np.arange(raw.shape[1])
        for r in np.unique(region):
            sel = region == r
            self.buffers[r][offset[sel][:, None] + span] = raw[sel]


class Mbarrier:
    __slots__ = ("count", "pending", "tx", "phase")

    def __init__(self, count: int) -> None:
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def settle(self) -> None:
        if self.pending <= 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count


class SharedMemory:
    """Every block's shared window (blocks, bytes), its race shadow and its mbarriers."""

    def __init__(self, blocks: int, size: int, check_races: bool) -> None:
        self.size = size
        self.bytes = np.full((blocks, max(size, 4)), 0xFF, np.uint8)
        self.flat = self.bytes.reshape(-1)
        words = self.bytes.shape[1] // 4 + 1
        self.words = words
        self.check = check_races
        if check_races:
            n = blocks * words
            self.writer = np.full(n, -1, np.int64)
            self.wepoch = np.full(n, -1, np.int64)
            self.reader = np.full(n, -1, np.int64)
            self.repoch = np.full(n, -1, np.int64)
        self.epoch = np.zeros(blocks, np.int64)
        self.mbarriers: dict[tuple[int, int], Mbarrier] = {}
