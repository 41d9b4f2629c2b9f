"""Column sums of a [R, N] fp32 workspace, in a fixed order: the second pass of every
deterministic parameter gradient (dweight, dbias).

    out[j] = cast(sum(partial[r, j] for r in range(R)), out_dtype)

The backward kernels run a persistent grid whose blocks each write one fp32 row of partial
sums; this kernel adds those rows. Every thread sums a fixed subset of rows in ascending order
and the subsets are combined in lane order, so the result is bitwise identical from run to
run (no atomics). Bytes: read R * N * 4 (mostly from L2), write N elements.
"""

from __future__ import annotations

from ..dsl import Kernel, V, const, get_llvm_ptr, if_else, if_then, load, loop, store
from ..dsl.values import cast, vector_type
from ..targets import Target

BLOCK = 256
UNROLL = 4  # independent loads in flight per thread
LONG_ROWS = 8192  # from here on the backward's grid leaves few partial rows (R <= 264)


def row_lanes(N: int) -> int:
    """Threads that split the rows of one column vector. Short rows leave ~1000 partial rows
    over few columns: 32 lanes. Long rows leave few (30 at N = 65536 on an H200) over many
    columns: 8 lanes, so a block covers 4x the columns and its final combine reads 8 slots,
    not 32 (the 32-lane form took ~7 us at N = 65536, 6% of LayerNorm's backward)."""
    return 32 if N < LONG_ROWS else 8


def build_column_sum_module(N: int, out_dtype: str, target: Target, planes: int = 1) -> Kernel:
    """Launch arguments: partial (fp32 [planes, R, N]), out ([N] of `out_dtype`), then with
    two planes out1 (the second plane's sums), R. Grid: planes * ceil(N / columns_per_block).

    Two planes (LayerNorm's dw and db) take one launch instead of two: at N = 65536 each
    launch costs about as much again in fixed overhead as its 8 MB of partials."""
    if planes not in (1, 2):
        raise ValueError(f"planes must be 1 or 2, not {planes}")
    vec = 4 if N % 4 == 0 else 1
    lanes = row_lanes(N)
    column_vectors = BLOCK // lanes  # vectors of columns per block
    block = BLOCK
    blocks_per_plane = -(-N // (column_vectors * vec))
    with Kernel("column_sum", target, block) as k:
        base, outs = k.ptr("partial"), [k.ptr("out")]
        if planes == 2:
            outs.append(k.ptr("out1"))
        rows = k.i64("R")
        tid = k.thread_id()
        column_vector, lane = tid % column_vectors, tid / column_vectors
        plane = k.block_id() / blocks_per_plane if planes > 1 else const(0, "i64")
        block_in_plane = k.block_id() % blocks_per_plane if planes > 1 else k.block_id()
        partial = get_llvm_ptr(base, plane * rows * N, "f32") if planes > 1 else base
        col = (block_in_plane * column_vectors + column_vector) * vec
        in_range = col < N
        zero = const(0.0, vector_type("f32", vec) if vec > 1 else "f32")

        def row_value(r: V) -> V:
            ok = (r < rows) & in_range
            return if_else(
                ok,
                lambda: load(get_llvm_ptr(partial, r * N + col, "f32"), "f32", vec),
                lambda: zero,
            )

        def step(r0: V, acc: list[V]) -> list[V]:
            values = [row_value(r0 + u * lanes) for u in range(UNROLL)]
            total = acc[0]
            for v in values:  # ascending row order within this lane
                total = total + v
            return [total]

        (acc,) = loop(lane, rows, const(lanes * UNROLL, "i64"), [zero], step)
        slots = k.shared(block * vec)
        store(acc, get_llvm_ptr(slots, tid * vec, "f32"))
        k.barrier()

        def combine() -> None:
            total = load(get_llvm_ptr(slots, column_vector * vec, "f32"), "f32", vec)
            for other in range(1, lanes):
                offset = (column_vector + other * column_vectors) * vec
                total = total + load(get_llvm_ptr(slots, offset, "f32"), "f32", vec)
            value = cast(total, out_dtype)
            if planes == 1:
                store(value, get_llvm_ptr(outs[0], col, out_dtype), aligned=vec > 1)
                return
            for mine, out in zip((plane < 1, plane > 0), outs, strict=True):
                ptr = get_llvm_ptr(out, col, out_dtype)
                if_then(mine, lambda v=value, q=ptr: store(v, q, aligned=vec > 1))

        if_then((lane < 1) & in_range, combine)
        k.meta.update(columns_per_block=column_vectors * vec, grid="columns", planes=planes)
    return k
