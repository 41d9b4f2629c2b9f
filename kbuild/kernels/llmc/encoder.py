"""GPT-2's encoder (token + position embedding), forward and a deterministic backward.

Forward, for every position (b, t) of the M = B * T tokens:

    out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]            (fp32 add, out in wte's dtype)

Bytes: read M ids, M * C of wte rows and M * C of wpe rows (wpe's T rows stay in L2 when
B > 1), write M * C. An id outside [0, V) reads nothing: its row is NaN (visible, never an
out-of-bounds read; the op documents it and checks on request).

Backward, with dout [B, T, C]:

    dwpe[t, :] += sum over b of dout[b, t, :]
    dwte[v, :] += sum over the positions p with tokens[p] == v of dout[p, :]

Both in fp32, in a fixed order, added to the existing gradient (GPT-2 ties wte to the output
projection, whose matmul writes dwte first). dwte needs the positions of each id together:
the op sorts the ids (stable, so equal ids keep ascending positions) and two kernels walk
the sorted order in chunks of CHUNK positions:

1. `encoder_bwd_wte`: block c takes sorted positions [c * CHUNK, (c + 1) * CHUNK). Each run of
   one id inside the chunk is summed in position order. A run wholly inside the chunk is
   added to dwte[v] right there (no other block sees v). A run that crosses the chunk's end
   is one that this block owns: its sum goes to partial[c, 1]. The piece of a run that began
   in an earlier chunk goes to partial[c, 0].
2. `encoder_bwd_wte_merge`: the owner of each crossing run adds partial[c, 1] and the
   following chunks' partial[., 0] in chunk order, then adds the total to dwte[v].

No atomics, no ordering between blocks: dwte and dwpe are the same bits on every run (the
sort is stable, so even the permutation is fixed). A frequent id costs its owner one fp32
row per CHUNK of its positions, not one dout row each (llm.c's buckets serve the same end).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...plan.config import ENCODER_CHUNK, RowConfig
from ...registry import DTYPE, ROWS, WIDE, Arg, Param, kernel, vectorize
from ...targets import Target

if TYPE_CHECKING:
    from ...dsl import Kernel, V


CHUNK = ENCODER_CHUNK  # sorted positions per block of the dwte pass
UNROLL = 4  # positions whose loads are in flight at once in a dwte block
MAX_BLOCK = 256


def columns_layout(C: int, dtype: str, vectorize: bool) -> tuple[int, int, int]:
    """(elements per access, threads per block, column groups per thread) for rows of C:
    one thread per `vec` columns, at most MAX_BLOCK threads, the rest in groups."""
    from ...dsl import element_bytes

    vec = 16 // element_bytes(dtype) if vectorize else 1
    vectors = -(-C // vec)
    block = min(MAX_BLOCK, -(-vectors // 32) * 32)
    return vec, block, -(-vectors // block)


def columns_shape(C: int, dtype: str, vectorize: bool) -> RowConfig:
    """columns_layout as the DSL's row shape: one row a block of `block` threads, each
    thread `groups` vectors of the row."""
    vec, block, groups = columns_layout(C, dtype, vectorize)
    return RowConfig(C, vec, block, 1, groups, chunked=False)


class _Columns:
    """This thread's columns of a C-wide row (dsl.thread_columns of columns_shape: the rows
    are picked by data, token ids and positions, not walked by a RowTile) and fp32 loads and
    stores of a [*, C] array at (row, column)."""

    def __init__(self, k: Kernel, C: int, dtype: str, vectorize: bool):
        from ...dsl import thread_columns

        shape = columns_shape(C, dtype, vectorize)
        self.vec = shape.vec
        self.cols = thread_columns(shape, k.thread_id())
        self.C, self.dtype = C, dtype

    def zero(self) -> V:
        from ...dsl import const
        from ...dsl.values import vector_type

        return const(0.0, vector_type("f32", self.vec) if self.vec > 1 else "f32")

    def load(self, base: V, row: V, col: V, dtype: str | None = None) -> V:
        """Row `row`'s vector at `col` of a [*, C] array, as fp32."""
        from ...dsl import get_llvm_ptr, load, to_f32

        dtype = dtype or self.dtype
        return to_f32(load(get_llvm_ptr(base, row * self.C + col, dtype), dtype, self.vec))

    def store(self, value: V, base: V, row: V, col: V, dtype: str | None = None) -> None:
        from ...dsl import cast, get_llvm_ptr, store

        dtype = dtype or self.dtype
        store(cast(value, dtype), get_llvm_ptr(base, row * self.C + col, dtype))


def build_encoder_fwd_module(
    C: int, dtype: str, index_dtype: str, target: Target, vectorize: bool = True
) -> Kernel:
    """Launch arguments: tokens (M ids of `index_dtype`), wte ([V, C]), wpe ([>= T, C]), out
    ([M, C]), V, T, M; all tensors of `dtype` but the ids. Grid: M blocks (one row each).
    `vectorize`: 16-byte accesses (C a multiple of 16 / element size, aligned tensors)."""
    from ...dsl import Kernel, cast, const, get_llvm_ptr, if_then, load, select

    with Kernel("encoder_fwd", target, columns_layout(C, dtype, vectorize)[1]) as k:
        tokens, wte, wpe, out = (k.ptr(n) for n in ("tokens", "wte", "wpe", "out"))
        vocab, T, _rows = k.i64("V"), k.i64("T"), k.i64("M")
        cols = _Columns(k, C, dtype, vectorize)
        row = k.block_id()
        token = cast(load(get_llvm_ptr(tokens, row, index_dtype), index_dtype), "i64")
        valid = (token >= 0) & (token < vocab)
        safe = select(valid, token, const(0, "i64"))
        t = row % T
        nan = const(float("nan"), cols.zero().type)
        for col in cols.cols:

            def body(col=col) -> None:
                value = cols.load(wte, safe, col) + cols.load(wpe, t, col)
                cols.store(select(valid, value, nan), out, row, col)

            if_then(col < C, body)
        k.meta.update(grid="rows", rows_per_block=1)
    return k


def build_encoder_bwd_wpe_module(
    C: int, dtype: str, target: Target, accumulate: bool = True, vectorize: bool = True
) -> Kernel:
    """dwpe[t, :] (+)= sum over b < B of dout[b * T + t, :], b ascending, fp32.
    Launch arguments: dout ([B * T, C] of `dtype`), dwpe ([>= T, C] of `dtype`), B, T.
    Grid: T blocks. `accumulate`: add to dwpe's values (else overwrite them)."""
    from ...dsl import Kernel, const, if_then, loop

    with Kernel("encoder_bwd_wpe", target, columns_layout(C, dtype, vectorize)[1]) as k:
        dout, dwpe = k.ptr("dout"), k.ptr("dwpe")
        B, T = k.i64("B"), k.i64("T")
        cols = _Columns(k, C, dtype, vectorize)
        t = k.block_id()
        for col in cols.cols:

            def body(col=col) -> None:
                def step(b: V, acc: list[V]) -> list[V]:
                    return [acc[0] + cols.load(dout, b * T + t, col)]

                (acc,) = loop(const(0, "i64"), B, const(1, "i64"), [cols.zero()], step)
                if accumulate:
                    acc = cols.load(dwpe, t, col) + acc
                cols.store(acc, dwpe, t, col)

            if_then(col < C, body)
        k.meta.update(grid="positions")
    return k


def _id_at(ids: V, index_dtype: str, p: V) -> V:
    from ...dsl import cast, get_llvm_ptr, load

    return cast(load(get_llvm_ptr(ids, p, index_dtype), index_dtype), "i64")


class _Chunk:
    """Chunk c of the sorted ids: positions [start, end), its first and last ids, whether
    the first id's run began in an earlier chunk and whether the last id's run goes on past
    `end`. Both passes read a chunk's edges from here."""

    def __init__(self, ids: V, index_dtype: str, c: V, rows: V):
        from ...dsl import eq, minimum, select

        self.start = c * CHUNK
        self.end = minimum(self.start + CHUNK, rows)
        self.first = _id_at(ids, index_dtype, self.start)
        self.last = _id_at(ids, index_dtype, self.end - 1)
        before = _id_at(ids, index_dtype, select(c > 0, self.start - 1, self.start))
        after = _id_at(ids, index_dtype, minimum(self.end, rows - 1))
        self.began_earlier = (c > 0) & eq(before, self.first)
        self.goes_on = (self.end < rows) & eq(after, self.last)


def build_encoder_bwd_wte_module(
    C: int, dtype: str, index_dtype: str, target: Target, vectorize: bool = True
) -> Kernel:
    """Pass 1 of dwte (see the module docstring). Launch arguments: sorted_ids (M ids of
    `index_dtype`, ascending, stable), order (M int64 positions: sorted_ids[i] =
    tokens[order[i]]), dout ([M, C]), dwte ([V, C], added to), partial (fp32 [chunks, 2, C]),
    V, M. Grid: chunks = ceil(M / CHUNK)."""
    from ...dsl import (
        Kernel,
        const,
        eq,
        get_llvm_ptr,
        if_then,
        load,
        loop,
        minimum,
        ne,
        select,
        store,
    )

    with Kernel("encoder_bwd_wte", target, columns_layout(C, dtype, vectorize)[1]) as k:
        ids, order, dout, dwte, partial = (
            k.ptr(n) for n in ("sorted_ids", "order", "dout", "dwte", "partial")
        )
        vocab, rows = k.i64("V"), k.i64("M")
        cols = _Columns(k, C, dtype, vectorize)
        chunk = k.block_id()
        edges = _Chunk(ids, index_dtype, chunk, rows)
        start, end = edges.start, edges.end

        def flush(v: V, piece_start: V, piece_end: V, acc: V, col: V) -> None:
            continued = eq(piece_start, start) & edges.began_earlier
            crossing = eq(piece_end, end) & edges.goes_on
            slot = select(continued, const(0, "i64"), const(1, "i64"))

            def to_partial() -> None:
                store(acc, get_llvm_ptr(partial, (chunk * 2 + slot) * C + col, "f32"))

            def to_dwte() -> None:
                cols.store(cols.load(dwte, v, col) + acc, dwte, v, col)

            if_then(continued | crossing, to_partial)
            if_then(~(continued | crossing) & (v >= 0) & (v < vocab), to_dwte)

        for col in cols.cols:

            def body(col=col) -> None:
                def step(p: V, carried: list[V]) -> list[V]:
                    # UNROLL positions' loads first (independent), then their sums in order.
                    last = end - 1
                    fetched = []
                    for u in range(UNROLL):
                        q = minimum(p + u, last)
                        position = load(get_llvm_ptr(order, q, "i64"), "i64")
                        fetched.append((p + u < end, q, _id_at(ids, index_dtype, q),
                                        cols.load(dout, position, col)))  # fmt: skip
                    v, piece_start, acc = carried
                    for ok, q, token, row in fetched:
                        new_piece = ok & ne(token, v)
                        if_then(
                            new_piece,
                            lambda v=v, s=piece_start, q=q, a=acc: flush(v, s, q, a, col),
                        )
                        v = select(new_piece, token, v)
                        piece_start = select(new_piece, q, piece_start)
                        acc = select(ok, select(new_piece, row, acc + row), acc)
                    return [v, piece_start, acc]

                v, piece_start, acc = loop(
                    start, end, const(UNROLL, "i64"), [edges.first, start, cols.zero()], step
                )
                flush(v, piece_start, end, acc, col)

            if_then(col < C, body)
        k.meta.update(grid="chunks", chunk=CHUNK)
    return k


def build_encoder_bwd_wte_merge_module(
    C: int, dtype: str, index_dtype: str, target: Target, vectorize: bool = True
) -> Kernel:
    """Pass 2 of dwte: the owner chunk of each run that crosses chunk ends adds its pieces
    in chunk order and adds the sum to dwte. Launch arguments: sorted_ids, partial, dwte, V,
    M (as pass 1). Grid: chunks."""
    from ...dsl import Kernel, const, eq, get_llvm_ptr, if_then, load, while_loop

    with Kernel("encoder_bwd_wte_merge", target, columns_layout(C, dtype, vectorize)[1]) as k:
        ids, partial, dwte = k.ptr("sorted_ids"), k.ptr("partial"), k.ptr("dwte")
        vocab, rows = k.i64("V"), k.i64("M")
        cols = _Columns(k, C, dtype, vectorize)
        chunk = k.block_id()
        chunks = (rows + (CHUNK - 1)) / CHUNK
        edges = _Chunk(ids, index_dtype, chunk, rows)
        v = edges.last
        # Owner: the run of the chunk's last id goes on, and it did not begin before this
        # chunk (it did if the whole chunk is that id and the first id's run began earlier).
        began_earlier = eq(edges.first, v) & edges.began_earlier
        owner = edges.goes_on & ~began_earlier & (v >= 0) & (v < vocab)
        for col in cols.cols:

            def body(col=col) -> None:
                def piece(c: V, slot: int) -> V:
                    ptr = get_llvm_ptr(partial, (c * 2 + slot) * C + col, "f32")
                    return load(ptr, "f32", cols.vec)

                def more(carried: list[V]) -> V:
                    return carried[2] & (carried[0] < chunks)

                def step(carried: list[V]) -> list[V]:
                    c, acc, _ = carried
                    # The run goes on past chunk c if the chunk is all v and continues.
                    after_c = _Chunk(ids, index_dtype, c, rows)
                    return [c + 1, acc + piece(c, 0), eq(after_c.last, v) & after_c.goes_on]

                _, acc, _ = while_loop([chunk + 1, piece(chunk, 1), const(1, "i1")], more, step)
                cols.store(cols.load(dwte, v, col) + acc, dwte, v, col)

            if_then(owner & (col < C), body)
        k.meta.update(grid="chunks", chunk=CHUNK)
    return k


_C, _INDEX = Param("C", "int", bounds=WIDE), Param("index_dtype", "index")
ENCODER_FWD = kernel(
    "encoder_fwd",
    params=(_C, DTYPE, _INDEX, vectorize("dtype")),
    args=(
        Arg("tokens"),
        Arg("wte"),
        Arg("wpe"),
        Arg("out"),
        Arg("V", "i64"),
        Arg("T", "i64"),
        ROWS,
    ),
)(build_encoder_fwd_module)
ENCODER_BWD_WPE = kernel(
    "encoder_bwd_wpe",
    params=(_C, DTYPE, Param("accumulate", "bool"), vectorize("dtype")),
    args=(Arg("dout"), Arg("dwpe"), Arg("B", "i64"), Arg("T", "i64")),
)(build_encoder_bwd_wpe_module)
ENCODER_BWD_WTE = kernel(
    "encoder_bwd_wte",
    params=(_C, DTYPE, _INDEX, vectorize("dtype")),
    args=(
        Arg("sorted_ids"),
        Arg("order"),
        Arg("dout"),
        Arg("dwte"),
        Arg("partial"),
        Arg("V", "i64"),
        ROWS,
    ),
)(build_encoder_bwd_wte_module)
ENCODER_BWD_WTE_MERGE = kernel(
    "encoder_bwd_wte_merge",
    params=(_C, DTYPE, _INDEX, vectorize("dtype")),
    args=(Arg("sorted_ids"), Arg("partial"), Arg("dwte"), Arg("V", "i64"), ROWS),
)(build_encoder_bwd_wte_merge_module)
