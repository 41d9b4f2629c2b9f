"""The persistent row walk: `RowGroups` takes a grid's blocks (clusters) over the row groups
of an (M, N) array, carrying the cluster exchange's phase and, where asked, prefetching the
rows a step ahead into L2."""

from __future__ import annotations

from ..dtypes import ELEMENT_BYTES
from .control import if_then, loop
from .kernel import Kernel
from .memory import get_llvm_ptr, prefetch_l2
from .rows import RowShape
from .values import V, const, minimum


class RowGroups:
    """A persistent grid's walk over the row groups: cluster c (block c, without clusters)
    takes groups c, c + clusters, ...; its blocks each cover their slice of those rows."""

    def __init__(self, k: Kernel, cfg: RowShape, rows: V):
        C = cfg.cluster
        self.k, self.cfg, self.rows = k, cfg, rows
        self.first = k.block_id() / C if C > 1 else k.block_id()
        self.stride = k.grid_size() / C if C > 1 else k.grid_size()
        self.count = (rows + (cfg.rows_per_block - 1)) / cfg.rows_per_block

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

        def issue() -> None:
            for base, dtype in arrays:
                if cfg.vec * ELEMENT_BYTES[dtype] != 16:
                    raise ValueError("L2 prefetch needs rows of 16-byte vectors")
                ptr = get_llvm_ptr(base, first_row * cfg.N + first, dtype)
                prefetch_l2(ptr, n_rows * (cfg.slice * ELEMENT_BYTES[dtype]))

        if_then((g < self.count) & (self.k.thread_id() < 1), issue)
