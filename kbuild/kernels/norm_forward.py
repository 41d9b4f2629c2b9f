"""The forward kernel shared by RMSNorm, fused add + RMSNorm and LayerNorm.

For one row of N elements, fp32 math whatever the I/O dtype:

    RMSNorm:    rstd = 1 / sqrt(sum(x^2) / N + eps),            y = x * rstd * w
    LayerNorm:  mean = sum(x) / N
                rstd = 1 / sqrt(sum((x - mean)^2) / N + eps),   y = (x - mean) * rstd * w + b
    fused add:  s = round_to_residual_dtype(x + residual) is stored as residual_out and
                normalised in place of x (from exactly the stored values)

The LayerNorm variance is never taken as E[x^2] - mean^2, which loses all precision for rows
with a large mean: each thread centres its own elements on their mean (count, mean, M2), and
the row merges those states pairwise (Chan et al.), one reduction and one barrier. The
moments of fp32 rows are of x minus the row's first element, so the merges round at the
row's spread, not at its mean; the mean is rounded once at its own size, as x itself is. Chunked
rows (too long for registers) merge chunk by chunk, then take a second pass (mostly from
L2) to normalise.

One row per `threads_per_row` threads; M is a runtime argument; N, dtypes, eps and the flags
are compile-time constants. Stats (fp32, one per row) are written when asked for backward.

Grid: one block (cluster) per row group; or, for LayerNorm rows that take a whole 512-thread
block or a cluster, persistent: each block walks its row groups and copies the next group's
input into shared memory (`RowStage`, `cp.async`) while it reduces and writes the current one,
so its loads are always in flight (H200, bf16: N = 16384 85% -> 92% of copy, 65536 68% -> 87%).
Rows split over a cluster exchange their sums through mbarriers (dsl.cluster_reduce) and
hold their 16-bit w and b in registers for the whole loop (`resident_params`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dsl import (
    Kernel,
    V,
    cast,
    const,
    get_llvm_ptr,
    hsum,
    load,
    loop,
    opaque,
    rsqrt,
    select,
    to_f32,
)
from ..dsl.trace import Trace
from ..dtypes import ELEMENT_BYTES
from ..targets import Target
from .config import choose_row_config
from .kernels_common import (
    RowGroups,
    RowStage,
    RowTile,
    Staged,
    ThreadShared,
    can_stage,
    cluster_exchange,
    rewiden_all,
    widen,
    wider,
)


@dataclass(frozen=True)
class NormForward:
    name: str
    N: int
    dtype: str  # x, y
    weight_dtype: str | None
    bias_dtype: str | None
    residual_dtype: str | None  # fused add: the dtype residual_out is stored in
    center: bool  # LayerNorm
    store_stats: bool  # rstd (and mean, for LayerNorm)
    eps: float


def build_norm_forward(
    p: NormForward,
    target: Target,
    vectorize: bool,
    *,
    threads_per_row: int | None = None,
    cluster: int | None = None,
    persistent: bool | None = None,
    prefetch_l2: bool | None = None,
    resident_params: bool | str | None = None,
    stream_x: bool | None = None,
    stage: bool | None = None,
    reload: bool | None = None,
    blocks_per_sm: int | None = None,
    cluster_sync: str | None = None,
    rows_per_block: int | None = None,
    trace: bool = False,
) -> Kernel:
    """Launch arguments: x, [residual], [weight], [bias], y, [residual_out], [mean], [rstd], M.
    Grid: one block per row group, times the cluster size; or, `persistent`, as many blocks
    (clusters) as the device holds at once, each walking row groups.

    Launch-shape overrides for tuning (the forward builders pass them through; None = the
    config chooser's pick): `threads_per_row`, `cluster` (blocks per row, 1 = none),
    `persistent`, `prefetch_l2` (persistent only: one thread per block asks the next row
    group's input into L2 while the current one is worked on; Hopper on),
    `resident_params` (persistent only: each thread keeps its columns of w and b for the
    whole kernel instead of reading them for every row: True or "shared" in shared memory,
    "registers" in registers, raw), `stream_x` (x read
    without allocating in L1, which then keeps w and b; NVIDIA), `stage` (persistent only:
    the input of the next `stage` row groups is copied into shared memory while the current
    one is worked on, `RowStage`; True = 1; Ampere on), `reload` (staged only: the row is
    read again from shared memory to normalise it instead of being held in registers across
    the reduction, and its buffer is refilled only after that), `blocks_per_sm` (the
    resident blocks per multiprocessor the register allocation must allow), `cluster_sync`
    (how a cluster's blocks exchange row sums: "barrier" or "mbarrier", see
    dsl.cluster_reduce), `rows_per_block` (rows split over a cluster: rows each block holds,
    which then share its reductions and exchanges), `trace` (a diagnostic build: per-row
    timestamps into an extra `trace` argument, dsl.trace)."""
    N, fused = p.N, p.residual_dtype is not None
    row_dtype = p.residual_dtype if fused else p.dtype  # what the statistics are taken over
    # Register words per row element at the peak: the row (packed when bf16; the fused form
    # has x and residual in flight) plus fp32 parameters, whose loads are issued together.
    # LayerNorm widens its packed row at each use too, but its moments cost more: at 0.5 a
    # 65536 bf16 row takes 1024 threads and spills 288 bytes (440 before the one-pass
    # moments: 31% of copy, against 66% chunked). (2-byte weights are left out: counting
    # them pushes RMSNorm N = 65536 bf16 off the register path: 88% against 67% chunked.)
    row_words = 1.0 if fused or row_dtype != "bf16" else 0.625 if p.center else 0.5
    param_words = sum(0.5 for d in (p.weight_dtype, p.bias_dtype) if d == "f32")
    cfg = choose_row_config(
        N,
        wider(p.dtype, row_dtype),
        target.warp_size,
        vectorize,
        threads_per_row=threads_per_row,
        words_per_elem=row_words + param_words,
        max_cluster=target.max_cluster,
        cluster=cluster,
        rows_per_block=rows_per_block,
    )
    # Keep >= 1024 threads resident per SM (64 registers each) where the row needs no
    # predicates; the merge of LayerNorm's moments would otherwise take 72-73 registers and
    # halve the resident blocks at N = 8192-16384.
    min_blocks = max(1, 1024 // cfg.block) if cfg.exact else None
    chosen_stage = stage is None and persistent is None
    if chosen_stage:
        # LayerNorm rows of a whole 512-thread block or split over a cluster: a persistent
        # grid that copies the next row group into shared memory while the current one is
        # reduced and written (H200, bf16: N = 16384 86% -> 90% of copy, 65536 66% -> 82%;
        # bench/results/h200_tune_stage_depth.json). More groups ahead, or the forward of
        # shorter rows (the block finishes its row soon enough), lose 3-11%.
        long_row = cfg.cluster > 1 or cfg.block >= 512
        stage = p.center and not fused and long_row and can_stage(target, cfg, [p.dtype])
        persistent = stage
    params_16 = [d for d in (p.weight_dtype, p.bias_dtype) if d is not None]
    if resident_params is None and chosen_stage and stage and cfg.cluster > 1 and params_16:
        # Rows split over a cluster read w and b slices of 32 KB per block in every row: the
        # 4 blocks on an SM need 128 KB of them, which L1 does not keep next to the staged
        # rows, so the row's normalisation waited on L2 (2 us of a 3.8 us row step, measured
        # with bench/trace_rows.py). Held in registers (16-bit ones), raw, they cost 16 words
        # a parameter, with 3 blocks per SM (H200, bf16, N = 65536, kernel alone: w and b
        # 84% -> 90% of copy, w alone 90% -> 91%; at 4 blocks per SM w and b spill and w
        # alone runs 86-87%: h200_tune_resident.json).
        # Measured on 256-thread blocks; the 512-thread blocks of longer rows would drop to
        # one per SM (unmeasured): those keep reading w and b.
        if all(ELEMENT_BYTES[d] == 2 for d in params_16) and cfg.block <= 256:
            resident_params = "registers"
            min_blocks = 768 // cfg.block
    if blocks_per_sm is not None:
        min_blocks = blocks_per_sm
    persistent = bool(persistent)
    if resident_params not in (None, False, True, "shared", "registers"):
        raise ValueError(
            "resident_params must be None, False, True, 'shared' or 'registers', "
            f"not {resident_params!r}"
        )
    if resident_params and not (persistent and not cfg.chunked):
        raise ValueError("resident_params needs a persistent grid and rows held in registers")
    if stage and not (persistent and target.async_copy):
        raise ValueError(f"stage needs a persistent grid and asynchronous copies ({target})")
    if trace and not persistent:
        raise ValueError("trace times the steps of a persistent grid's row loop")
    if reload and not (stage and not fused):
        raise ValueError("reload needs staged rows (stage) and an unfused forward")
    if prefetch_l2 and not (
        persistent and target.l2_prefetch and cfg.vec * ELEMENT_BYTES[p.dtype] == 16
    ):
        raise ValueError(
            f"prefetch_l2 needs a persistent grid and 16-byte vectors on Hopper or later ({target})"
        )
    # Row sums cross the cluster through mbarriers: no cluster barrier per row, which would
    # also wait for the block's earlier stores to complete (H200, bf16, N = 65536: LayerNorm
    # 80-83% -> 83-86% of copy, fused add + RMSNorm 92% -> 99%; h200_tune_mbarrier*.json,
    # h200_tune_exchange*.json).
    exchange = cluster_exchange(cluster_sync, cfg, "mbarrier", target.warp_size)
    with Kernel(p.name, target, cfg.block, min_blocks, cluster=cfg.cluster, exchange=exchange) as k:
        if trace:
            k.trace = Trace(k)
        x_ptr = k.ptr("x")
        res_ptr = k.ptr("residual") if fused else None
        w_ptr = k.ptr("weight") if p.weight_dtype else None
        b_ptr = k.ptr("bias") if p.bias_dtype else None
        y_ptr = k.ptr("y")
        res_out_ptr = k.ptr("residual_out") if fused else None
        mean_ptr = k.ptr("mean") if p.store_stats and p.center else None
        rstd_ptr = k.ptr("rstd") if p.store_stats else None
        rows = k.i64("M")
        inv_n = 1.0 / N
        walk = RowGroups(k, cfg, rows) if persistent else None
        params = {"weight": (w_ptr, p.weight_dtype), "bias": (b_ptr, p.bias_dtype)}
        # Parameter name -> this thread's columns of it (a thread of a persistent grid sees the
        # same columns in every row): in shared memory, or raw in registers.
        resident: dict[str, ThreadShared | list[V]] = {}
        if resident_params:
            home = RowTile(k, cfg, rows, row_group=walk.first)
            for name, (ptr, dtype) in params.items():
                if ptr is None:
                    continue
                values = home.load_param(ptr, dtype)
                if resident_params == "registers":
                    resident[name] = values
                    continue
                resident[name] = ThreadShared(k, cfg.iters, dtype, cfg.vec)
                for i, v in enumerate(values):
                    resident[name].put(i, v)

        def param(t: RowTile, name: str, start: V | int) -> list[V]:
            """This thread's vectors of w or b, raw."""
            held = resident.get(name)
            if isinstance(held, list):  # widened afresh in each row, not hoisted: see opaque
                return [opaque(v) for v in held]
            if held is not None:
                return [held.get(i) for i in range(cfg.iters)]
            ptr, dtype = params[name]
            return t.load_param(ptr, dtype, start)

        inputs = [(x_ptr, p.dtype)] + ([(res_ptr, p.dtype)] if fused else [])
        staging = RowStage(k, cfg, inputs, int(stage)) if stage else None

        def row(t: RowTile, phase: V | None, staged: Staged | None = None) -> None:
            """One row group: statistics, normalised output, stats. `phase`: see RowGroups.
            `staged`: the row's inputs, from a RowStage (released once read, or with
            `reload` once normalised)."""
            reused = phase is not None or persistent  # the row sums' slots are used again

            def row_input(start: V | int = 0) -> list[V]:
                """The row the statistics are taken over, raw in `row_dtype`."""
                if staged is not None:
                    x = staged.values[0]
                else:
                    x = t.load(x_ptr, p.dtype, start, streaming=bool(stream_x))
                if not fused:
                    return x
                if staged is not None:
                    residual = widen(staged.values[1])
                else:
                    residual = widen(t.load(res_ptr, p.dtype, start))
                s = [cast(a + b, row_dtype) for a, b in zip(widen(x), residual, strict=True)]
                t.store(res_out_ptr, s, row_dtype, start)
                return s

            # fp32 LayerNorm takes its moments of x - shift, shift = the row's first element
            # (one broadcast load): the merges then round at the row's spread, not at its mean
            # (x = 1000 + randn: 2^-24 * 1000 per merge level, which add up to 7x torch's
            # fp32 error). 16-bit inputs carry 2^-8 or 2^-11 of their own, far above any
            # merge rounding, and skip it (it costs 3-5% of bandwidth at N = 8192-16384).
            shifted_moments = p.center and p.dtype == "f32"
            shift = None
            if shifted_moments:
                shift = to_f32(load(get_llvm_ptr(x_ptr, t.row * N, p.dtype), p.dtype))

            def moments(x: list[V], start: V | int = 0) -> list[V]:
                """(count, mean, M2) of this thread's elements of one (chunk of a) row,
                shifted: the mean of its own x - shift, then squares centred on it."""
                inside = t.inside(start)

                def shifted(values: list[V]) -> list[V]:  # x - shift; 0 past the row's end
                    if not shifted_moments:
                        return values  # padding loads as 0
                    out = [v - shift for v in values]
                    return [
                        d if g is None else select(g, d, 0.0)
                        for d, g in zip(out, inside, strict=True)
                    ]

                if all(g is None for g in inside):
                    count = float(len(x) * cfg.vec)  # the same in every thread (dsl.reduce)
                else:
                    count = const(0.0)
                    for g in inside:
                        count = count + (
                            float(cfg.vec) if g is None else select(g, const(float(cfg.vec)), 0.0)
                        )
                local_mean = _sum(shifted(widen(x))) * _reciprocal(count)
                # M2 is insensitive to where exactly it is centred (second order): one
                # rounded centre, one subtraction per element.
                centre = shift + local_mean if shifted_moments else local_mean
                m2 = const(0.0)
                for d, g in zip(rewiden_all(x), inside, strict=True):
                    d = d - centre
                    d = d if g is None else select(g, d, 0.0)
                    m2 = m2 + hsum(d * d)
                return [count, local_mean, m2]

            def normalize(x: list[V], mean: V | None, rstd: V, start: V | int = 0) -> None:
                xs = rewiden_all(x)
                y = [(v - mean) * rstd for v in xs] if mean is not None else [v * rstd for v in xs]
                if w_ptr is not None:
                    w = widen(param(t, "weight", start))
                    y = [yi * wi for yi, wi in zip(y, w, strict=True)]
                if b_ptr is not None:
                    b = widen(param(t, "bias", start))
                    y = [yi + bi for yi, bi in zip(y, b, strict=True)]
                t.store(y_ptr, y, p.dtype, start)

            mean = None
            if not cfg.chunked:
                x = row_input()  # held raw, widened at each use (see dsl.rewiden)
                state = moments(x) if p.center else [_sum_squares(widen(x))]
                if staged is not None and not reload:
                    staged.release()  # x is in registers now: refill the buffer
                if p.center:
                    _, mean, m2 = t.reduce(state, merge_moments, reused, phase)
                    if shifted_moments:
                        mean = shift + mean  # rounded once, at the mean's size, as x is
                else:
                    (m2,) = t.sum(*state, reused=reused, phase=phase)
                rstd = rsqrt(m2 * inv_n + p.eps)
                if reload:
                    x = staged.reload()[0]
                    normalize(x, mean, rstd)
                    staged.release()
                else:
                    normalize(x, mean, rstd)
            else:
                chunks = const(-(-cfg.slice // cfg.span), "i64")  # over this block's slice
                step, zero = const(1, "i64"), const(0, "i64")
                # The first pass makes residual_out; the second reads it back.
                source, source_dtype = (res_out_ptr, row_dtype) if fused else (x_ptr, p.dtype)

                def first(c: V, acc: list[V]) -> list[V]:
                    x = row_input(c * cfg.span)
                    if p.center:
                        return merge_moments(acc, moments(x, c * cfg.span))
                    return [acc[0] + _sum_squares(widen(x))]

                if p.center:
                    # Chunk counts differ when the last chunk is partial: carried as values.
                    zeros = [const(0.0)] * 3
                    state = loop(zero, chunks, step, zeros, first)
                    _, mean, m2 = t.reduce(state, merge_moments, reused, phase)
                    if shifted_moments:
                        mean = shift + mean
                else:
                    (m2,) = t.sum(
                        *loop(zero, chunks, step, [const(0.0)], first), reused=reused, phase=phase
                    )
                rstd = rsqrt(m2 * inv_n + p.eps)

                def write(c: V, _: list[V]) -> list[V]:
                    normalize(t.load(source, source_dtype, c * cfg.span), mean, rstd, c * cfg.span)
                    return []

                loop(zero, chunks, step, [], write)

            if mean_ptr is not None:
                t.store_row_scalar(mean_ptr, mean)
            if rstd_ptr is not None:
                t.store_row_scalar(rstd_ptr, rstd)

        l2_ahead = inputs if prefetch_l2 else []

        def step(g: V, phase: V | None, _: list[V], staged: Staged | None = None) -> list[V]:
            row(RowTile(k, cfg, rows, row_group=g), phase, staged)
            return []

        if staging is not None:
            staging.loop(walk, [], step, l2_ahead)
        elif persistent:
            walk.loop([], step, l2_ahead)
        else:
            row(RowTile(k, cfg, rows), None)
        grid = "persistent" if persistent else "rows"
        k.meta.update(rows_per_block=cfg.rows_per_block, grid=grid, cluster=cfg.cluster)
    return k


def _reciprocal(n: V | float) -> V | float:
    """1 / n, or 0 where n is 0 (a thread or chunk with no elements inside the row)."""
    if not isinstance(n, V):
        return 1.0 / n if n > 0 else 0.0
    return select(n > 0.0, 1.0 / n, 0.0)


def merge_moments(a: list[V], b: list[V]) -> list[V]:
    """Merge two (count, mean, M2) states (Chan et al.): the combined mean, and M2 grown by
    the squared gap between the means. Symmetric bit for bit, as dsl.row_reduce needs."""
    (na, ma, qa), (nb, mb, qb) = a, b
    n = na + nb
    inv = _reciprocal(n)
    gap = mb - ma
    return [n, (na * ma + nb * mb) * inv, qa + qb + gap * gap * (na * nb * inv)]


def _sum(x: list[V]) -> V:
    total = hsum(x[0])
    for v in x[1:]:
        total = total + hsum(v)
    return total


def _sum_squares(x: list[V]) -> V:
    total = hsum(x[0] * x[0])
    for v in x[1:]:
        total = total + hsum(v * v)
    return total
