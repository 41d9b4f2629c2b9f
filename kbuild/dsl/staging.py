"""Rows staged in shared memory ahead of their use: `RowStage` copies a persistent walk's
next row groups by `cp.async` while the current one is worked on, and hands each step its
group as a `Staged` (read, reload, release)."""

from __future__ import annotations

from ..dtypes import ELEMENT_BYTES
from .kernel import Kernel
from .memory import commit_async, copy_async, get_llvm_ptr, load, wait_async
from .row_walk import RowGroups
from .rows import RowShape, RowTile
from .shared import ThreadShared
from .values import V, const


class Staged:
    """One step's staged row group, as RowStage.loop hands it to the body: `values` (per
    array, this thread's raw vectors, read when the step began), `reload()` (read them again
    from shared memory: the body need not hold them in registers across its reductions) and
    `release()` (the buffer is free: start copying the group `depth` steps ahead into it;
    call it once, after the last read)."""

    def __init__(self, stage: RowStage, buffer: V | int, upcoming: RowTile):
        self._stage, self._buffer, self._upcoming = stage, buffer, upcoming
        self.values = stage.take(buffer)
        self.released = False

    def reload(self) -> list[list[V]]:
        if self.released:
            raise ValueError("a staged row group was read after its buffer was released")
        return self._stage.read(self._buffer)

    def release(self) -> None:
        if self.released:
            raise ValueError("a staged row group was released twice")
        self.released = True
        self._stage.issue(self._upcoming, self._buffer)


class RowStage:
    """Rows copied into shared memory ahead of their use (`copy_async`, bypassing registers
    and L1): a persistent kernel keeps the copies of its next row groups in flight while it
    works on the current one. Each thread copies, and later reads, only its own 16-byte
    vectors (ThreadShared): no barriers. Exact rows of 16-byte vectors. `arrays`: (base,
    dtype) pairs, or (base, dtype, rows) for an array of GroupedRows.

    `depth` buffers (b = 0 .. depth - 1, an i64 value), each holding one row group; `loop`
    cycles through them: it fills all, then each step takes the current buffer and, once the
    body releases it, copies the group `depth` steps ahead into it. A body that releases
    right after its first read has `depth` groups in flight while it works; one that reloads
    the rows after its reductions and releases at its end has `depth - 1` (and holds fewer
    registers)."""

    def __init__(self, k: Kernel, cfg: RowShape, arrays: list[tuple], depth: int = 1):
        arrays = [(a[0], a[1], a[2] if len(a) > 2 else None) for a in arrays]
        if not (cfg.exact and all(cfg.vec * ELEMENT_BYTES[d] == 16 for _, d, _ in arrays)):
            raise ValueError("staged rows must be exact rows of 16-byte vectors")
        if depth < 1:
            raise ValueError(f"stage depth must be at least 1, not {depth}")
        self.k, self.cfg, self.arrays, self.depth = k, cfg, arrays, depth
        self.slots = [ThreadShared(k, cfg.iters * depth, d, cfg.vec) for _, d, _ in arrays]

    def _slot(self, slots: ThreadShared, i: int, buffer: V | int) -> V:
        ptr = slots.slot(i)
        if isinstance(buffer, int) and buffer == 0:
            return ptr
        return get_llvm_ptr(ptr, buffer * (self.cfg.iters * self.k.block * slots.sub), slots.dtype)

    def loop(self, walk: RowGroups, init: list[V], body, ahead=()) -> list[V]:
        """walk.loop with staged rows: body(g, phase, carried, staged: Staged) -> carried.
        `ahead` is passed on to walk.loop (L2 prefetch), for the first group not yet staged."""
        k, cfg, depth = self.k, self.cfg, self.depth
        for j in range(depth):  # fill every buffer: buffer j with the block's j-th group
            self.issue(RowTile(k, cfg, walk.rows, row_group=walk.first + j * walk.stride), j)
        extra = 1 if depth > 1 else 0  # the buffer index, carried first

        def step(g: V, phase: V | None, carried: list[V]) -> list[V]:
            buffer = carried[0] if extra else 0
            upcoming = RowTile(k, cfg, walk.rows, row_group=g + depth * walk.stride)
            staged = Staged(self, buffer, upcoming)
            if k.trace is not None:
                k.trace.mark("landed")
            out = body(g, phase, carried[extra:], staged)
            if not staged.released:
                raise ValueError("the body of a staged loop must release its row group")
            return ([(buffer + 1) % depth] if extra else []) + out

        first = [const(0, "i64")] if extra else []
        out = walk.loop(first + list(init), step, ahead, distance=depth + 1)[extra:]
        wait_async(0)  # the copies started for groups past the end land before the kernel ends
        return out

    def issue(self, t: RowTile, buffer: V | int) -> None:
        """Start copying this thread's vectors of t's row of each array into `buffer`."""
        for (base, dtype, rows), slots in zip(self.arrays, self.slots, strict=True):
            offset = t.offset_in(rows)
            for i, col in enumerate(t.columns()):
                src = get_llvm_ptr(base, offset + col, dtype)
                copy_async(self._slot(slots, i, buffer), src)
        commit_async()

    def take(self, buffer: V | int) -> list[list[V]]:
        """Wait for the oldest copies in flight (those of `buffer`) and read them."""
        wait_async(self.depth - 1)
        return self.read(buffer)

    def read(self, buffer: V | int) -> list[list[V]]:
        """Per array, this thread's raw vectors in `buffer` (landed: see `take`)."""
        return [
            [load(self._slot(s, i, buffer), s.dtype, s.sub) for i in range(self.cfg.iters)]
            for s in self.slots
        ]
