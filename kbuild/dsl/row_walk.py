"""The persistent row walk: `RowGroups` takes a grid's blocks (clusters) over the row groups
of an (M, N) array, carrying the cluster exchange's phase and, where asked, prefetching the
rows a step ahead into L2."""

from __future__ import annotations

import math

from ..dtypes import ELEMENT_BYTES
from .control import if_then, loop
from .kernel import Kernel
from .memory import get_llvm_ptr, prefetch_l2
from .rows import RowShape
from .values import V, const, maximum, minimum, select


def phase_classes(cfg: RowShape) -> int:
    """Row phases a peeled row shape cycles through (1: every row starts aligned)."""
    if not cfg.peel:
        return 1
    if cfg.rows_per_block != 1:
        raise ValueError("peeled rows take one row per block (each row has its own phase)")
    return cfg.vec // math.gcd(cfg.N, cfg.vec)


class RowGroups:
    """A persistent grid's walk over the row groups: cluster c (block c, without clusters)
    takes groups c, c + clusters, ... (`first`, `stride`; peeled rows: see below); its
    blocks each cover their slice of those rows. `index`: the cluster's own number (c)."""

    def __init__(self, k: Kernel, cfg: RowShape, rows: V):
        C = cfg.cluster
        self.k, self.cfg, self.rows = k, cfg, rows
        first = k.block_id() / C if C > 1 else k.block_id()
        stride = k.grid_size() / C if C > 1 else k.grid_size()
        self.index = first  # this block's (cluster's) own number: its workspace row
        self.count = (rows + (cfg.rows_per_block - 1)) / cfg.rows_per_block
        classes = phase_classes(cfg)
        if classes > 1:
            # Peeled rows (one per group): row r's phase is (r * N) % vec, which repeats every
            # `classes` rows. Block b walks only the rows of class b % classes, so a thread
            # holds the same columns in all its rows (its partials and held parameters stay
            # put); blocks past a whole number of classes get no rows. The grid must hold at
            # least `classes` blocks or one per group: `meta["min_clusters"]`, which the
            # launchers take as the fewest clusters their persistent grid holds (on a device
            # holding fewer at once, rows of the classes past them were never computed).
            k.meta["min_clusters"] = max(k.meta.get("min_clusters", 1), classes)
            per_class = maximum(stride / classes, const(1, "i64"))
            cls, index = first % classes, first / classes
            first = select(index < per_class, cls + index * classes, self.count)
            stride = per_class * classes
        self.first, self.stride = first, stride

    def loop(
        self, init: list[V], body, ahead: list[tuple[V, str]] = (), distance: int = 1
    ) -> list[V]:
        """body(g, phase, carried) -> carried, for each of this block's row groups g.
        `phase` (i32), the kernel's exchange phase (dsl.exchange.ClusterExchange: which half
        of a cluster row sum's buffers a row uses, and its mbarrier parity), goes from
        `first_phase` through `next_phase`; None without a cluster.

        `ahead`: (array, dtype) pairs whose slice of the rows `distance` groups ahead one
        thread asks into L2 at the start of each step (`prefetch_l2`), so the loads of them
        meet L2 instead of DRAM; 16-byte vectors only."""
        k, cfg = self.k, self.cfg
        C = cfg.cluster
        if C > 1:
            k.ensure_cluster_started()  # before the loop: its row sums store into peer blocks

        trace, exchange = k.trace, k.exchange

        def step(g: V, carried: list[V]) -> list[V]:
            if trace is not None:
                trace.iteration = (g - self.first) / self.stride
                trace.mark("start")
            if ahead:
                self._prefetch(g + distance * self.stride, ahead)
            if C == 1:
                out = body(g, None, carried)
            else:
                out = [exchange.next_phase(carried[0])] + body(g, carried[0], carried[1:])
            if trace is not None:
                trace.mark("end")
            return out

        init = list(init) if C == 1 else [exchange.first_phase()] + list(init)
        out = loop(self.first, self.count, self.stride, init, step)
        if trace is not None:
            trace.iteration = None  # its value lives in the loop only
        return out if C == 1 else out[1:]

    def _prefetch(self, g: V, arrays: list[tuple[V, str]]) -> None:
        cfg = self.cfg
        first_row = g * cfg.rows_per_block
        # The group's rows are contiguous: whole rows, or one row's slice.
        n_rows = minimum(self.rows - first_row, const(cfg.rows_per_block, "i64"))
        first = self.k.cluster_rank() * cfg.slice if cfg.cluster > 1 else 0

        if cfg.cluster > 1 and cfg.rows_per_block > 1:
            raise ValueError("L2 prefetch needs a group's slice to be contiguous (one row)")
        if cfg.peel:
            raise ValueError("L2 prefetch needs rows of whole 16-byte vectors (not peeled)")

        def issue() -> None:
            for base, dtype in arrays:
                if cfg.vec * ELEMENT_BYTES[dtype] != 16:
                    raise ValueError("L2 prefetch needs rows of 16-byte vectors")
                ptr = get_llvm_ptr(base, first_row * cfg.N + first, dtype)
                prefetch_l2(ptr, n_rows * (cfg.slice * ELEMENT_BYTES[dtype]))

        if_then((g < self.count) & (self.k.thread_id() < 1), issue)
