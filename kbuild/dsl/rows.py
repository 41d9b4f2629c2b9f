"""Rows of an (M, N) array as one thread sees them: `RowTile` (its row, its columns, its
loads, stores and reductions over the row) and `GroupedRows` (rows laid out in groups at a
stride). How threads map onto a row is a `RowShape`, chosen outside the DSL
(plan/config.py: RowConfig).

Loads of columns past the row's end (rows that are not a whole number of the threads'
vectors) return a pad value instead of reading: 0.0 by default, the identity of a sum; pass
`pad=float("-inf")` to rows that feed a max (a softmax's or cross-entropy's), or any value
that leaves the reduction it feeds unchanged. Stores never write past the row.

Rows of any width take 16-byte vectors. Where N is not a whole number of vectors
(`RowConfig.peel`: GPT-2's 50257, a norm of 4097), row r starts (r * N) % vec elements into
an aligned vector: each row's columns are shifted back by that `phase`, so every vector access
stays aligned, and the slice's first and last vectors, which hold columns of the neighbouring
rows, are read and written element by element (a branch the rest of the row does not take).
The row arrays must then start 16-byte aligned (what the `vectorize` parameter promises);
length-N parameters (a weight) are read at the shifted columns element by element, from L1.
Values stay positional: vector i of every row array holds the same columns, so kernels
combine them as before; only state kept across rows (a backward's dw partials, parameters
held in registers) needs every row of a thread at one phase, which `RowGroups` arranges.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from mlir import ir
from mlir.dialects import vector

from ..dtypes import ELEMENT_BYTES
from .control import if_else, if_then, loop
from .exchange import LaggedExchange
from .kernel import Kernel
from .memory import get_llvm_ptr, load, store
from .reduce import add, row_reduce
from .shared import shared_array
from .values import (
    V,
    cast,
    const,
    describe,
    dtype_name,
    hsum,
    i64,
    minimum,
    need_v,
    rewiden,
    scalar_type,
    select,
    to_f32,
    vector_type,
)


def lanes(v: V) -> list[V]:
    """The elements of a vector, as scalars (a scalar: [v])."""
    need_v(v, "dsl.lanes", "v")
    if not isinstance(v.type, ir.VectorType):
        return [v]
    return [V(vector.extract(v.value, [], [i])) for i in range(v.width)]


def from_lanes(elements: list[V]) -> V:
    """One vector of these scalars, all of one type (one scalar: itself)."""
    if not isinstance(elements, (list, tuple)) or not elements:
        raise TypeError(f"dsl.from_lanes: takes a list of scalars, got {describe(elements)}")
    types = {str(need_v(e, "dsl.from_lanes", "each element").type) for e in elements}
    if len(types) > 1 or any(isinstance(e.type, ir.VectorType) for e in elements):
        raise TypeError(
            f"dsl.from_lanes: elements must be scalars of one type, got {sorted(types)}"
        )
    if len(elements) == 1:
        return elements[0]
    t = ir.VectorType.get([len(elements)], elements[0].type)
    return V(vector.from_elements(t, [e.value for e in elements]))


class RowShape(Protocol):
    """How threads map onto rows of N elements (kernels.config.RowConfig is one): a row is
    `threads_per_row` consecutive threads, a block holds `rows_per_block` rows (`block`
    threads), each thread `iters` vectors of `vec` elements at columns
    (i * threads_per_row + lane) * vec, per chunk of `span` elements when `chunked`. A row
    split over a cluster of `cluster` blocks gives each block a contiguous `slice`; `exact`:
    the threads cover it with no column past its end."""

    N: int
    vec: int
    threads_per_row: int
    rows_per_block: int
    iters: int
    chunked: bool
    cluster: int

    @property
    def block(self) -> int: ...

    @property
    def slice(self) -> int: ...

    @property
    def span(self) -> int: ...

    @property
    def exact(self) -> bool: ...

    @property
    def peel(self) -> bool: ...

    @property
    def cover(self) -> int: ...


def thread_columns(shape: RowShape, lane: V, start: V | int = 0) -> list[V]:
    """Column of each of the `shape.iters` vectors of the thread at `lane` of its row, from
    chunk `start`: (i * threads_per_row + lane) * vec, so a warp's accesses are contiguous.
    RowTile's columns; also those of kernels whose rows are picked by data (an embedding's
    token ids), which need no RowTile."""
    base = lane * shape.vec + start
    return [base + i * shape.threads_per_row * shape.vec for i in range(shape.iters)]


class GroupedRows:
    """An input whose rows are not one dense (M, N) array: groups of `x_group` contiguous rows,
    the groups `x_stride` elements apart, so row r starts at

        (r / x_group) * x_stride + (r % x_group) * N.

    The (B, T, H, D) view of a fused qkv projection is one: H rows of D per token, the tokens
    3 * H * D apart (QK-norm reads it in place, no copy). A row's elements stay contiguous, so
    its vector loads are the dense ones.

    r / x_group is a multiply and a shift (table.group_magic: rows below 2^31, as the ops
    guarantee), not a division: a 64-bit division per row cost the QK-norm backward a tenth
    of its bandwidth (H200, N = 64-128: 75 -> 67%, 87 -> 77% of copy). Three i64 launch
    arguments after M: x_group, x_stride and x_group_magic (multiplier | shift << 32)."""

    def __init__(self, k: Kernel, N: int):
        self.N = N
        self.group = k.i64("x_group")
        self.stride = k.i64("x_stride")
        magic = k.i64("x_group_magic")
        self.multiplier, self.shift = magic & 0xFFFFFFFF, magic >> 32

    def offset(self, t: RowTile) -> V:
        quotient = (t.row * self.multiplier) >> self.shift
        rest = t.row - quotient * self.group
        return quotient * self.stride + rest * self.N + t.first


class RowTile:
    """One thread's place in the row grid of a kernel, and its row loads, stores and sums."""

    def __init__(
        self,
        k: Kernel,
        cfg: RowShape,
        rows: V,
        row_group: V | None = None,
        row_stride: V | None = None,
    ):
        """`rows` is M (i64). `row_group` (default: the block's, or with a cluster the
        cluster's, index) picks the rows; a block of a cluster covers slice `rank` of them.
        `row_stride` (i64, elements; default N): where row r starts, r * row_stride, in the
        arrays `load` and `store` address, as a (M, N) view of wider rows is laid out (a
        padded vocabulary's logits). A peeled row's phase follows it (any stride is legal);
        for unpeeled vectors it must keep each row's start aligned to a vector."""
        if not (isinstance(rows, V) and str(rows.type) == "i64"):
            raise TypeError(f"RowTile: rows (M) must be an i64 value (k.i64), got {describe(rows)}")
        self.k, self.cfg, self.rows = k, cfg, rows
        tid = k.thread_id()
        self.lane = tid % cfg.threads_per_row if cfg.rows_per_block > 1 else tid
        self.row_in_block = tid / cfg.threads_per_row if cfg.rows_per_block > 1 else const(0, "i64")
        if row_group is None:
            row_group = k.block_id() / cfg.cluster if cfg.cluster > 1 else k.block_id()
            # Rows past M (in the last block) still take part in barriers: they compute on
            # row M - 1 and skip their stores. A rows grid has no such rows at one per block.
            self.partial_rows = cfg.rows_per_block > 1
        else:
            self.partial_rows = True
        row = row_group * cfg.rows_per_block + self.row_in_block
        self.valid = row < rows if self.partial_rows else None
        self.row = minimum(row, rows - 1) if self.partial_rows else row
        # First column of this block's slice (0 without a cluster).
        self.first = k.cluster_rank() * cfg.slice if cfg.cluster > 1 else 0
        self.offset = self.row * (cfg.N if row_stride is None else row_stride) + self.first
        # Peeled rows: how far the slice starts into an aligned vector (its columns are
        # shifted back by that much), and where it ends (the last block's slice is short).
        self.phase = self.offset & (cfg.vec - 1) if cfg.peel else None
        self.end = cfg.slice if cfg.cluster == 1 else minimum(cfg.N - self.first, cfg.slice)

    def offset_in(self, rows: GroupedRows | None) -> V:
        """Where this thread's slice of its row starts in an array laid out as `rows` says
        (None: dense (M, N) rows, `offset`)."""
        return self.offset if rows is None else rows.offset(self)

    # ------------------------------------------------------------------ columns

    def over_chunks(self, body, carried: Sequence[V] = (), reverse: bool = False) -> list[V]:
        """One pass over this thread's row: `body(start, carried) -> carried`, called once at
        start 0 for a row its threads hold whole, or looped `span` columns at a time over a
        row too long for registers (`cfg.chunked`): each pass then reads the row again, one
        chunk's values live at a time (a loop, not unrolled). Pass `start` to load and store.

        `reverse` walks the chunks last to first: a second pass over a row then starts with the
        chunks the first pass read last, the likeliest still in L2 when the rows in flight
        hold more than it does (a pass whose chunks are independent of each other's order)."""
        if not self.cfg.chunked:
            return list(body(0, list(carried)))
        c = self.cfg
        bounds = (const(0, "i64"), const(c.cover, "i64"), const(c.span, "i64"))
        if not reverse:
            return loop(*bounds, list(carried), body)
        last = const((c.cover - 1) // c.span * c.span, "i64")  # the start of the last chunk
        return loop(*bounds, list(carried), lambda i, state: body(last - i, state))

    def columns(self, start: V | int = 0) -> list[V]:
        """Column of each of this thread's vectors within the block's slice of the row (the
        row without a cluster), from chunk `start`: of its first element, which in a peeled
        row may lie before the slice (a negative column) or past it."""
        cols = thread_columns(self.cfg, self.lane, start)
        return cols if self.phase is None else [c - self.phase for c in cols]

    def inside(self, start: V | int = 0) -> list[V | None]:
        """Per vector: whether its columns lie inside the slice (None: always, no test); in a
        peeled row, a vector of flags, one per element."""
        if self.phase is None:
            return [self._guarded(col) for col in self.columns(start)]
        return [self._element_flags(col) for col in self.columns(start)]

    def count_inside(self, start: V | int = 0) -> list[V | float]:
        """Per vector: how many of its elements lie inside the slice (f32; a number where
        that is known when the kernel is built)."""
        out: list[V | float] = []
        for g in self.inside(start):
            if g is None:
                out.append(float(self.cfg.vec))
            elif g.width == 1:
                out.append(select(g, const(float(self.cfg.vec)), 0.0))
            else:
                out.append(hsum(select(g, const(1.0), 0.0)))
        return out

    def _guarded(self, col: V) -> V | None:
        return None if self.cfg.exact else col < self.cfg.slice

    def _whole(self, col: V) -> V:
        """A peeled vector lies wholly inside the slice."""
        return (col >= 0) & (col + self.cfg.vec <= self.end)

    def _element_flags(self, col: V) -> V:
        """Per element of a peeled vector: inside the slice."""
        flags = [(c >= 0) & (c < self.end) for c in (col + j for j in range(self.cfg.vec))]
        return from_lanes(flags)

    # ------------------------------------------------------------------ loads and stores

    def load(
        self,
        base: V,
        dtype: str,
        start: V | int = 0,
        rows: GroupedRows | None = None,
        *,
        pad: float = 0.0,
    ) -> list[V]:
        """This thread's vectors of its row of `base`, raw (in `dtype`); `pad` past N (0.0
        for a sum; -inf for a max: see the module docstring). `rows`: the array's rows are
        grouped at a stride (GroupedRows), not dense."""
        if rows is not None and self.phase is not None:
            raise ValueError("RowTile.load: grouped rows (rows=) need rows of whole vectors")
        return self._load(base, self.offset_in(rows), dtype, start, pad)

    def _peeled_load(self, base: V, offset: V, col: V, dtype: str, pad: float, aligned: bool) -> V:
        """One vector of a peeled row: one access where it lies wholly inside the slice,
        else element by element (`pad` outside)."""
        vec = self.cfg.vec

        def element(j: int) -> V:
            c = col + j
            return if_else(
                (c >= 0) & (c < self.end),
                lambda: load(get_llvm_ptr(base, offset + c, dtype), dtype),
                lambda: const(pad, scalar_type(dtype)),
            )

        return if_else(
            self._whole(col),
            lambda: load(get_llvm_ptr(base, offset + col, dtype), dtype, vec, aligned),
            lambda: from_lanes([element(j) for j in range(vec)]),
        )

    def values(self, base: V, dtype: str, *, pad: float = 0.0):
        """This thread's f32 values of its row of `base` as a function of a chunk's start:
        loaded once and held where the row fits in registers, loaded again on each pass
        (`over_chunks`) where it does not. `pad` as for `load`."""
        held = None if self.cfg.chunked else widen(self.load(base, dtype, pad=pad))
        if held is not None:
            return lambda start: held
        return lambda start: widen(self.load(base, dtype, start, pad=pad))

    def load_row(
        self, base: V, row: V, dtype: str, start: V | int = 0, *, pad: float = 0.0
    ) -> list[V]:
        """Like `load`, from row `row` of an (R, N) array (a workspace) instead of this row."""
        offset = row * self.cfg.N + self.first
        return self._load(base, offset, dtype, start, pad, aligned=self.phase is None)

    def load_param(self, base: V, dtype: str, start: V | int = 0, *, pad: float = 0.0) -> list[V]:
        """This thread's vectors of a length-N parameter (weight, bias), raw."""
        offset = const(0, "i64") + self.first
        return self._load(base, offset, dtype, start, pad, aligned=self.phase is None)

    def _load(
        self, base: V, offset: V, dtype: str, start: V | int, pad: float, aligned: bool = True
    ) -> list[V]:
        if self.phase is not None:
            return [
                self._peeled_load(base, offset, col, dtype, pad, aligned)
                for col in self.columns(start)
            ]
        out = []
        for col in self.columns(start):
            ptr = get_llvm_ptr(base, offset + col, dtype)
            guard = self._guarded(col)
            if guard is None:
                out.append(load(ptr, dtype, self.cfg.vec))
            else:
                t = vector_type(dtype, self.cfg.vec) if self.cfg.vec > 1 else scalar_type(dtype)
                out.append(
                    if_else(
                        guard,
                        lambda p=ptr: load(p, dtype, self.cfg.vec),
                        lambda t=t: const(pad, t),
                    )
                )
        return out

    def store(self, base: V, values: list[V], dtype: str, start: V | int = 0) -> None:
        """Store fp32 `values` (one per column vector) as `dtype` into this thread's row."""
        self._store(base, self.offset, values, dtype, start, self.valid)

    def store_row(self, base: V, row: V, values: list[V], dtype: str, start: V | int = 0) -> None:
        """Store into row `row` of an (R, N) array (a workspace), whatever this row's validity."""
        offset = row * self.cfg.N + self.first
        self._store(base, offset, values, dtype, start, None, aligned=self.phase is None)

    def _store(self, base, offset, values, dtype, start, valid: V | None, aligned=True) -> None:
        if not isinstance(values, (list, tuple)) or len(values) != self.cfg.iters:
            got = len(values) if isinstance(values, (list, tuple)) else describe(values)
            raise ValueError(
                f"RowTile.store: values must be one per vector of the thread ({self.cfg.iters}, "
                f"as load returns them), got {got}"
            )
        if self.phase is not None:
            for col, v in zip(self.columns(start), values, strict=True):
                self._peeled_store(base, offset, col, cast(v, dtype), dtype, valid, aligned)
            return
        for col, v in zip(self.columns(start), values, strict=True):
            ptr = get_llvm_ptr(base, offset + col, dtype)
            value = cast(v, dtype)
            guard = self._guarded(col)
            if valid is not None:
                guard = valid if guard is None else guard & valid
            if guard is None:
                store(value, ptr)
            else:
                if_then(guard, lambda p=ptr, v=value: store(v, p))

    def _peeled_store(
        self, base: V, offset: V, col: V, value: V, dtype: str, valid: V | None, aligned: bool
    ) -> None:
        """One vector of a peeled row: one access where it lies wholly inside the slice,
        else the elements inside it one by one."""

        def by_element() -> None:
            for j, e in enumerate(lanes(value)):
                c = col + j
                if_then(
                    (c >= 0) & (c < self.end),
                    lambda c=c, e=e: store(e, get_llvm_ptr(base, offset + c, dtype)),
                )

        def write() -> None:
            ptr = get_llvm_ptr(base, offset + col, dtype)
            if_then(self._whole(col), lambda: store(value, ptr, aligned), by_element)

        if valid is None:
            write()
        else:
            if_then(valid, write)

    def store_block_partials(self, bases: list[V], slot: V, per_base: list[list[V]]) -> None:
        """Store each thread's fp32 partials (per_base[j]: one vector per column vector) into
        row `slot` of each (R, N) workspace in `bases`, the block's rows summed first.

        With several rows per block (short rows of 8-64 threads; LayerNorm's 128-thread rows
        at N = 2048) the threads of one column hold one partial each; they are added in row
        order through shared memory and the block's first row stores the sum, so the
        workspace has one row per block, not per row of it. (One per row left the column sum
        ~17000 rows at N = 64 on an H200: 36 us against the backward's 98.) A fixed order:
        every bit depends on the launch shape. Called once, by every thread of the block
        (it has a barrier), after the row loop."""
        cfg = self.cfg
        if not bases:
            return
        storing = None  # every thread stores its own partials
        if cfg.rows_per_block > 1:
            per_base = self._sum_block_rows(per_base)
            storing = self.row_in_block < 1  # the block's first row stores the sums
        for base, values in zip(bases, per_base, strict=True):
            offset = slot * cfg.N + self.first
            self._store(base, offset, values, "f32", 0, storing, aligned=self.phase is None)

    def _sum_block_rows(self, per_base: list[list[V]]) -> list[list[V]]:
        """per_base summed over the block's rows (ascending), as the first row sees it."""
        cfg, k = self.cfg, self.k
        flat = [v for values in per_base for v in values]
        shared = shared_array(k, len(flat) * cfg.vec * k.block, "f32")

        def at(i: int, thread: V) -> V:
            return get_llvm_ptr(shared, (thread + i * k.block) * cfg.vec, "f32")

        tid = k.thread_id()
        for i, v in enumerate(flat):
            store(v, at(i, tid))
        k.barrier()

        def add_row(r: V, totals: list[V]) -> list[V]:
            thread = self.lane + r * cfg.threads_per_row
            return [t + load(at(i, thread), "f32", cfg.vec) for i, t in enumerate(totals)]

        # Ascending rows, one row's values at a time (a loop, not unrolled: the loads of
        # every row at once raised LayerNorm's registers from 64 to 92 at 4 rows a block).
        first = [load(at(i, self.lane), "f32", cfg.vec) for i in range(len(flat))]
        one = const(1, "i64")
        sums = iter(loop(one, const(cfg.rows_per_block, "i64"), one, first, add_row))
        return [[next(sums) for _ in values] for values in per_base]

    def load_row_scalar(self, base: V, dtype: str = "f32") -> V:
        """Element `row` of a one-per-row array (a saved rstd or mean; "i32" / "i64" a row's
        target id), read by every thread of the row, raw in `dtype`."""
        dtype_name(dtype, "RowTile.load_row_scalar", ELEMENT_BYTES)
        return load(get_llvm_ptr(base, self.row, dtype), dtype)

    def store_row_scalar(self, base: V, value: V, dtype: str = "f32") -> None:
        """Write one value per row (rstd, mean, a loss) as `dtype`, from the row's first
        thread, where the row exists (not a row past M)."""
        dtype_name(dtype, "RowTile.store_row_scalar", ELEMENT_BYTES)
        first = self.lane < 1
        guard = first if self.valid is None else first & self.valid
        value = cast(value, dtype)
        if_then(guard, lambda: store(value, get_llvm_ptr(base, self.row, dtype)))

    def load_at(self, base: V, column: V, dtype: str, rows: GroupedRows | None = None) -> V:
        """Element `column` (an integer, from 0 to N - 1: the caller checks it) of this row of
        `base`: a gather within the row (a cross-entropy's logit at the target), one scalar
        read by every thread of the row, raw in `dtype`. A cluster's blocks each read it."""
        dtype_name(dtype, "RowTile.load_at", ELEMENT_BYTES)
        start = self.offset_in(rows) - self.first  # the row's start, not this block's slice
        return load(get_llvm_ptr(base, start + i64(column), dtype), dtype)

    def element_columns(self, start: V | int = 0) -> list[V]:
        """Per vector of this thread (as `load` returns them, from chunk `start`): the row's
        column of each element, i64, lane by lane (a scalar for 1-element vectors), for
        per-element compares (`dsl.eq(cols, target)`) and `dsl.select`. Columns outside the
        row may appear (their elements hold the pad): `inside` says which are in it."""
        out = []
        for col in self.columns(start):
            at = col + self.first
            if self.cfg.vec == 1:
                out.append(at)
            else:
                out.append(from_lanes([at + j for j in range(self.cfg.vec)]))
        return out

    # ------------------------------------------------------------------ reductions

    def sum(
        self, *per_thread: V, reused: bool = False, phase: V | None = None, meanwhile=None
    ) -> list[V]:
        """Row totals of per-thread f32 partials (several at once share one barrier)."""
        return self.reduce(list(per_thread), add, reused, phase, meanwhile)

    def reduce(
        self,
        state: list[V],
        merge,
        reused: bool = False,
        phase: V | None = None,
        meanwhile=None,
    ) -> list[V]:
        """A per-thread state merged over the row (dsl.row_reduce; `sum` merges by adding).

        `reused`: the call sits in a loop (its shared slots are reused). With a cluster the
        block results are then merged across the cluster by the kernel's exchange
        (dsl.exchange.ClusterExchange), which also says how the block's slots are reused; a
        call in a loop passes `phase` (RowGroups) for it. `meanwhile()`, work that does not
        need the result, runs while the exchange waits for the other blocks (without a
        cluster: after the row's reduction).
        """
        clustered = self.cfg.cluster > 1
        if clustered and reused and phase is None:
            raise ValueError("a cluster row reduction inside a loop needs its phase")
        out = self._block_reduce(state, merge, reused, phase)
        if clustered:
            out = self.k.exchange.reduce(out, phase, merge, meanwhile, self.lane)
            self._mark("cluster")
            return out
        if meanwhile is not None:
            meanwhile()
        return out

    def send_sum(self, lag: LaggedExchange, *per_thread: V, phase: V) -> list[V]:
        """A lagged cluster row sum in a row loop, first half: the block's totals of the
        per-thread partials, sent to the cluster's blocks (dsl.exchange, "lagged"); returns
        them. `receive_sum` with the same phase, a row later, takes the row's totals."""
        out = self._block_reduce(list(per_thread), add, True, phase)
        lag.send(out, phase, self.lane)
        return out

    def receive_sum(self, lag: LaggedExchange, phase: V, when: V | None = None) -> list[V]:
        """The second half of `send_sum`: the row totals of the row sent with `phase`. `when`
        (block-uniform i1): whether that row was sent; where not, the totals are garbage,
        not waited for."""
        out = lag.receive(phase, add, when)
        self._mark("cluster")
        return out

    def _block_reduce(self, state: list[V], merge, reused: bool, phase: V | None) -> list[V]:
        """dsl.row_reduce over the block's threads of the row, its warp slots reused as the
        kernel's exchange says."""
        c = self.cfg
        block_reused, block_phase = self.k.exchange.block_slots(reused, phase)
        out = row_reduce(
            self.k,
            state,
            c.threads_per_row,
            self.row_in_block,
            c.rows_per_block,
            block_reused,
            merge,
            block_phase,
        )
        self._mark("block")
        return out

    def _mark(self, point: str) -> None:
        if self.k.trace is not None:
            self.k.trace.mark(point)


def widen(values: list[V]) -> list[V]:
    return [to_f32(v) for v in values]


def rewiden_all(values: list[V], by_words: bool = False) -> list[V]:
    """Widen raw row values a second time without an fp32 copy kept alive (dsl.rewiden)."""
    return [rewiden(v, by_words) for v in values]
