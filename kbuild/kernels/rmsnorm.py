"""RMSNorm forward, plain and with a fused residual add.

Reference, for one row of N elements (fp32 accumulation whatever the I/O dtype):

    rmsnorm:           rstd = 1 / sqrt(sum(x[j]^2) / N + eps)
                       y[j] = x[j] * rstd * w[j]                 (w omitted without a weight)
    fused add:         s[j] = round_to_residual_dtype(x[j] + residual[j])   -> residual_out
                       y = rmsnorm(s)        (from exactly the stored s, so the backward pass,
                                              which reads residual_out, sees the same input)

Bytes that must move: rmsnorm reads x and writes y (2 * M * N elements); the fused form reads
x and residual and writes residual_out and y (4 * M * N). The weight is read once per block,
and with `store_rstd` one fp32 per row is written for the backward pass.

One kernel, `threads_per_row` threads per row; M is a runtime argument so one binary serves
every batch size; N, dtypes, eps and the flags are compile-time constants.
"""

from __future__ import annotations

from ..dsl import Kernel, V, cast, const, hsum, loop, rsqrt
from ..targets import Target
from .config import choose_row_config
from .kernels_common import RowTile, rewiden_all, widen, wider


def build_rmsnorm_module(
    N: int,
    dtype: str,
    weight_dtype: str | None,
    store_rstd: bool,
    eps: float,
    target: Target,
    vectorize: bool = True,
    threads_per_row: int | None = None,
) -> Kernel:
    """RMSNorm forward over rows of N `dtype` elements; weight of `weight_dtype` or none.

    Launch arguments: x, [weight], y, [rstd], M. `vectorize=False` gives the kernel for
    tensors whose addresses are not 16-byte aligned; `threads_per_row` overrides the launch
    shape the config chooser picks (for tuning).
    """
    return _build(N, dtype, weight_dtype, None, store_rstd, eps, target, vectorize, threads_per_row)


def build_fused_add_rmsnorm_module(
    N: int,
    dtype: str,
    weight_dtype: str | None,
    residual_dtype: str,
    store_rstd: bool,
    eps: float,
    target: Target,
    vectorize: bool = True,
    threads_per_row: int | None = None,
) -> Kernel:
    """residual_out = x + residual (stored as `residual_dtype`: x's dtype, or "f32" to keep
    the residual stream in fp32), y = rmsnorm(residual_out).

    Launch arguments: x, residual, [weight], y, residual_out, [rstd], M.
    """
    return _build(
        N, dtype, weight_dtype, residual_dtype, store_rstd, eps, target, vectorize, threads_per_row
    )


def _build(
    N, dtype, weight_dtype, residual_dtype, store_rstd, eps, target, vectorize, threads_per_row
) -> Kernel:
    fused = residual_dtype is not None
    row_dtype = residual_dtype if fused else dtype  # what the statistics are taken over
    # Register words per row element at the peak: the row (packed when bf16; the fused form
    # has x and residual in flight) plus the weight, whose loads the compiler issues together.
    row_words = 1.0 if fused or row_dtype != "bf16" else 0.5
    weight_words = {None: 0.0, "f32": 1.0}.get(weight_dtype, 0.5)
    cfg = choose_row_config(
        N,
        wider(dtype, row_dtype),
        target.warp_size,
        vectorize,
        threads_per_row=threads_per_row,
        words_per_elem=row_words + weight_words,
    )
    with Kernel("fused_add_rmsnorm_fwd" if fused else "rmsnorm_fwd", target, cfg.block) as k:
        x_ptr = k.ptr("x")
        res_ptr = k.ptr("residual") if fused else None
        w_ptr = k.ptr("weight") if weight_dtype else None
        y_ptr = k.ptr("y")
        res_out_ptr = k.ptr("residual_out") if fused else None
        rstd_ptr = k.ptr("rstd") if store_rstd else None
        rows = k.i64("M")
        t = RowTile(k, cfg, rows)

        def row_input(start: V | int = 0) -> list[V]:
            """The row the statistics are taken over, raw in `row_dtype`."""
            x = t.load(x_ptr, dtype, start)
            if not fused:
                return x
            residual = widen(t.load(res_ptr, dtype, start))
            s = [cast(a + b, row_dtype) for a, b in zip(widen(x), residual, strict=True)]
            t.store(res_out_ptr, s, row_dtype, start)
            return s

        def normalize(x: list[V], rstd: V, start: V | int = 0) -> None:
            y = [v * rstd for v in rewiden_all(x)]
            if w_ptr is not None:
                w = widen(t.load_param(w_ptr, weight_dtype, start))
                y = [yi * wi for yi, wi in zip(y, w, strict=True)]
            t.store(y_ptr, y, dtype, start)

        if not cfg.chunked:
            x = row_input()  # held raw, widened at each use (see dsl.rewiden)
            (sum_sq,) = t.sum(_sum_squares(widen(x)))
            rstd = rsqrt(sum_sq * (1.0 / N) + eps)
            normalize(x, rstd)
        else:
            # Too long for registers: one pass for the statistics, one to normalise, the
            # second read served mostly from L2. The fused form reads residual_out back.
            chunks, step = const(-(-N // cfg.span), "i64"), const(1, "i64")
            zero = const(0, "i64")

            def accumulate(c: V, acc: list[V]) -> list[V]:
                return [acc[0] + _sum_squares(widen(row_input(c * cfg.span)))]

            (partial,) = loop(zero, chunks, step, [const(0.0)], accumulate)
            (sum_sq,) = t.sum(partial)
            rstd = rsqrt(sum_sq * (1.0 / N) + eps)
            source, source_dtype = (res_out_ptr, row_dtype) if fused else (x_ptr, dtype)

            def write(c: V, _: list[V]) -> list[V]:
                normalize(t.load(source, source_dtype, c * cfg.span), rstd, c * cfg.span)
                return []

            loop(zero, chunks, step, [], write)

        if rstd_ptr is not None:
            t.store_row_scalar(rstd_ptr, rstd)
        k.meta.update(rows_per_block=cfg.rows_per_block, grid="rows")
    return k


def _sum_squares(x: list[V]) -> V:
    total = hsum(x[0] * x[0])
    for v in x[1:]:
        total = total + hsum(v * v)
    return total
