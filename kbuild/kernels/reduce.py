"""Column sums in a fixed order: the second pass of every deterministic parameter gradient
(a norm's dweight and dbias, from the backward's fp32 partial rows), and a linear layer's
bias gradient (both passes: dout's row chunks into partial rows, then those rows).

    out[j] = cast(sum(partial[r, j] for r in range(R)), out_dtype)

The backward kernels run a persistent grid whose blocks each write one fp32 row of partial
sums; this kernel adds those rows. Every thread sums a fixed subset of rows in ascending order
and the subsets are combined in a fixed tree, so the result is bitwise identical from run to
run (no atomics). Bytes: read R * N * 4 (mostly from L2), write N elements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..registry import DTYPE, ROWS, WIDE, WIDTH, Arg, Param, kernel, vectorize
from ..targets import Target

if TYPE_CHECKING:
    from ..dsl import Kernel, V


BLOCK = 256
UNROLL = 4  # independent loads in flight per thread
THREADS = 1 << 17  # threads of a column sum over all columns (~1000 per SM on an H200)


def row_lanes(N: int) -> int:
    """Threads that split the rows of one column vector: as many as keep ~THREADS threads
    over the N / 4 column vectors, from 8 up to half a block, so a warp reads at least two
    column vectors (32 bytes, a whole sector) of each row. A backward leaves one partial row
    per resident block: ~1000-1300 rows at short N (128 lanes), 132-264 at N = 8192-16384
    (32-64 lanes), 30 at 65536 (8 lanes). H200, device time of the column sum in the
    backward chain: 32 lanes at N = 64 (2 blocks, 528 rows a thread) took 36 us, a third of
    the RMSNorm backward; 256 lanes 2.2 us, but 16 of each 32-byte sector read at N = 1024
    (LayerNorm 6.2 us, RMSNorm 4.0); 128 lanes 2.2 / 4.6 / 3.0 us."""
    lanes = THREADS // max(1, N // 4)
    return max(8, min(BLOCK // 2, 1 << (lanes.bit_length() - 1) if lanes else 1))


def _sum_columns(
    k: Kernel,
    src: V,
    dtype: str,
    vec: int,
    N: int,
    lanes: int,
    row_begin: V,
    row_end: V,
    first_vector: V,
    finish: Callable[[V, V], None],
) -> None:
    """The one column reduction: thread (column vector c, lane l) of a block adds rows
    row_begin + l, + lanes, ... < row_end of the `vec` columns at vector first_vector + c of
    a row-major [*, N] `dtype` array, in ascending row order (UNROLL loads in flight, fp32
    sums); then the lanes' sums are added in a fixed tree through shared memory and lane 0 of
    each column vector in range calls finish(the fp32 sums, the first column) to store them.
    So every bit of the result depends only on the launch shape, never on timing."""
    from ..dsl import const, get_llvm_ptr, if_else, if_then, load, loop, store, to_f32
    from ..dsl.values import vector_type

    if lanes & (lanes - 1) or k.block % lanes:
        raise ValueError(f"lanes must be a power of two dividing the block, not {lanes}")
    column_vectors = k.block // lanes
    tid = k.thread_id()
    column_vector, lane = tid % column_vectors, tid / column_vectors
    col = (first_vector + column_vector) * vec
    in_range = col < N
    acc_type = vector_type("f32", vec) if vec > 1 else "f32"
    zero = const(0.0, acc_type)

    def row_value(r: V) -> V:
        ok = (r < row_end) & in_range
        return if_else(
            ok,
            lambda: to_f32(load(get_llvm_ptr(src, r * N + col, dtype), dtype, vec)),
            lambda: zero,
        )

    def step(r0: V, acc: list[V]) -> list[V]:
        values = [row_value(r0 + u * lanes) for u in range(UNROLL)]
        total = acc[0]
        for v in values:  # ascending row order within this lane
            total = total + v
        return [total]

    (acc,) = loop(row_begin + lane, row_end, const(lanes * UNROLL, "i64"), [zero], step)
    slots = k.shared(k.block * vec)

    def slot(thread: V) -> V:
        return get_llvm_ptr(slots, thread * vec, "f32")

    store(acc, slot(tid))
    k.barrier()
    half = lanes // 2
    while half:  # a fixed tree over the lanes: lane l adds lane l + half's sum

        def fold(half: int = half) -> None:
            other = load(slot(tid + half * column_vectors), "f32", vec)
            store(load(slot(tid), "f32", vec) + other, slot(tid))

        if_then(lane < half, fold)
        k.barrier()
        half //= 2
    if_then((lane < 1) & in_range, lambda: finish(load(slot(tid), "f32", vec), col))


def build_column_sum_module(N: int, out_dtype: str, target: Target, planes: int = 1) -> Kernel:
    """Launch arguments: partial (fp32 [planes, R, N]), out ([N] of `out_dtype`), then with
    two planes out1 (the second plane's sums), R. Grid: planes * ceil(N / columns_per_block).

    Two planes (LayerNorm's dw and db) take one launch instead of two: at N = 65536 each
    launch costs about as much again in fixed overhead as its 8 MB of partials."""
    from ..dsl import Kernel, const, get_llvm_ptr, if_then, store
    from ..dsl.values import cast

    if planes not in (1, 2):
        raise ValueError(f"planes must be 1 or 2, not {planes}")
    vec = 4 if N % 4 == 0 else 1
    lanes = row_lanes(N)
    column_vectors = BLOCK // lanes  # vectors of columns per block
    blocks_per_plane = -(-N // (column_vectors * vec))
    with Kernel("column_sum", target, BLOCK) as k:
        base, outs = k.ptr("partial"), [k.ptr("out")]
        if planes == 2:
            outs.append(k.ptr("out1"))
        rows = k.i64("R")
        plane = k.block_id() / blocks_per_plane if planes > 1 else const(0, "i64")
        block_in_plane = k.block_id() % blocks_per_plane if planes > 1 else k.block_id()
        partial = get_llvm_ptr(base, plane * rows * N, "f32") if planes > 1 else base

        def finish(total: V, col: V) -> None:
            value = cast(total, out_dtype)
            if planes == 1:
                store(value, get_llvm_ptr(outs[0], col, out_dtype), aligned=vec > 1)
                return
            for mine, out in zip((plane < 1, plane > 0), outs, strict=True):
                ptr = get_llvm_ptr(out, col, out_dtype)
                if_then(mine, lambda v=value, q=ptr: store(v, q, aligned=vec > 1))

        first_vector = block_in_plane * column_vectors
        _sum_columns(k, partial, "f32", vec, N, lanes, const(0, "i64"), rows, first_vector, finish)
        k.meta.update(columns_per_block=column_vectors * vec, grid="columns", planes=planes)
    return k


BIAS_LANES = 8  # threads splitting one chunk's rows: a block covers 32 column vectors


def build_bias_grad_module(OC: int, dtype: str, target: Target, vectorize: bool = True) -> Kernel:
    """The first pass of dbias[o] = sum over rows of dout[:, o] (a linear layer's bias
    gradient; dout is [M, OC] in `dtype`): block (chunk c, column block j) adds rows
    [c * rows_per_chunk, min(M, (c + 1) * rows_per_chunk)) of its columns into fp32
    partial[c, :]. The column-sum kernel then adds the chunks' rows into dbias in the bias
    dtype (same reduction, same fixed order), so dbias is bitwise the same on every run of
    one shape on one device. Bytes: read M * OC once; the partials are chunks * OC * 4 (L2).

    Launch arguments: dout, partial (fp32 [chunks, OC]), M, rows_per_chunk.
    Grid: chunks * ceil(OC / columns_per_block). `vectorize`: 16-byte loads (OC a multiple
    of 16 / element size, 16-byte aligned dout)."""
    from ..dsl import Kernel, element_bytes, get_llvm_ptr, minimum, store

    vec = 16 // element_bytes(dtype) if vectorize else 1
    column_vectors = BLOCK // BIAS_LANES
    blocks_per_chunk = -(-OC // (column_vectors * vec))
    with Kernel("bias_grad", target, BLOCK) as k:
        dout, partial = k.ptr("dout"), k.ptr("partial")
        rows, per_chunk = k.i64("M"), k.i64("rows_per_chunk")
        chunk = k.block_id() / blocks_per_chunk
        first = chunk * per_chunk
        end = minimum(first + per_chunk, rows)

        def finish(total: V, col: V) -> None:
            store(total, get_llvm_ptr(partial, chunk * OC + col, "f32"))

        _sum_columns(
            k, dout, dtype, vec, OC, BIAS_LANES, first, end,
            (k.block_id() % blocks_per_chunk) * column_vectors, finish,
        )  # fmt: skip
        k.meta.update(columns_per_block=column_vectors * vec, grid="chunks")
    return k


COLUMN_SUM = kernel(
    "column_sum",
    # One-plane specs predate `planes`: keyed without it, so warmed caches keep hitting.
    params=(
        WIDTH,
        Param("out_dtype", "dtype"),
        Param("planes", "int", 1, keyed=False, bounds=(1, 2)),
    ),
    args=(
        Arg("partial"),
        Arg("out"),
        Arg("out1", when=lambda p: p.get("planes", 1) == 2),
        Arg("R", "i64"),
    ),
)(build_column_sum_module)


BIAS_GRAD = kernel(
    "bias_grad",
    params=(Param("OC", "int", bounds=WIDE), DTYPE, vectorize("dtype")),
    args=(Arg("dout"), Arg("partial"), ROWS, Arg("rows_per_chunk", "i64")),
)(build_bias_grad_module)
