"""The backward kernel shared by RMSNorm, fused add + RMSNorm and LayerNorm.

With the saved per-row statistics (fp32) and wdy = dy * w:

    RMSNorm:    x_hat = x * rstd
                dx = (wdy - x_hat * mean(wdy * x_hat)) * rstd
    LayerNorm:  x_hat = (x - mean) * rstd
                dx = (wdy - mean(wdy) - x_hat * mean(wdy * x_hat)) * rstd
    fused add:  dx += d_residual_out        (x is residual_out; dx is also dresidual)
    dw = sum over rows of dy * x_hat,  db = sum over rows of dy

Bytes that must move: read x and dy, write dx (3 * M * N elements; + d_residual_out).

Persistent grid: block b walks row groups b, b + grid, ... and keeps its dw/db partials in
fp32, in registers or in its shared memory (a thread sees the same columns in every row),
then writes one fp32 row per partial to a [grid * rows_per_block, N] workspace that
reduce.py sums in a fixed order: dw and db are bitwise reproducible, no atomics. (With a
cluster, read "cluster" for "block": clusters walk the row groups and each writes one
workspace row, its blocks their slices of it.) The next
row's loads are issued before the current row's sum where registers allow (prefetch).

Rows too long for one block are split over a cluster of blocks where the target has them:
the persistent loop runs over clusters, each block holds its slice of the row, and the row
sums are merged through distributed shared memory (mbarrier exchanges, or a cluster barrier
for the fused backward's staged rows: dsl.cluster_reduce). Elsewhere such rows are walked in
chunks, twice, with the partial rows read and written in the workspace instead (it stays in
L2). The fused backward's longest rows and LayerNorm's rows split over 512-thread blocks copy
the next row's x and dy into shared memory ahead (`RowStage`) instead of prefetching into
registers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dsl import Kernel, V, const, hsum, loop, opaque, select
from ..dsl.trace import Trace
from ..dsl.values import vector_type
from ..dtypes import ELEMENT_BYTES
from ..targets import Target
from .config import BACKWARD_SHAPES, RMS_BACKWARD_SHAPES, choose_row_config
from .kernels_common import (
    SHARED_SLACK,
    RowGroups,
    RowStage,
    RowTile,
    ThreadShared,
    can_stage,
    cluster_exchange,
    rewiden_all,
    widen,
    wider,
)

BACKWARD_ELEMS = 64  # fp32 words of row data a thread may hold at <= 512 threads
# Largest shared-memory partials, leaving room for the row sums' slots: 128 KB, or less where
# the target allows less per block (99 KB on sm_86/89/120, 64 KB of LDS on most AMD GPUs).
SHARED_PARTIALS_MAX = 128 * 1024


@dataclass(frozen=True)
class NormBackward:
    name: str
    N: int
    dtype: str  # dy, dx
    x_dtype: str  # the normalised input (residual_out in the fused form)
    weight_dtype: str | None
    center: bool  # LayerNorm: subtract the mean
    has_dres: bool  # fused form with a gradient flowing into residual_out
    compute_dw: bool
    compute_db: bool


def build_norm_backward(
    p: NormBackward,
    target: Target,
    vectorize: bool,
    *,
    threads_per_row: int | None = None,
    prefetch: bool | None = None,
    cluster: int | None = None,
    shared_partials: bool | None = None,
    prefetch_l2: bool | None = None,
    stage: bool | None = None,
    reload: bool | None = None,
    blocks_per_sm: int | None = None,
    cluster_sync: str | None = None,
    rows_per_block: int | None = None,
    resident_params: str | None = None,
    trace: bool = False,
) -> Kernel:
    """Launch arguments: x, [weight], dy, [mean], rstd, [dresidual_out], dx, [dw_partial],
    [db_partial], M. Grid: persistent (at most the device's resident clusters, times the
    cluster size).

    Launch-shape overrides for tuning (the backward builders pass them through; None = the
    chooser's pick): `threads_per_row`; `prefetch`, loading the next row while the current
    one is reduced (register-resident rows); `cluster` (blocks per row, 1 = none);
    `shared_partials`, the dw/db partials in shared memory instead of registers;
    `prefetch_l2`, one thread per block asking the next row's x and dy into L2 while the
    current row is worked on (Hopper on; no registers); `stage`, x and dy of the next
    `stage` rows copied into shared memory while the current row is worked on (`RowStage`;
    True = 1; Ampere on); `reload` (staged only: x and dy are read again from shared memory
    after the row sums instead of being held in registers across them, and their buffer is
    refilled only at the end of the row); `blocks_per_sm`, the resident blocks per
    multiprocessor the register allocation must allow; `cluster_sync`, how a cluster's blocks
    exchange row sums ("barrier" or "mbarrier", see dsl.cluster_reduce); `rows_per_block`,
    for rows split over a cluster, the rows each block holds (they share its reductions and
    exchanges); `resident_params="registers"`, each thread's columns of w read once and held
    raw in registers for the whole kernel instead of read for every row (rows held in
    registers); `trace`, a diagnostic build: per-row timestamps into an extra `trace`
    argument (dsl.trace).
    """
    if resident_params not in (None, False, "registers"):
        raise ValueError(
            f"resident_params must be None, False or 'registers', not {resident_params!r}"
        )
    io = wider(p.dtype, p.x_dtype)
    n_partials = int(p.compute_dw) + int(p.compute_db)
    plain_rms = not p.center and not p.has_dres

    def config(partial_words: float, blocks_per_row: int | None):
        return choose_row_config(
            p.N,
            io,
            target.warp_size,
            vectorize,
            BACKWARD_ELEMS,
            threads_per_row,
            words_per_elem=(2.0 if io == "f32" else 1.0) + partial_words,
            iters_preference=tuple(range(1, 17)),
            shapes=RMS_BACKWARD_SHAPES if plain_rms else BACKWARD_SHAPES,
            max_cluster=target.max_cluster,
            cluster=blocks_per_row,
            rows_per_block=rows_per_block,
        )

    cfg = config(float(n_partials), cluster)  # partials in registers
    if shared_partials is None:
        # Measured on an H200 (bench/results/h200_tune_shared_partials.json): shared partials
        # win for the fused backward (97-103% of copy against 91-100%) and for every row split
        # over a cluster (LayerNorm N = 65536: 65% against 50%); a LayerNorm row that fits
        # one block runs best with register partials and prefetch, uncapped (88%).
        shared_partials = p.has_dres or cfg.cluster > 1
    if shared_partials and n_partials:  # a shape for the row alone, partials off registers
        alone = config(0.0, cfg.cluster)
        size = n_partials * alone.slice * alone.rows_per_block * 4
        most = min(SHARED_PARTIALS_MAX, target.shared_bytes_per_block - SHARED_SLACK)
        shared_partials = not alone.chunked and size <= most
        cfg = alone if shared_partials else cfg
    shared_partials = bool(shared_partials and n_partials)
    # Exact register-resident rows: ask for >= 1024 resident threads per SM (64 registers
    # each), enough loads in flight. Predicated and chunked rows would spill under that cap.
    # (LayerNorm with both partials in registers spills 144 bytes capped: it runs uncapped.)
    capped = cfg.exact and (not p.center or shared_partials or not n_partials)
    min_blocks = max(1, 1024 // cfg.block) if capped else None
    if blocks_per_sm is not None:
        min_blocks = blocks_per_sm
    if prefetch is None:
        # The prefetched row doubles the raw row's registers: under the 64-register cap that
        # spills from two vectors per thread on (measured on an H200: 61-64% against 91-95%).
        prefetch = min_blocks is None or cfg.iters == 1
    if prefetch_l2 is None:
        prefetch_l2 = False
    if stage is None:
        # Measured on an H200 (h200_tune_stage_backward.json, h200_tune_exchange_staging.json):
        # staging lifts the fused backward's longest rows (N = 16384: 97% -> 99% of copy;
        # 65536: 90% -> 95%) and LayerNorm rows split over a cluster of 512-thread blocks
        # (N = 65536, with mbarrier exchanges: 70% -> 78%); it costs the plain RMSNorm
        # backward and LayerNorm's smaller blocks 1-5%.
        partial_bytes = n_partials * cfg.slice * cfg.rows_per_block * 4 if shared_partials else 0
        long_fused = p.has_dres and (cfg.cluster > 1 or cfg.block >= 1024)
        long_center = p.center and cfg.cluster > 1 and cfg.block >= 512
        stage = (long_fused or long_center) and can_stage(
            target, cfg, [p.x_dtype, p.dtype], partial_bytes
        )
    stage = int(stage)
    if stage and not (target.async_copy and cfg.exact):
        raise ValueError(f"stage needs rows held in registers and asynchronous copies ({target})")
    prefetch = prefetch and not stage
    if resident_params is None:
        # Rows split over a cluster: w is read for every row, and each row's sums wait for it
        # (from L2 where the partials and staged rows leave L1 too little room). Held raw in
        # registers instead (16-bit w: 8 words a thread at 512 threads). H200, bf16, N =
        # 65536, kernel alone: LayerNorm 75% -> 79% of copy, RMSNorm 82% -> 86%
        # (h200_tune_resident.json). bf16 rows only: they stay packed until used
        # (dsl.rewiden); f16 rows already spill at the cap and would spill more. Not the fused
        # form with a residual gradient: it gains 94% -> 96% but spills 4 bytes, and the
        # bench kernels stay spill-free (tests/test_kernels_ir.py).
        # Measured on 512-thread blocks; the 1024-thread blocks of some longer rows are not
        # (RMSNorm at N = 262144 spills more with it).
        w16 = p.weight_dtype is not None and ELEMENT_BYTES[p.weight_dtype] == 2
        split = cfg.cluster > 1 and cfg.block <= 512 and not cfg.chunked
        held = w16 and io == "bf16" and split and not p.has_dres
        resident_params = "registers" if held else None
    if resident_params and cfg.chunked:
        raise ValueError("resident_params needs rows held in registers (this row is chunked)")
    if reload and not stage:
        raise ValueError("reload needs staged rows (stage)")
    if prefetch_l2 and not (target.l2_prefetch and cfg.vec * ELEMENT_BYTES[io] == 16):
        raise ValueError(f"prefetch_l2 needs 16-byte vectors on Hopper or later, not {target}")
    C = cfg.cluster
    # Measured on an H200 (bf16; h200_tune_mbarrier*.json, h200_tune_exchange_staging.json):
    # row sums through mbarriers lift RMSNorm N = 65536 from 75% to 84% of copy, LayerNorm
    # 16384 from 79% to 82-83% and, with staged rows, LayerNorm 65536 from 70% to 78%; the
    # fused backward's staged rows keep the cluster barrier (95% against 88%).
    keeps_barrier = bool(stage) and p.has_dres
    exchange = cluster_exchange(
        cluster_sync, cfg, "barrier" if keeps_barrier else "mbarrier", target.warp_size
    )
    with Kernel(
        p.name, target, cfg.block, min_blocks_per_sm=min_blocks, cluster=C, exchange=exchange
    ) as k:
        if trace:
            k.trace = Trace(k)
        x_ptr = k.ptr("x")
        w_ptr = k.ptr("weight") if p.weight_dtype else None
        dy_ptr = k.ptr("dy")
        mean_ptr = k.ptr("mean") if p.center else None
        rstd_ptr = k.ptr("rstd")
        dres_ptr = k.ptr("dresidual_out") if p.has_dres else None
        dx_ptr = k.ptr("dx")
        dw_ptr = k.ptr("dw_partial") if p.compute_dw else None
        db_ptr = k.ptr("db_partial") if p.compute_db else None
        partials = [ptr for ptr in (dw_ptr, db_ptr) if ptr is not None]
        rows = k.i64("M")
        walk = RowGroups(k, cfg, rows)
        first_group, stride = walk.first, walk.stride
        home = RowTile(k, cfg, rows, row_group=first_group)  # this thread's columns
        slot = first_group * cfg.rows_per_block + home.row_in_block  # its workspace row
        zero_vec = const(0.0, vector_type("f32", cfg.vec) if cfg.vec > 1 else "f32")
        inv_n = 1.0 / p.N
        # Arrays whose next rows are asked into L2 a step ahead (`prefetch_l2`).
        ahead = [(x_ptr, p.x_dtype), (dy_ptr, p.dtype)] if prefetch_l2 else []

        def row_loop(init: list[V], body) -> list[V]:
            return walk.loop(init, body, ahead)

        def loads(t: RowTile, start: V | int = 0):
            """Raw x, dy and w of one (chunk of a) row. w is read again for every row (from
            L1): held across the row loop, its fp32 widening gets hoisted out of the loop and
            the block loses half its occupancy."""
            w = None if w_ptr is None else t.load_param(w_ptr, p.weight_dtype, start)
            return t.load(x_ptr, p.x_dtype, start), t.load(dy_ptr, p.dtype, start), w

        def terms(x, dy, w, stats, widen_fn):
            """x_hat and dy * w in fp32. Called twice per row (before and after the row sum)
            with different widenings, so only the packed raw row stays live across the sum."""
            mean, rstd = stats
            xs = widen_fn(x)
            x_hat = [(v - mean) * rstd for v in xs] if p.center else [v * rstd for v in xs]
            wdy = widen_fn(dy)
            if w is not None:
                wdy = [d * wv for d, wv in zip(wdy, widen_fn(w), strict=True)]
            return x_hat, wdy

        def sums(x_hat: list[V], wdy: list[V]) -> list[V]:
            """Per-thread partials of sum(wdy * x_hat) (and sum(wdy) for LayerNorm)."""
            dot, total = const(0.0), const(0.0)
            for a, b in zip(x_hat, wdy, strict=True):
                dot = dot + hsum(a * b)
                total = total + hsum(b)
            return [dot, total] if p.center else [dot]

        def write_dx(t, x_hat, wdy, row_sums, rstd, start: V | int = 0) -> None:
            c2 = row_sums[0] * inv_n
            dx = [g - xh * c2 for g, xh in zip(wdy, x_hat, strict=True)]
            if p.center:
                c1 = row_sums[1] * inv_n
                dx = [d - c1 for d in dx]
            dx = [d * rstd for d in dx]
            if dres_ptr is not None:
                dres = widen(t.load(dres_ptr, p.x_dtype, start))
                dx = [a + b for a, b in zip(dx, dres, strict=True)]
            t.store(dx_ptr, dx, p.dtype, start)

        def partial_terms(t: RowTile, dy_raw: list[V], x_hat: list[V]) -> list[list[V]]:
            """This row's contribution to each partial (dw: dy * x_hat; db: dy)."""
            dy = rewiden_all(dy_raw)
            out = []
            if dw_ptr is not None:
                out.append([d * xh for d, xh in zip(dy, x_hat, strict=True)])
            if db_ptr is not None:  # a row past M contributes nothing (x_hat is 0 there)
                out.append([select(t.valid, d, 0.0) for d in dy])
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
            if resident_params and w_ptr is not None:
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
                return t.load(x_ptr, p.x_dtype) + t.load(dy_ptr, p.dtype) + stats

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

            def process(g: V, phase: V | None, acc: list[V], fetched: list[V], staged=None):
                """One row group. `staged` (a Staged): x and dy came from a RowStage, which is
                released once they are read (with `reload`, once the row is done)."""
                acc = list(acc)
                t = RowTile(k, cfg, rows, row_group=g)
                x, dy, rstd = fetched[:n], fetched[n : 2 * n], fetched[2 * n]
                # A row past M (last group) has rstd 0: it adds nothing to dw, stores nothing.
                stats = (fetched[2 * n + 1] if p.center else None, select(t.valid, rstd, 0.0))
                w = weight(t)
                row_state = sums(*terms(x, dy, w, stats, widen))
                if staged is not None and not reload:
                    staged.release()

                def again() -> None:
                    """With `reload`, x and dy for the second half of the row, read anew."""
                    nonlocal x, dy
                    if reload:
                        x, dy = staged.reload()

                def accumulate(x_hat: list[V]) -> None:
                    """This row's dw/db terms: they do not need the row sums."""
                    new = [v for terms_ in partial_terms(t, dy, x_hat) for v in terms_]
                    if shared_partials:
                        for index, d in enumerate(new):
                            put(*divmod(index, n), get(*divmod(index, n)) + d)
                    else:
                        acc[:] = [a + d for a, d in zip(acc, new, strict=True)]

                if C > 1:
                    # Split over a cluster: x_hat and the accumulation fill the wait for the
                    # other blocks at the cluster barrier.
                    done = []

                    def meanwhile() -> None:
                        again()
                        done.extend(terms(x, dy, w, stats, rewiden_all))
                        accumulate(done[0])

                    row_sums = t.sum(*row_state, reused=True, phase=phase, meanwhile=meanwhile)
                    write_dx(t, *done, row_sums, stats[1])
                else:  # one block: dx first, so fewer values stay live across the barrier
                    row_sums = t.sum(*row_state, reused=True)
                    again()
                    x_hat, wdy = terms(x, dy, w, stats, rewiden_all)
                    write_dx(t, x_hat, wdy, row_sums, stats[1])
                    accumulate(x_hat)
                if reload:
                    staged.release()
                return acc

            init = [] if shared_partials else [zero_vec] * (n * n_partials)
            if stage:
                # The next row group's x and dy are copied into shared memory while this one
                # is worked on (no registers held for them).
                # The stats of the next group are carried in registers, like the staged rows.
                arrays = [(x_ptr, p.x_dtype), (dy_ptr, p.dtype)]
                staging = RowStage(k, cfg, arrays, int(stage))

                def body(g: V, phase: V | None, carried: list[V], staged) -> list[V]:
                    acc, stats = carried[: len(init)], carried[len(init) :]
                    x, dy = staged.values
                    following = saved_stats(RowTile(k, cfg, rows, row_group=g + stride))
                    return process(g, phase, acc, x + dy + stats, staged) + following

                acc = staging.loop(walk, init + saved_stats(home), body, ahead)[: len(init)]
            elif prefetch:
                # Software pipelining: the next row's loads are issued before this row's sum
                # and barrier, so they are in flight while the block reduces and stores.
                def body(g: V, phase: V | None, carried: list[V]) -> list[V]:
                    acc, current = carried[: len(init)], carried[len(init) :]
                    upcoming = fetch(g + stride)
                    return process(g, phase, acc, current) + upcoming

                acc = row_loop(init + fetch(first_group), body)[: len(init)]
            else:
                acc = row_loop(init, lambda g, phase, a: process(g, phase, a, fetch(g)))
            for j, ptr in enumerate(partials):
                if shared_partials:
                    values = [get(j, i) for i in range(n)]
                else:
                    values = acc[j * n : (j + 1) * n]
                home.store_row(ptr, slot, values, "f32")
        else:
            chunks = const(-(-cfg.slice // cfg.span), "i64")  # over this block's slice
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
                    for ptr, new in zip(partials, partial_terms(t, dy, x_hat), strict=True):
                        old = t.load_row(ptr, slot, "f32", start)
                        summed = [a + d for a, d in zip(old, new, strict=True)]
                        t.store_row(ptr, slot, summed, "f32", start)

                chunked(finish)
                return []

            row_loop([], body)
        k.meta.update(rows_per_block=cfg.rows_per_block, grid="persistent", cluster=C)
    return k
