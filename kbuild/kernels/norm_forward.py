"""The forward kernel shared by RMSNorm, fused add + RMSNorm and LayerNorm.

For one row of N elements, fp32 math whatever the I/O dtype:

    RMSNorm:    rstd = 1 / sqrt(sum(x^2) / N + eps),            y = x * rstd * w
    LayerNorm:  mean = sum(x) / N
                rstd = 1 / sqrt(sum((x - mean)^2) / N + eps),   y = (x - mean) * rstd * w + b
    fused add:  s = round_to_residual_dtype(x + residual) is stored as residual_out and
                normalised in place of x (from exactly the stored values)

The LayerNorm variance is taken over the centred row held in registers (two row sums), never
as E[x^2] - mean^2, which loses all precision for rows with a large mean. Chunked rows (too
long for registers) take three passes over the row instead, the later ones mostly from L2.

One row per `threads_per_row` threads; M is a runtime argument; N, dtypes, eps and the flags
are compile-time constants. Stats (fp32, one per row) are written when asked for backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dsl import Kernel, V, cast, const, hsum, loop, rsqrt, select
from ..targets import Target
from .config import choose_row_config
from .kernels_common import RowTile, rewiden_all, widen, wider


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
    p: NormForward, target: Target, vectorize: bool, threads_per_row: int | None
) -> Kernel:
    """Launch arguments: x, [residual], [weight], [bias], y, [residual_out], [mean], [rstd], M."""
    N, fused = p.N, p.residual_dtype is not None
    row_dtype = p.residual_dtype if fused else p.dtype  # what the statistics are taken over
    # Register words per row element at the peak: the row (packed when bf16; the fused form
    # has x and residual in flight; LayerNorm also its centred row) plus fp32 parameters,
    # whose loads are issued together.
    # (2-byte weights are left out: counting them pushes N = 65536 bf16 off the register
    # path, which measured 88% of copy against 67% chunked, for an 8-byte spill.)
    row_words = 1.0 if fused or p.center or row_dtype != "bf16" else 0.5
    param_words = sum(0.5 for d in (p.weight_dtype, p.bias_dtype) if d == "f32")
    cfg = choose_row_config(
        N,
        wider(p.dtype, row_dtype),
        target.warp_size,
        vectorize,
        threads_per_row=threads_per_row,
        words_per_elem=row_words + param_words,
    )
    with Kernel(p.name, target, cfg.block) as k:
        x_ptr = k.ptr("x")
        res_ptr = k.ptr("residual") if fused else None
        w_ptr = k.ptr("weight") if p.weight_dtype else None
        b_ptr = k.ptr("bias") if p.bias_dtype else None
        y_ptr = k.ptr("y")
        res_out_ptr = k.ptr("residual_out") if fused else None
        mean_ptr = k.ptr("mean") if p.store_stats and p.center else None
        rstd_ptr = k.ptr("rstd") if p.store_stats else None
        rows = k.i64("M")
        t = RowTile(k, cfg, rows)
        inv_n = 1.0 / N

        def row_input(start: V | int = 0) -> list[V]:
            """The row the statistics are taken over, raw in `row_dtype`."""
            x = t.load(x_ptr, p.dtype, start)
            if not fused:
                return x
            residual = widen(t.load(res_ptr, p.dtype, start))
            s = [cast(a + b, row_dtype) for a, b in zip(widen(x), residual, strict=True)]
            t.store(res_out_ptr, s, row_dtype, start)
            return s

        def centred_squares(x: list[V], mean: V, start: V | int = 0) -> V:
            """sum((x - mean)^2) over this thread's elements; padding past N counts 0."""
            total = const(0.0)
            for v, inside in zip(widen(x), t.inside(start), strict=True):
                d = v - mean
                d = d if inside is None else select(inside, d, 0.0)
                total = total + hsum(d * d)
            return total

        def normalize(x: list[V], mean: V | None, rstd: V, start: V | int = 0) -> None:
            xs = rewiden_all(x)
            y = [(v - mean) * rstd for v in xs] if mean is not None else [v * rstd for v in xs]
            if w_ptr is not None:
                w = widen(t.load_param(w_ptr, p.weight_dtype, start))
                y = [yi * wi for yi, wi in zip(y, w, strict=True)]
            if b_ptr is not None:
                b = widen(t.load_param(b_ptr, p.bias_dtype, start))
                y = [yi + bi for yi, bi in zip(y, b, strict=True)]
            t.store(y_ptr, y, p.dtype, start)

        mean = None
        if not cfg.chunked:
            x = row_input()  # held raw, widened at each use (see dsl.rewiden)
            if p.center:
                (total,) = t.sum(_sum(widen(x)))
                mean = total * inv_n
                (sq,) = t.sum(centred_squares(x, mean))
            else:
                (sq,) = t.sum(_sum_squares(widen(x)))
            rstd = rsqrt(sq * inv_n + p.eps)
            normalize(x, mean, rstd)
        else:
            chunks, step, zero = const(-(-N // cfg.span), "i64"), const(1, "i64"), const(0, "i64")
            # The first pass makes residual_out; later passes read it back.
            source, source_dtype = (res_out_ptr, row_dtype) if fused else (x_ptr, p.dtype)

            def chunk(c: V) -> list[V]:
                return t.load(source, source_dtype, c * cfg.span)

            def first(c: V, acc: list[V]) -> list[V]:
                x = widen(row_input(c * cfg.span))
                return [acc[0] + (_sum(x) if p.center else _sum_squares(x))]

            (partial,) = loop(zero, chunks, step, [const(0.0)], first)
            if p.center:
                mean = t.sum(partial)[0] * inv_n

                def second(c: V, acc: list[V]) -> list[V]:
                    return [acc[0] + centred_squares(chunk(c), mean, c * cfg.span)]

                (partial,) = loop(zero, chunks, step, [const(0.0)], second)
            rstd = rsqrt(t.sum(partial)[0] * inv_n + p.eps)

            def write(c: V, _: list[V]) -> list[V]:
                normalize(chunk(c), mean, rstd, c * cfg.span)
                return []

            loop(zero, chunks, step, [], write)

        if mean_ptr is not None:
            t.store_row_scalar(mean_ptr, mean)
        if rstd_ptr is not None:
            t.store_row_scalar(rstd_ptr, rstd)
        k.meta.update(rows_per_block=cfg.rows_per_block, grid="rows")
    return k


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
