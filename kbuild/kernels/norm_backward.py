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

from ..dsl import (
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
from ..dsl.trace import Trace
from ..dsl.values import vector_type
from ..targets import Target
from .plans import NormBackward, plan_backward


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
    cfg, C, shared_partials = plan.row, plan.row.cluster, plan.shared_partials
    n_partials = int(p.compute_dw) + int(p.compute_db)
    exchange = plan.exchange or "barrier"  # a kernel without clusters takes the default
    with Kernel(p.name, target, cfg.block, plan.blocks_per_sm, cluster=C, exchange=exchange) as k:
        if trace:
            k.trace = Trace(k)
        x_ptr = k.ptr("x")
        w_ptr = k.ptr("weight") if p.weight_dtype else None
        dy_ptr = k.ptr("dy")
        mean_ptr = k.ptr("mean") if p.center else None
        rstd_ptr = k.ptr("rstd")
        dres_ptr = k.ptr("dresidual_out") if p.has_dres else None
        dx_ptr = k.ptr("dx")
        dres_out_ptr = k.ptr("dresidual") if p.dres_dtype else None
        dw_ptr = k.ptr("dw_partial") if p.compute_dw else None
        db_ptr = k.ptr("db_partial") if p.compute_db else None
        partials = [ptr for ptr in (dw_ptr, db_ptr) if ptr is not None]
        rows = k.i64("M")
        x_rows = GroupedRows(k, p.N) if p.strided else None  # x's rows at a two-level stride
        walk = RowGroups(k, cfg, rows)
        first_group, stride = walk.first, walk.stride
        home = RowTile(k, cfg, rows, row_group=first_group)  # this thread's columns
        slot = walk.index  # its workspace row: one per cluster (block)
        zero_vec = const(0.0, vector_type("f32", cfg.vec) if cfg.vec > 1 else "f32")
        inv_n = 1.0 / p.N
        # LayerNorm's row math in fused multiply-adds where they round less, never more
        # (the row sums, dx, dw) and its second widening from packed words (dsl.rewiden):
        # fewer instructions a value for its heavier rows. RMSNorm keeps separate multiplies
        # and adds: its rows already run at 88-98% of copy, and its 1024-thread rows at the
        # 64-register cap (N = 16384) spill 44-52 bytes with fma.
        fused = p.center
        rewidened = functools.partial(rewiden_all, by_words=fused)  # LayerNorm's: dsl.rewiden
        # Arrays whose next rows are asked into L2 a step ahead (`prefetch_l2`); a strided
        # x's row group is not one contiguous range.
        ahead = [(x_ptr, p.x_dtype)] if x_rows is None else []
        ahead = ahead + [(dy_ptr, p.dtype)] if plan.prefetch_l2 else []

        def row_loop(init: list[V], body) -> list[V]:
            return walk.loop(init, body, ahead)

        def loads(t: RowTile, start: V | int = 0):
            """Raw x, dy and w of one (chunk of a) row. w is read again for every row (from
            L1): held across the row loop, its fp32 widening gets hoisted out of the loop and
            the block loses half its occupancy."""
            w = None if w_ptr is None else t.load_param(w_ptr, p.weight_dtype, start)
            return t.load(x_ptr, p.x_dtype, start, x_rows), t.load(dy_ptr, p.dtype, start), w

        def terms(x, dy, w, stats, widen_fn):
            """x_hat and dy * w in fp32. Called twice per row (before and after the row sum)
            with different widenings, so only the packed raw row stays live across the sum."""
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

        def sums(x_hat: list[V], wdy: list[V]) -> list[V]:
            """Per-thread partials of sum(wdy * x_hat) (and sum(wdy) for LayerNorm)."""
            products, total = const(0.0), const(0.0)
            for a, b in zip(x_hat, wdy, strict=True):
                products = dot(a, b, products) if fused else products + hsum(a * b)
                total = total + hsum(b)
            return [products, total] if p.center else [products]

        def write_dx(t, x_hat, wdy, row_sums, rstd, start: V | int = 0) -> None:
            # (wdy - x_hat * c2 - c1) * rstd; LayerNorm's with one fma (see `fused`). The
            # difference wdy - c1 is taken first, exactly 0 where the two agree (N = 1).
            if fused:
                c2 = -(row_sums[0] * inv_n)
                c1 = row_sums[1] * inv_n
                dx = [fma(xh, c2, g - c1) * rstd for g, xh in zip(wdy, x_hat, strict=True)]
            else:
                c2 = row_sums[0] * inv_n
                dx = [(g - xh * c2) * rstd for g, xh in zip(wdy, x_hat, strict=True)]
            if dres_ptr is not None:
                dres = widen(t.load(dres_ptr, p.x_dtype, start))
                dx = [a + b for a, b in zip(dx, dres, strict=True)]
            t.store(dx_ptr, dx, p.dtype, start)
            if dres_out_ptr is not None:  # the fp32 residual stream's own gradient, unrounded
                t.store(dres_out_ptr, dx, p.dres_dtype, start)

        def row_terms(t: RowTile, dy_raw: list[V], x_hat: list[V]) -> list:
            """Per partial, how this row adds to its vector i: f(i, old) -> new (dw += dy *
            x_hat, one fma; db += dy). Applied a vector at a time, so partials in shared
            memory are read and written back one by one."""
            dy = rewidened(dy_raw)
            out = []
            if dw_ptr is not None and fused:
                out.append(lambda i, old: fma(dy[i], x_hat[i], old))
            elif dw_ptr is not None:
                out.append(lambda i, old: old + dy[i] * x_hat[i])
            if db_ptr is not None:  # a row past M contributes nothing (x_hat is 0 there)
                out.append(lambda i, old: old + select(t.valid, dy[i], 0.0))
            return out

        def row_stats(g: V) -> tuple[RowTile, tuple[V, V]]:
            t = RowTile(k, cfg, rows, row_group=g)
            # A row past M (last group) computes on row M - 1 with rstd 0: no dw, no store.
            rstd = select(t.valid, t.load_row_scalar(rstd_ptr), 0.0)
            mean = t.load_row_scalar(mean_ptr) if p.center else None
            return t, (mean, rstd)

        if not cfg.chunked:
            n = cfg.iters
            held_w = None  # resident_params: this thread's columns of w, raw
            if plan.resident_params and w_ptr is not None:
                held_w = home.load_param(w_ptr, p.weight_dtype)

            def weight(t: RowTile) -> list[V] | None:
                """This thread's vectors of w, raw (held ones pass through `opaque` so their
                widening is not hoisted out of the row loop: see loads())."""
                if held_w is not None:
                    return [opaque(v) for v in held_w]
                return None if w_ptr is None else t.load_param(w_ptr, p.weight_dtype)

            def saved_stats(t: RowTile) -> list[V]:
                """rstd (and mean) of t's row, as saved by the forward."""
                stats = [t.load_row_scalar(rstd_ptr)]
                return stats + [t.load_row_scalar(mean_ptr)] if p.center else stats

            def fetch(g: V) -> list[V]:
                """Raw x, dy and saved stats of row group g (a row past M reads row M - 1)."""
                t = RowTile(k, cfg, rows, row_group=g)
                stats = saved_stats(t)
                return t.load(x_ptr, p.x_dtype, 0, x_rows) + t.load(dy_ptr, p.dtype) + stats

            if shared_partials:
                # Partial j of vector i of this thread is value j * n + i.
                stash = ThreadShared(k, n_partials * n, "f32", cfg.vec)

                def get(j: int, i: int) -> V:
                    return stash.get(j * n + i)

                def put(j: int, i: int, value: V) -> None:
                    stash.put(j * n + i, value)

                for j in range(n_partials):
                    for i in range(n):
                        put(j, i, zero_vec)

            def add_partials(t: RowTile, dy: list[V], x_hat: list[V], acc: list[V]) -> list[V]:
                """This row's dw/db terms added to the partials (they need no row sums): in
                shared memory (returns `acc` as it is), or the register partials `acc`."""
                acc = list(acc)
                for j, add_row in enumerate(row_terms(t, dy, x_hat)):
                    for i in range(n):
                        if shared_partials:
                            put(j, i, add_row(i, get(j, i)))
                        else:
                            acc[j * n + i] = add_row(i, acc[j * n + i])
                return acc

            def lagged_rows(init: list[V]) -> list[V]:
                """Staged rows with the lagged exchange (dsl.exchange): each step sends its
                row's sums to the cluster, then takes the previous row's sums and finishes
                that row (x_hat and dy * w once, for its dx and its dw/db terms) from its raw
                x and dy, carried a step in registers. The exchange's latency is spent on a
                row's work instead of a wait. Returns the partials.

                Before the first row the "previous" one is a group past the end (`walk.count`):
                nothing is awaited for it, its stores are off (RowTile.valid) and its terms add
                nothing (x and dy zero, rstd 0), so every step runs the same code."""
                arrays = [(x_ptr, p.x_dtype, x_rows), (dy_ptr, p.dtype)]
                staging = RowStage(k, cfg, arrays, plan.stage)
                lag = k.exchange.lagged(2 if p.center else 1)
                n_acc, n_stats = len(init), 2 if p.center else 1
                raw_zero = [const(0.0, vector_type(d, cfg.vec)) for d in (p.x_dtype, p.dtype)]

                def finish(acc: list[V], g: V, phase: V, carried: list[V]) -> list[V]:
                    """Row group g, sent with `phase` a step ago (`carried`: its raw x and dy,
                    mean and rstd): its sums, dx and dw/db terms; returns the partials."""
                    t = RowTile(k, cfg, rows, row_group=g)
                    x, dy = carried[:n], carried[n : 2 * n]
                    stats = (carried[2 * n] if p.center else None, carried[2 * n + 1])
                    row_sums = t.receive_sum(lag, phase, when=g < walk.count)
                    x_hat, wdy = terms(x, dy, weight(t), stats, rewidened)
                    write_dx(t, x_hat, wdy, row_sums, stats[1])
                    return add_partials(t, dy, x_hat, acc)

                def body(g: V, phase: V, carried: list[V], staged) -> list[V]:
                    acc = carried[:n_acc]
                    saved = carried[n_acc : n_acc + n_stats]  # this group's stats, as fetched
                    previous, previous_phase = carried[n_acc + n_stats : n_acc + n_stats + 2]
                    before = carried[n_acc + n_stats + 2 :]
                    t = RowTile(k, cfg, rows, row_group=g)
                    x, dy = staged.values
                    mean = saved[1] if p.center else const(0.0)
                    stats = (mean if p.center else None, select(t.valid, saved[0], 0.0))
                    row_state = sums(*terms(x, dy, weight(t), stats, widen))
                    staged.release()  # the next copies first (H200: 93% of copy against 89%)
                    following = saved_stats(RowTile(k, cfg, rows, row_group=g + stride))
                    t.send_sum(lag, *row_state, phase=phase)
                    acc = finish(acc, previous, previous_phase, before)
                    return acc + following + [g, phase] + x + dy + [mean, stats[1]]

                # No group before the first: one past the end, with zero rows and rstd.
                none = [walk.count, const(0, "i32")]
                raw = [v for v in raw_zero for _ in range(n)]
                start = init + saved_stats(home) + none + raw + [const(0.0)] * 2
                out = staging.loop(walk, start, body, ahead)
                last, last_phase = out[n_acc + n_stats : n_acc + n_stats + 2]
                return finish(out[:n_acc], last, last_phase, out[n_acc + n_stats + 2 :])

            def process(g: V, phase: V | None, acc: list[V], fetched: list[V], staged=None):
                """One row group. `staged` (a Staged): x and dy came from a RowStage, which is
                released once they are read."""
                acc = list(acc)
                t = RowTile(k, cfg, rows, row_group=g)
                x, dy, rstd = fetched[:n], fetched[n : 2 * n], fetched[2 * n]
                # A row past M (last group) has rstd 0: it adds nothing to dw, stores nothing.
                stats = (fetched[2 * n + 1] if p.center else None, select(t.valid, rstd, 0.0))
                w = weight(t)
                row_state = sums(*terms(x, dy, w, stats, widen))
                if staged is not None:
                    staged.release()

                def accumulate(x_hat: list[V]) -> None:
                    """This row's dw/db terms: they do not need the row sums."""
                    acc[:] = add_partials(t, dy, x_hat, acc)

                if C > 1:
                    # Split over a cluster: x_hat and the accumulation fill the wait for the
                    # other blocks at the cluster barrier.
                    done = []

                    def meanwhile() -> None:
                        done.extend(terms(x, dy, w, stats, rewidened))
                        accumulate(done[0])

                    row_sums = t.sum(*row_state, reused=True, phase=phase, meanwhile=meanwhile)
                    write_dx(t, *done, row_sums, stats[1])
                else:  # one block: dx first, so fewer values stay live across the barrier
                    row_sums = t.sum(*row_state, reused=True)
                    x_hat, wdy = terms(x, dy, w, stats, rewidened)
                    write_dx(t, x_hat, wdy, row_sums, stats[1])
                    accumulate(x_hat)
                return acc

            init = [] if shared_partials else [zero_vec] * (n * n_partials)
            if plan.stage and exchange == "lagged":
                acc = lagged_rows(init)
            elif plan.stage:
                # The next row group's x and dy are copied into shared memory while this one
                # is worked on (no registers held for them).
                # The stats of the next group are carried in registers, like the staged rows.
                arrays = [(x_ptr, p.x_dtype, x_rows), (dy_ptr, p.dtype)]
                staging = RowStage(k, cfg, arrays, plan.stage)

                def body(g: V, phase: V | None, carried: list[V], staged) -> list[V]:
                    acc, stats = carried[: len(init)], carried[len(init) :]
                    x, dy = staged.values
                    following = saved_stats(RowTile(k, cfg, rows, row_group=g + stride))
                    return process(g, phase, acc, x + dy + stats, staged) + following

                acc = staging.loop(walk, init + saved_stats(home), body, ahead)[: len(init)]
            elif plan.prefetch:
                # Software pipelining: the next row's loads are issued before this row's sum
                # and barrier, so they are in flight while the block reduces and stores.
                def body(g: V, phase: V | None, carried: list[V]) -> list[V]:
                    acc, current = carried[: len(init)], carried[len(init) :]
                    upcoming = fetch(g + stride)
                    return process(g, phase, acc, current) + upcoming

                acc = row_loop(init + fetch(first_group), body)[: len(init)]
            else:
                acc = row_loop(init, lambda g, phase, a: process(g, phase, a, fetch(g)))
            if shared_partials:
                per_partial = [[get(j, i) for i in range(n)] for j in range(n_partials)]
            else:
                per_partial = [acc[j * n : (j + 1) * n] for j in range(n_partials)]
            home.store_block_partials(partials, slot, per_partial)
        else:
            # A chunked row adds into its workspace row as it goes: one row a block (the plan
            # sees to it), or the block's rows would race on the slot they share.
            assert cfg.rows_per_block == 1, "chunked backward rows take one row a block"
            chunks = const(cfg.chunks, "i64")  # over this block's slice
            one, zero = const(1, "i64"), const(0, "i64")

            def chunked(fn) -> None:
                loop(zero, chunks, one, [], lambda c, _: fn(c * cfg.span) or [])

            for ptr in partials:
                chunked(
                    lambda s, ptr=ptr: home.store_row(ptr, slot, [zero_vec] * cfg.iters, "f32", s)
                )

            def body(g: V, phase: V | None, _: list[V]) -> list[V]:
                t, stats = row_stats(g)

                def accumulate(c: V, acc: list[V]) -> list[V]:
                    x, dy, w = loads(t, c * cfg.span)
                    return [
                        a + s
                        for a, s in zip(acc, sums(*terms(x, dy, w, stats, widen)), strict=True)
                    ]

                init = [const(0.0)] * (2 if p.center else 1)
                row_sums = t.sum(
                    *loop(zero, chunks, one, init, accumulate), reused=True, phase=phase
                )

                def finish(start: V) -> None:
                    x, dy, w = loads(t, start)
                    x_hat, wdy = terms(x, dy, w, stats, widen)
                    write_dx(t, x_hat, wdy, row_sums, stats[1], start)
                    for ptr, add_row in zip(partials, row_terms(t, dy, x_hat), strict=True):
                        old = t.load_row(ptr, slot, "f32", start)
                        summed = [add_row(i, v) for i, v in enumerate(old)]
                        t.store_row(ptr, slot, summed, "f32", start)

                chunked(finish)
                return []

            row_loop([], body)
        k.meta.update(rows_per_block=cfg.rows_per_block, grid="persistent", cluster=C)
    return k
