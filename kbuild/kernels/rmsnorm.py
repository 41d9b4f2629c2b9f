"""RMSNorm forward.

Reference, for one row x of N elements (fp32 accumulation whatever the I/O dtype):

    rstd = 1 / sqrt(sum(x[j]^2 for j in range(N)) / N + eps)
    y[j] = x[j] * rstd * w[j]            (w omitted when there is no weight)

Bytes that must move: read x (M*N), write y (M*N), plus the weight once and, with
`store_rstd`, one fp32 per row, which the backward pass needs.

One kernel, one row per `threads_per_row` threads; M is a runtime argument so a single binary
serves every batch size; N, dtypes, eps and the flags are compile-time constants.
"""

from __future__ import annotations

from ..dsl import Kernel, V, const, hsum, loop, rsqrt
from ..targets import Target
from .config import choose_row_config
from .kernels_common import RowTile, widen


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

    Arguments at launch: x, [weight], y, [rstd], M. `vectorize=False` gives the kernel for
    tensors whose addresses are not 16-byte aligned; `threads_per_row` overrides the launch
    shape the config chooser picks (for tuning).
    """
    cfg = choose_row_config(N, dtype, target.warp_size, vectorize, threads_per_row=threads_per_row)
    with Kernel("rmsnorm_fwd", target, cfg.block) as k:
        x_ptr = k.ptr("x")
        w_ptr = k.ptr("weight") if weight_dtype else None
        y_ptr = k.ptr("y")
        rstd_ptr = k.ptr("rstd") if store_rstd else None
        rows = k.i64("M")
        t = RowTile(k, cfg, rows)

        def normalize(x: list[V], rstd: V, start: V | int = 0) -> None:
            y = [v * rstd for v in x]
            if w_ptr is not None:
                w = widen(t.load_param(w_ptr, weight_dtype, start))
                y = [yi * wi for yi, wi in zip(y, w, strict=True)]
            t.store(y_ptr, y, dtype, start)

        if not cfg.chunked:
            x = t.load(x_ptr, dtype)  # held raw; widened where used (see dsl.to_f32)
            (sum_sq,) = t.sum(_sum_squares(widen(x)))
            rstd = rsqrt(sum_sq * (1.0 / N) + eps)
            normalize(widen(x), rstd)
        else:
            chunks, step = const(-(-N // cfg.span), "i64"), const(1, "i64")
            zero = const(0, "i64")

            def accumulate(c: V, acc: list[V]) -> list[V]:
                return [acc[0] + _sum_squares(widen(t.load(x_ptr, dtype, c * cfg.span)))]

            (partial,) = loop(zero, chunks, step, [const(0.0)], accumulate)
            (sum_sq,) = t.sum(partial)
            rstd = rsqrt(sum_sq * (1.0 / N) + eps)

            def write(c: V, _: list[V]) -> list[V]:
                normalize(widen(t.load(x_ptr, dtype, c * cfg.span)), rstd, c * cfg.span)
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
