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

COLUMN_VECTORS = 8  # vectors of columns per block
ROW_LANES = 32  # threads that split the rows of one column vector: R is ~1000, N can be small
UNROLL = 4  # independent loads in flight per thread


def build_column_sum_module(N: int, out_dtype: str, target: Target) -> Kernel:
    """Launch arguments: partial (fp32 [R, N]), out ([N] of `out_dtype`), R."""
    vec = 4 if N % 4 == 0 else 1
    block = COLUMN_VECTORS * ROW_LANES
    with Kernel("column_sum", target, block) as k:
        partial, out, rows = k.ptr("partial"), k.ptr("out"), k.i64("R")
        tid = k.thread_id()
        column_vector, lane = tid % COLUMN_VECTORS, tid / COLUMN_VECTORS
        col = (k.block_id() * COLUMN_VECTORS + column_vector) * vec
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
            values = [row_value(r0 + u * ROW_LANES) for u in range(UNROLL)]
            total = acc[0]
            for v in values:  # ascending row order within this lane
                total = total + v
            return [total]

        (acc,) = loop(lane, rows, const(ROW_LANES * UNROLL, "i64"), [zero], step)
        slots = k.shared(block * vec)
        store(acc, get_llvm_ptr(slots, tid * vec, "f32"))
        k.barrier()

        def combine() -> None:
            total = load(get_llvm_ptr(slots, column_vector * vec, "f32"), "f32", vec)
            for other in range(1, ROW_LANES):
                offset = (column_vector + other * COLUMN_VECTORS) * vec
                total = total + load(get_llvm_ptr(slots, offset, "f32"), "f32", vec)
            store(cast(total, out_dtype), get_llvm_ptr(out, col, out_dtype), aligned=vec > 1)

        if_then((lane < 1) & in_range, combine)
        k.meta.update(columns_per_block=COLUMN_VECTORS * vec, grid="columns")
    return k
