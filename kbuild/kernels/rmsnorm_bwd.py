"""RMSNorm backward, plain and for the fused residual add.

Reference, for one row with the saved rstd (fp32 math):

    x_hat = x * rstd
    c1    = sum(x_hat * dy * w) / N
    dx    = (dy * w - x_hat * c1) * rstd              (+ d_residual_out in the fused form)
    dw    = sum over rows of dy * x_hat               (deterministic, see reduce.py)

In the fused form x is residual_out (the normalised input, perhaps fp32) and, since
added = x + residual, dx is also dresidual: it is written once and returned for both.

Bytes that must move: read x and dy, write dx (3 * M * N elements; the fused form also reads
d_residual_out). dw costs one fp32 row per block of a persistent grid, summed by a second
small kernel in a fixed order: never atomics, so dw is bitwise reproducible.

Persistent grid: each block walks row groups g = block, block + grid, ... and keeps its
dw partial in registers (the thread sees the same columns in every row). Rows too long for
registers are walked in chunks, twice, with the block's dw partial row read and written in
the workspace instead (it stays in L2).
"""

from __future__ import annotations

from ..dsl import Kernel, V, const, hsum, loop, select
from ..dsl.values import vector_type
from ..targets import Target
from .config import FEWEST_ITERS_FIRST, choose_row_config
from .kernels_common import RowTile, rewiden_all, widen, wider

# fp32 words of row data a thread may hold at <= 512 threads: x, dy and w packed, plus the
# fp32 dw partial of each element.
BACKWARD_ELEMS = 64


def build_rmsnorm_bwd_module(
    N: int,
    dtype: str,
    weight_dtype: str | None,
    compute_dw: bool,
    target: Target,
    vectorize: bool = True,
    threads_per_row: int | None = None,
) -> Kernel:
    """dx (and dw partials) for y = rmsnorm(x) * w with x, dy, dx of `dtype`.

    Launch arguments: x, [weight], dy, rstd, dx, [dw_partial], M. Grid: persistent.
    """
    return _build(
        N, dtype, dtype, weight_dtype, False, compute_dw, target, vectorize, threads_per_row
    )


def build_fused_add_rmsnorm_bwd_module(
    N: int,
    dtype: str,
    weight_dtype: str | None,
    residual_dtype: str,
    has_dresidual_out: bool,
    compute_dw: bool,
    target: Target,
    vectorize: bool = True,
    threads_per_row: int | None = None,
) -> Kernel:
    """Gradient of (y, residual_out) = fused_add_rmsnorm(x, residual) w.r.t. the sum.

    Launch arguments: residual_out, [weight], dy, rstd, [dresidual_out], dx, [dw_partial], M.
    dx (of `dtype`) is both dx and dresidual.
    """
    return _build(
        N,
        dtype,
        residual_dtype,
        weight_dtype,
        has_dresidual_out,
        compute_dw,
        target,
        vectorize,
        threads_per_row,
    )


def _build(
    N, dtype, x_dtype, weight_dtype, has_dres, compute_dw, target, vectorize, threads_per_row
) -> Kernel:
    io = wider(dtype, x_dtype)
    cfg = choose_row_config(
        N,
        io,
        target.warp_size,
        vectorize,
        BACKWARD_ELEMS,
        threads_per_row,
        words_per_elem=(3.0 if io == "f32" else 2.0)
        if compute_dw
        else (3.0 if io == "f32" else 1.5),
        iters_preference=FEWEST_ITERS_FIRST,
    )
    name = "fused_add_rmsnorm_bwd" if has_dres or x_dtype != dtype else "rmsnorm_bwd"
    # Exact register-resident rows: ask for >= 1024 resident threads per SM (64 registers
    # each), enough loads in flight. Predicated and chunked rows would spill under that cap.
    min_blocks = max(1, 1024 // cfg.block) if cfg.exact else None
    with Kernel(name, target, cfg.block, min_blocks_per_sm=min_blocks) as k:
        x_ptr = k.ptr("x")
        w_ptr = k.ptr("weight") if weight_dtype else None
        dy_ptr, rstd_ptr = k.ptr("dy"), k.ptr("rstd")
        dres_ptr = k.ptr("dresidual_out") if has_dres else None
        dx_ptr = k.ptr("dx")
        partial_ptr = k.ptr("dw_partial") if compute_dw and w_ptr is not None else None
        rows = k.i64("M")
        home = RowTile(k, cfg, rows, row_group=k.block_id())  # this thread's columns
        slot = k.block_id() * cfg.rows_per_block + home.row_in_block  # its workspace row
        groups = (rows + (cfg.rows_per_block - 1)) / cfg.rows_per_block
        zero_vec = const(0.0, vector_type("f32", cfg.vec) if cfg.vec > 1 else "f32")

        def loads(t: RowTile, start: V | int = 0):
            """Raw x, dy and w of one (chunk of a) row."""
            w = None if w_ptr is None else t.load_param(w_ptr, weight_dtype, start)
            return t.load(x_ptr, x_dtype, start), t.load(dy_ptr, dtype, start), w

        def terms(x, dy, w, rstd, widen_fn):
            """x_hat and dy * w in fp32. Called twice per row (before and after the row sum)
            with different widenings, so only the packed raw row stays live across the sum."""
            x_hat = [v * rstd for v in widen_fn(x)]
            wdy = widen_fn(dy)
            if w is not None:
                wdy = [d * wv for d, wv in zip(wdy, widen_fn(w), strict=True)]
            return x_hat, wdy

        def dot(x_hat: list[V], wdy: list[V]) -> V:
            total = const(0.0)
            for a, b in zip(x_hat, wdy, strict=True):
                total = total + hsum(a * b)
            return total

        def write_dx(t, x_hat, wdy, c1, rstd, start: V | int = 0) -> None:
            dx = [(g - xh * c1) * rstd for g, xh in zip(wdy, x_hat, strict=True)]
            if dres_ptr is not None:
                dres = widen(t.load(dres_ptr, x_dtype, start))
                dx = [a + b for a, b in zip(dx, dres, strict=True)]
            t.store(dx_ptr, dx, dtype, start)

        def dw_terms(dy_raw: list[V], x_hat: list[V]) -> list[V]:
            return [d * xh for d, xh in zip(rewiden_all(dy_raw), x_hat, strict=True)]

        def row_stats(g: V) -> tuple[RowTile, V]:
            t = RowTile(k, cfg, rows, row_group=g)
            # A row past M (last group) computes on row M - 1 with rstd 0: no dw, no store.
            return t, select(t.valid, t.load_row_scalar(rstd_ptr), 0.0)

        if not cfg.chunked:
            # w is read again for every row (from L1): held across the loop, the compiler
            # hoists its fp32 widening out of it and the block loses half its occupancy.

            def body(g: V, acc: list[V]) -> list[V]:
                t, rstd = row_stats(g)
                x, dy, w = loads(t)
                (total,) = t.sum(dot(*terms(x, dy, w, rstd, widen)), reused=True)
                x_hat, wdy = terms(x, dy, w, rstd, rewiden_all)
                write_dx(t, x_hat, wdy, total * (1.0 / N), rstd)
                if partial_ptr is None:
                    return acc
                return [a + d for a, d in zip(acc, dw_terms(dy, x_hat), strict=True)]

            init = [zero_vec] * cfg.iters if partial_ptr is not None else []
            acc = loop(k.block_id(), groups, k.grid_size(), init, body)
            if partial_ptr is not None:
                home.store_row(partial_ptr, slot, acc, "f32")
        else:
            chunks, one, zero = const(-(-N // cfg.span), "i64"), const(1, "i64"), const(0, "i64")

            def chunked(fn) -> None:
                loop(zero, chunks, one, [], lambda c, _: fn(c * cfg.span) or [])

            if partial_ptr is not None:
                chunked(
                    lambda s: home.store_row(partial_ptr, slot, [zero_vec] * cfg.iters, "f32", s)
                )

            def body(g: V, _: list[V]) -> list[V]:
                t, rstd = row_stats(g)

                def accumulate(c: V, acc: list[V]) -> list[V]:
                    x, dy, w = loads(t, c * cfg.span)
                    return [acc[0] + dot(*terms(x, dy, w, rstd, widen))]

                (partial,) = loop(zero, chunks, one, [const(0.0)], accumulate)
                (total,) = t.sum(partial, reused=True)
                c1 = total * (1.0 / N)

                def finish(start: V) -> None:
                    x, dy, w = loads(t, start)
                    x_hat, wdy = terms(x, dy, w, rstd, widen)
                    write_dx(t, x_hat, wdy, c1, rstd, start)
                    if partial_ptr is not None:
                        old = t.load_row(partial_ptr, slot, "f32", start)
                        new = [a + d for a, d in zip(old, dw_terms(dy, x_hat), strict=True)]
                        t.store_row(partial_ptr, slot, new, "f32", start)

                chunked(finish)
                return []

            loop(k.block_id(), groups, k.grid_size(), [], body)
        k.meta.update(rows_per_block=cfg.rows_per_block, grid="persistent")
    return k
