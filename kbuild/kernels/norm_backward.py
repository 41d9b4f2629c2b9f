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
fp32 registers (a thread sees the same columns in every row), then writes one fp32 row per
partial to a [grid * rows_per_block, N] workspace that reduce.py sums in a fixed order: dw and
db are bitwise reproducible, no atomics. Rows too long for registers are walked in chunks,
twice, with the partial rows read and written in the workspace instead (it stays in L2).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dsl import Kernel, V, const, hsum, loop, select
from ..dsl.values import vector_type
from ..targets import Target
from .config import BACKWARD_SHAPES, choose_row_config
from .kernels_common import RowTile, rewiden_all, widen, wider

BACKWARD_ELEMS = 64  # fp32 words of row data a thread may hold at <= 512 threads


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
    p: NormBackward, target: Target, vectorize: bool, threads_per_row: int | None
) -> Kernel:
    """Launch arguments: x, [weight], dy, [mean], rstd, [dresidual_out], dx, [dw_partial],
    [db_partial], M. Grid: persistent (at most the device's resident blocks)."""
    N = p.N
    io = wider(p.dtype, p.x_dtype)
    partial_words = (1.0 if p.compute_dw else 0.0) + (1.0 if p.compute_db else 0.0)
    cfg = choose_row_config(
        N,
        io,
        target.warp_size,
        vectorize,
        BACKWARD_ELEMS,
        threads_per_row,
        words_per_elem=(2.0 if io == "f32" else 1.0) + partial_words,
        iters_preference=tuple(range(1, 17)),
        shapes=BACKWARD_SHAPES,
    )
    # Exact register-resident rows: ask for >= 1024 resident threads per SM (64 registers
    # each), enough loads in flight. Predicated and chunked rows would spill under that cap.
    # (LayerNorm holds a second partial and the mean: capped, it spills; it runs uncapped.)
    min_blocks = max(1, 1024 // cfg.block) if cfg.exact and not p.center else None
    with Kernel(p.name, target, cfg.block, min_blocks_per_sm=min_blocks) as k:
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
        home = RowTile(k, cfg, rows, row_group=k.block_id())  # this thread's columns
        slot = k.block_id() * cfg.rows_per_block + home.row_in_block  # its workspace row
        groups = (rows + (cfg.rows_per_block - 1)) / cfg.rows_per_block
        zero_vec = const(0.0, vector_type("f32", cfg.vec) if cfg.vec > 1 else "f32")
        inv_n = 1.0 / N

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

            def body(g: V, acc: list[V]) -> list[V]:
                t, stats = row_stats(g)
                x, dy, w = loads(t)
                row_sums = t.sum(*sums(*terms(x, dy, w, stats, widen)), reused=True)
                x_hat, wdy = terms(x, dy, w, stats, rewiden_all)
                write_dx(t, x_hat, wdy, row_sums, stats[1])
                new = [v for terms_ in partial_terms(t, dy, x_hat) for v in terms_]
                return [a + d for a, d in zip(acc, new, strict=True)]

            init = [zero_vec] * (cfg.iters * len(partials))
            acc = loop(k.block_id(), groups, k.grid_size(), init, body)
            for i, ptr in enumerate(partials):
                home.store_row(ptr, slot, acc[i * cfg.iters : (i + 1) * cfg.iters], "f32")
        else:
            chunks, one, zero = const(-(-N // cfg.span), "i64"), const(1, "i64"), const(0, "i64")

            def chunked(fn) -> None:
                loop(zero, chunks, one, [], lambda c, _: fn(c * cfg.span) or [])

            for ptr in partials:
                chunked(
                    lambda s, ptr=ptr: home.store_row(ptr, slot, [zero_vec] * cfg.iters, "f32", s)
                )

            def body(g: V, _: list[V]) -> list[V]:
                t, stats = row_stats(g)

                def accumulate(c: V, acc: list[V]) -> list[V]:
                    x, dy, w = loads(t, c * cfg.span)
                    return [
                        a + s
                        for a, s in zip(acc, sums(*terms(x, dy, w, stats, widen)), strict=True)
                    ]

                init = [const(0.0)] * (2 if p.center else 1)
                row_sums = t.sum(*loop(zero, chunks, one, init, accumulate), reused=True)

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

            loop(k.block_id(), groups, k.grid_size(), [], body)
        k.meta.update(rows_per_block=cfg.rows_per_block, grid="persistent")
    return k
