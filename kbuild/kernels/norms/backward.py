"""The backward kernel shared by RMSNorm, fused add + RMSNorm and LayerNorm.

With the saved per-row statistics (fp32) and wdy = dy * w:

    RMSNorm:    x_hat = x * rstd
                dx = (wdy - x_hat * mean(wdy * x_hat)) * rstd
    LayerNorm:  x_hat = (x - mean) * rstd
                dx = (wdy - mean(wdy) - x_hat * mean(wdy * x_hat)) * rstd
    fused add:  dx += d_residual_out        (x is residual_out; dx is also dresidual, written
                                             a second time in fp32 for an fp32 residual)
    dw = sum over rows of dy * x_hat,  db = sum over rows of dy

Bytes that must move: read x and dy, write dx (3 * M * N elements; + d_residual_out).

Persistent grid: block b walks row groups b, b + grid, ... and keeps its dw/db partials in
fp32, in registers or in its shared memory (a thread sees the same columns in every row),
then writes one fp32 row per partial to a [grid, N] workspace (a block of several short
rows adds them first, RowTile.store_block_partials) that reduce.py sums in a fixed order: dw
and db are bitwise reproducible, no atomics. (With a cluster, read "cluster" for "block":
clusters walk the row groups and each writes one workspace row, its blocks their slices of
it.) The next
row's loads are issued before the current row's sum where registers allow (prefetch).

Rows too long for one block are split over a cluster of blocks where the target has them:
the persistent loop runs over clusters, each block holds its slice of the row, and the row
sums are merged through distributed shared memory (mbarrier exchanges, or a cluster barrier
for the fused backward's staged rows, or for plain RMSNorm's 8 x 512-thread rows a lagged
exchange whose sums are taken a row later: dsl.exchange). Elsewhere such rows are walked in
chunks, twice, with the partial rows read and written in the workspace instead (it stays in
L2). The fused backward's longest rows and LayerNorm's rows split over 512-thread blocks copy
the next row's x and dy into shared memory ahead (`RowStage`) instead of prefetching into
registers.
"""

from __future__ import annotations

import functools

from ...dsl import (
    GroupedRows,
    Kernel,
    RowGroups,
    RowStage,
    RowTile,
    ThreadShared,
    V,
    const,
    dot,
    fma,
    hsum,
    loop,
    opaque,
    rewiden_all,
    select,
    widen,
)
from ...dsl.trace import Trace
from ...dsl.values import vector_type
from ...plan.norms import BackwardPlan, NormBackward, plan_backward
from ...targets import Target


def build_norm_backward(
    p: NormBackward,
    target: Target,
    vectorize: bool,
    *,
    trace: bool = False,
    **overrides: int | bool | str | None,
) -> Kernel:
    """Launch arguments: x, [weight], dy, [mean], rstd, [dresidual_out], dx, [dresidual],
    [dw_partial], [db_partial], M, [x_group, x_stride, x_group_magic] (a strided x). Grid:
    persistent (at most the device's resident clusters, times the cluster size).

    `overrides`: launch-plan fields forced for tuning (the backward builders pass them
    through): the keywords of plans.BackwardPlan, checked by plans.plan_backward. `trace`: a
    diagnostic build, per-row timestamps into an extra `trace` argument (dsl.trace).
    """
    plan = plan_backward(p, target, vectorize, **overrides)
    cfg, C = plan.row, plan.row.cluster
    exchange = plan.exchange or "barrier"  # a kernel without clusters takes the default
    with Kernel(p.name, target, cfg.block, plan.blocks_per_sm, cluster=C, exchange=exchange) as k:
        if trace:
            k.trace = Trace(k)
        rows = _ChunkedRows(k, p, plan) if cfg.chunked else _HeldRows(k, p, plan)
        rows.walk_rows()
        k.meta.update(rows_per_block=cfg.rows_per_block, grid="persistent", cluster=C)
    return k


class _Backward:
    """The kernel's arguments, its walk over row groups, and the row math that rows held in
    registers (`_HeldRows`) and chunked rows (`_ChunkedRows`) share. Made inside the
    kernel: the arguments are declared, and the walk's values computed, in that order."""

    def __init__(self, k: Kernel, p: NormBackward, plan: BackwardPlan) -> None:
        self.k, self.p, self.plan = k, p, plan
        cfg = self.cfg = plan.row
        self.n_partials = int(p.compute_dw) + int(p.compute_db)
        self.x_ptr = k.ptr("x")
        self.w_ptr = k.ptr("weight") if p.weight_dtype else None
        self.dy_ptr = k.ptr("dy")
        self.mean_ptr = k.ptr("mean") if p.center else None
        self.rstd_ptr = k.ptr("rstd")
        self.dres_ptr = k.ptr("dresidual_out") if p.has_dres else None
        self.dx_ptr = k.ptr("dx")
        self.dres_out_ptr = k.ptr("dresidual") if p.dres_dtype else None
        self.dw_ptr = k.ptr("dw_partial") if p.compute_dw else None
        self.db_ptr = k.ptr("db_partial") if p.compute_db else None
        self.partials = [ptr for ptr in (self.dw_ptr, self.db_ptr) if ptr is not None]
        rows = self.rows = k.i64("M")
        self.x_rows = GroupedRows(k, p.N) if p.strided else None  # x's rows at a two-level stride
        self.walk = RowGroups(k, cfg, rows)
        self.home = RowTile(k, cfg, rows, row_group=self.walk.first)  # this thread's columns
        self.slot = self.walk.index  # its workspace row: one per cluster (block)
        self.zero_vec = const(0.0, vector_type("f32", cfg.vec) if cfg.vec > 1 else "f32")
        self.inv_n = 1.0 / p.N
        # LayerNorm's row math in fused multiply-adds where they round less, never more
        # (the row sums, dx, dw) and its second widening from packed words (dsl.rewiden):
        # fewer instructions a value for its heavier rows. RMSNorm keeps separate multiplies
        # and adds: its rows already run at 88-98% of copy, and its 1024-thread rows at the
        # 64-register cap (N = 16384) spill 44-52 bytes with fma.
        self.fused = p.center
        self.rewidened = functools.partial(rewiden_all, by_words=self.fused)
        # Arrays whose next rows are asked into L2 a step ahead (`prefetch_l2`); a strided
        # x's row group is not one contiguous range.
        self.ahead = []
        if plan.prefetch_l2:
            x_ahead = [(self.x_ptr, p.x_dtype)] if self.x_rows is None else []
            self.ahead = x_ahead + [(self.dy_ptr, p.dtype)]

    def tile(self, g: V) -> RowTile:
        """This thread's tile of row group g."""
        return RowTile(self.k, self.cfg, self.rows, row_group=g)

    def row_loop(self, init: list[V], body) -> list[V]:
        return self.walk.loop(init, body, self.ahead)

    def terms(self, x, dy, w, stats, widen_fn):
        """x_hat and dy * w in fp32. Called twice per row (before and after the row sum)
        with different widenings, so only the packed raw row stays live across the sum."""
        p = self.p
        mean, rstd = stats
        xs = widen_fn(x)
        # (x - mean) * rstd, not x * rstd - mean * rstd in one fma: where x is near a
        # large mean that cancels to the rounding error of mean * rstd, not to ~0.
        x_hat = [(v - mean) * rstd for v in xs] if p.center else [v * rstd for v in xs]
        wdy = widen_fn(dy)
        if w is not None:
            wf = widen_fn(w)
            if p.offset:  # the forward's offset + w, in fp32 (dw is of w alone: unchanged)
                wf = [wv + p.offset for wv in wf]
            wdy = [d * wv for d, wv in zip(wdy, wf, strict=True)]
        return x_hat, wdy

    def sums(self, x_hat: list[V], wdy: list[V]) -> list[V]:
        """Per-thread partials of sum(wdy * x_hat) (and sum(wdy) for LayerNorm)."""
        products, total = const(0.0), const(0.0)
        for a, b in zip(x_hat, wdy, strict=True):
            products = dot(a, b, products) if self.fused else products + hsum(a * b)
            total = total + hsum(b)
        return [products, total] if self.p.center else [products]

    def write_dx(self, t, x_hat, wdy, row_sums, rstd, start: V | int = 0) -> None:
        """dx of this thread's (chunk of its) row, and the fp32 d(residual) where asked."""
        p, inv_n = self.p, self.inv_n
        # (wdy - x_hat * c2 - c1) * rstd; LayerNorm's with one fma (see `fused`). The
        # difference wdy - c1 is taken first, exactly 0 where the two agree (N = 1).
        if self.fused:
            c2 = -(row_sums[0] * inv_n)
            c1 = row_sums[1] * inv_n
            dx = [fma(xh, c2, g - c1) * rstd for g, xh in zip(wdy, x_hat, strict=True)]
        else:
            c2 = row_sums[0] * inv_n
            dx = [(g - xh * c2) * rstd for g, xh in zip(wdy, x_hat, strict=True)]
        if self.dres_ptr is not None:
            dres = widen(t.load(self.dres_ptr, p.x_dtype, start))
            dx = [a + b for a, b in zip(dx, dres, strict=True)]
        t.store(self.dx_ptr, dx, p.dtype, start)
        if self.dres_out_ptr is not None:  # the fp32 residual stream's own gradient, unrounded
            t.store(self.dres_out_ptr, dx, p.dres_dtype, start)

    def row_terms(self, t: RowTile, dy_raw: list[V], x_hat: list[V]) -> list:
        """Per partial, how this row adds to its vector i: f(i, old) -> new (dw += dy *
        x_hat, one fma; db += dy). Applied a vector at a time, so partials in shared
        memory are read and written back one by one."""
        dy = self.rewidened(dy_raw)
        out = []
        if self.dw_ptr is not None and self.fused:
            out.append(lambda i, old: fma(dy[i], x_hat[i], old))
        elif self.dw_ptr is not None:
            out.append(lambda i, old: old + dy[i] * x_hat[i])
        if self.db_ptr is not None:  # a row past M contributes nothing (x_hat is 0 there)
            out.append(lambda i, old: old + select(t.valid, dy[i], 0.0))
        return out


class _HeldRows(_Backward):
    """Rows held in registers: each thread keeps its dw/db partials (in registers, or in its
    shared memory: `shared_partials`) across the row loop and writes them to its workspace
    row once, at the end."""

    def __init__(self, k: Kernel, p: NormBackward, plan: BackwardPlan) -> None:
        super().__init__(k, p, plan)
        n = self.n = self.cfg.iters
        self.held_w = None  # resident_params: this thread's columns of w, raw
        if plan.resident_params and self.w_ptr is not None:
            self.held_w = self.home.load_param(self.w_ptr, p.weight_dtype)
        self.stash = None
        if plan.shared_partials:
            # Partial j of vector i of this thread is value j * n + i.
            self.stash = ThreadShared(k, self.n_partials * n, "f32", self.cfg.vec)
            for j in range(self.n_partials):
                for i in range(n):
                    self.put(j, i, self.zero_vec)

    def get(self, j: int, i: int) -> V:
        """Partial j of vector i, from shared memory."""
        return self.stash.get(j * self.n + i)

    def put(self, j: int, i: int, value: V) -> None:
        self.stash.put(j * self.n + i, value)

    def walk_rows(self) -> None:
        """Every row group of this block (cluster), then its partials into the workspace."""
        plan, n, n_partials = self.plan, self.n, self.n_partials
        init = [] if plan.shared_partials else [self.zero_vec] * (n * n_partials)
        if plan.stage and plan.exchange == "lagged":
            acc = self.lagged_rows(init)
        elif plan.stage:
            acc = self.staged_rows(init)
        elif plan.prefetch:
            acc = self.prefetched_rows(init)
        else:
            acc = self.fetched_rows(init)
        if plan.shared_partials:
            per_partial = [[self.get(j, i) for i in range(n)] for j in range(n_partials)]
        else:
            per_partial = [acc[j * n : (j + 1) * n] for j in range(n_partials)]
        self.home.store_block_partials(self.partials, self.slot, per_partial)

    def weight(self, t: RowTile) -> list[V] | None:
        """This thread's vectors of w, raw (held ones pass through `opaque` so their
        widening is not hoisted out of the row loop: see _ChunkedRows.loads)."""
        if self.held_w is not None:
            return [opaque(v) for v in self.held_w]
        return None if self.w_ptr is None else t.load_param(self.w_ptr, self.p.weight_dtype)

    def saved_stats(self, t: RowTile) -> list[V]:
        """rstd (and mean) of t's row, as saved by the forward."""
        stats = [t.load_row_scalar(self.rstd_ptr)]
        return stats + [t.load_row_scalar(self.mean_ptr)] if self.p.center else stats

    def fetch(self, g: V) -> list[V]:
        """Raw x, dy and saved stats of row group g (a row past M reads row M - 1)."""
        p, t = self.p, self.tile(g)
        stats = self.saved_stats(t)
        return t.load(self.x_ptr, p.x_dtype, 0, self.x_rows) + t.load(self.dy_ptr, p.dtype) + stats

    def add_partials(self, t: RowTile, dy: list[V], x_hat: list[V], acc: list[V]) -> list[V]:
        """This row's dw/db terms added to the partials (they need no row sums): in
        shared memory (returns `acc` as it is), or the register partials `acc`."""
        n = self.n
        acc = list(acc)
        for j, add_row in enumerate(self.row_terms(t, dy, x_hat)):
            for i in range(n):
                if self.plan.shared_partials:
                    self.put(j, i, add_row(i, self.get(j, i)))
                else:
                    acc[j * n + i] = add_row(i, acc[j * n + i])
        return acc

    def row_group(self, g: V, phase: V | None, acc: list[V], fetched: list[V], staged=None):
        """One row group: its row sums, dx, and dw/db terms added to the partials (returned).
        `staged` (a Staged): x and dy came from a RowStage, which is released once they are
        read."""
        p, n = self.p, self.n
        acc = list(acc)
        t = self.tile(g)
        x, dy, rstd = fetched[:n], fetched[n : 2 * n], fetched[2 * n]
        # A row past M (last group) has rstd 0: it adds nothing to dw, stores nothing.
        stats = (fetched[2 * n + 1] if p.center else None, select(t.valid, rstd, 0.0))
        w = self.weight(t)
        row_state = self.sums(*self.terms(x, dy, w, stats, widen))
        if staged is not None:
            staged.release()

        def accumulate(x_hat: list[V]) -> None:
            """This row's dw/db terms: they do not need the row sums."""
            acc[:] = self.add_partials(t, dy, x_hat, acc)

        if self.cfg.cluster > 1:
            # Split over a cluster: x_hat and the accumulation fill the wait for the
            # other blocks at the cluster barrier.
            done = []

            def meanwhile() -> None:
                done.extend(self.terms(x, dy, w, stats, self.rewidened))
                accumulate(done[0])

            row_sums = t.sum(*row_state, reused=True, phase=phase, meanwhile=meanwhile)
            self.write_dx(t, *done, row_sums, stats[1])
        else:  # one block: dx first, so fewer values stay live across the barrier
            row_sums = t.sum(*row_state, reused=True)
            x_hat, wdy = self.terms(x, dy, w, stats, self.rewidened)
            self.write_dx(t, x_hat, wdy, row_sums, stats[1])
            accumulate(x_hat)
        return acc

    def fetched_rows(self, init: list[V]) -> list[V]:
        """Each row group's x, dy and stats loaded in its own step (neither prefetched nor
        staged). Returns the partials."""
        return self.row_loop(init, lambda g, phase, a: self.row_group(g, phase, a, self.fetch(g)))

    def prefetched_rows(self, init: list[V]) -> list[V]:
        """Software pipelining: the next row's loads are issued before this row's sum and
        barrier, so they are in flight while the block reduces and stores. Returns the
        partials."""

        def body(g: V, phase: V | None, carried: list[V]) -> list[V]:
            acc, current = carried[: len(init)], carried[len(init) :]
            upcoming = self.fetch(g + self.walk.stride)
            return self.row_group(g, phase, acc, current) + upcoming

        return self.row_loop(init + self.fetch(self.walk.first), body)[: len(init)]

    def staged_rows(self, init: list[V]) -> list[V]:
        """The next row group's x and dy are copied into shared memory while this one is
        worked on (no registers held for them). The stats of the next group are carried in
        registers, like the staged rows. Returns the partials."""
        p = self.p
        arrays = [(self.x_ptr, p.x_dtype, self.x_rows), (self.dy_ptr, p.dtype)]
        staging = RowStage(self.k, self.cfg, arrays, self.plan.stage)

        def body(g: V, phase: V | None, carried: list[V], staged) -> list[V]:
            acc, stats = carried[: len(init)], carried[len(init) :]
            x, dy = staged.values
            following = self.saved_stats(self.tile(g + self.walk.stride))
            return self.row_group(g, phase, acc, x + dy + stats, staged) + following

        start = init + self.saved_stats(self.home)
        return staging.loop(self.walk, start, body, self.ahead)[: len(init)]

    def lagged_rows(self, init: list[V]) -> list[V]:
        """Staged rows with the lagged exchange (dsl.exchange): each step sends its row's
        sums to the cluster, then takes the previous row's sums and finishes that row (x_hat
        and dy * w once, for its dx and its dw/db terms) from its raw x and dy, carried a
        step in registers. The exchange's latency is spent on a row's work instead of a
        wait. Returns the partials.

        Before the first row the "previous" one is a group past the end (`walk.count`):
        nothing is awaited for it, its stores are off (RowTile.valid) and its terms add
        nothing (x and dy zero, rstd 0), so every step runs the same code."""
        k, p, cfg, n, walk = self.k, self.p, self.cfg, self.n, self.walk
        arrays = [(self.x_ptr, p.x_dtype, self.x_rows), (self.dy_ptr, p.dtype)]
        staging = RowStage(k, cfg, arrays, self.plan.stage)
        lag = k.exchange.lagged(2 if p.center else 1)
        n_acc, n_stats = len(init), 2 if p.center else 1
        raw_zero = [const(0.0, vector_type(d, cfg.vec)) for d in (p.x_dtype, p.dtype)]

        def finish(acc: list[V], g: V, phase: V, carried: list[V]) -> list[V]:
            """Row group g, sent with `phase` a step ago (`carried`: its raw x and dy,
            mean and rstd): its sums, dx and dw/db terms; returns the partials."""
            t = self.tile(g)
            x, dy = carried[:n], carried[n : 2 * n]
            stats = (carried[2 * n] if p.center else None, carried[2 * n + 1])
            row_sums = t.receive_sum(lag, phase, when=g < walk.count)
            x_hat, wdy = self.terms(x, dy, self.weight(t), stats, self.rewidened)
            self.write_dx(t, x_hat, wdy, row_sums, stats[1])
            return self.add_partials(t, dy, x_hat, acc)

        def body(g: V, phase: V, carried: list[V], staged) -> list[V]:
            acc = carried[:n_acc]
            saved = carried[n_acc : n_acc + n_stats]  # this group's stats, as fetched
            previous, previous_phase = carried[n_acc + n_stats : n_acc + n_stats + 2]
            before = carried[n_acc + n_stats + 2 :]
            t = self.tile(g)
            x, dy = staged.values
            mean = saved[1] if p.center else const(0.0)
            stats = (mean if p.center else None, select(t.valid, saved[0], 0.0))
            row_state = self.sums(*self.terms(x, dy, self.weight(t), stats, widen))
            staged.release()  # the next copies first (H200: 93% of copy against 89%)
            following = self.saved_stats(self.tile(g + walk.stride))
            t.send_sum(lag, *row_state, phase=phase)
            acc = finish(acc, previous, previous_phase, before)
            return acc + following + [g, phase] + x + dy + [mean, stats[1]]

        # No group before the first: one past the end, with zero rows and rstd.
        none = [walk.count, const(0, "i32")]
        raw = [v for v in raw_zero for _ in range(n)]
        start = init + self.saved_stats(self.home) + none + raw + [const(0.0)] * 2
        out = staging.loop(walk, start, body, self.ahead)
        last, last_phase = out[n_acc + n_stats : n_acc + n_stats + 2]
        return finish(out[:n_acc], last, last_phase, out[n_acc + n_stats + 2 :])


class _ChunkedRows(_Backward):
    """Rows too long for registers, walked in chunks twice (the row sums, then dx and the
    dw/db terms). A chunked row adds into its workspace row as it goes: one row a block
    (the plan sees to it), or the block's rows would race on the slot they share."""

    def __init__(self, k: Kernel, p: NormBackward, plan: BackwardPlan) -> None:
        super().__init__(k, p, plan)
        assert self.cfg.rows_per_block == 1, "chunked backward rows take one row a block"
        self.chunks = const(self.cfg.chunks, "i64")  # over this block's slice
        self.one, self.zero = const(1, "i64"), const(0, "i64")

    def over_chunks(self, init: list[V], fn) -> list[V]:
        """fn(c, carried) -> carried for each chunk c of this block's slice."""
        return loop(self.zero, self.chunks, self.one, init, fn)

    def each_chunk(self, fn) -> None:
        """fn(start) for the start of each chunk of this block's slice."""
        self.over_chunks([], lambda c, _: fn(c * self.cfg.span) or [])

    def walk_rows(self) -> None:
        """The workspace rows zeroed, then every row group of this block (cluster)."""
        home, zero_vec, iters = self.home, self.zero_vec, self.cfg.iters
        for ptr in self.partials:
            self.each_chunk(
                lambda s, ptr=ptr: home.store_row(ptr, self.slot, [zero_vec] * iters, "f32", s)
            )
        self.row_loop([], self.row)

    def row(self, g: V, phase: V | None, _: list[V]) -> list[V]:
        """One row: its sums over the chunks, then each chunk's dx and dw/db terms."""
        t, stats = self.row_stats(g)
        row_sums = self.row_sums(t, stats, phase)
        self.each_chunk(lambda start: self.finish_chunk(t, stats, row_sums, start))
        return []

    def row_stats(self, g: V) -> tuple[RowTile, tuple[V, V]]:
        t = self.tile(g)
        # A row past M (last group) computes on row M - 1 with rstd 0: no dw, no store.
        rstd = select(t.valid, t.load_row_scalar(self.rstd_ptr), 0.0)
        mean = t.load_row_scalar(self.mean_ptr) if self.p.center else None
        return t, (mean, rstd)

    def loads(self, t: RowTile, start: V | int = 0):
        """Raw x, dy and w of one chunk of a row. w is read again for every row (from L1):
        held across the row loop, its fp32 widening gets hoisted out of the loop and the
        block loses half its occupancy."""
        p, w_ptr = self.p, self.w_ptr
        w = None if w_ptr is None else t.load_param(w_ptr, p.weight_dtype, start)
        return (
            t.load(self.x_ptr, p.x_dtype, start, self.x_rows),
            t.load(self.dy_ptr, p.dtype, start),
            w,
        )

    def row_sums(self, t: RowTile, stats: tuple[V, V], phase: V | None) -> list[V]:
        """The row's sum(wdy * x_hat) (and sum(wdy)), chunk by chunk, over the row."""

        def accumulate(c: V, acc: list[V]) -> list[V]:
            x, dy, w = self.loads(t, c * self.cfg.span)
            chunk = self.sums(*self.terms(x, dy, w, stats, widen))
            return [a + s for a, s in zip(acc, chunk, strict=True)]

        init = [const(0.0)] * (2 if self.p.center else 1)
        return t.sum(*self.over_chunks(init, accumulate), reused=True, phase=phase)

    def finish_chunk(self, t: RowTile, stats, row_sums: list[V], start: V) -> None:
        """dx of one chunk, and its dw/db terms added to the workspace row."""
        x, dy, w = self.loads(t, start)
        x_hat, wdy = self.terms(x, dy, w, stats, widen)
        self.write_dx(t, x_hat, wdy, row_sums, stats[1], start)
        for ptr, add_row in zip(self.partials, self.row_terms(t, dy, x_hat), strict=True):
            old = t.load_row(ptr, self.slot, "f32", start)
            summed = [add_row(i, v) for i, v in enumerate(old)]
            t.store_row(ptr, self.slot, summed, "f32", start)
