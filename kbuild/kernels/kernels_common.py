"""Kernel fragments shared by the row kernels: row loads, stores and sums (see config.py for
how threads map onto rows)."""

from __future__ import annotations

from ..dsl import (
    Kernel,
    V,
    add,
    cast,
    commit_async,
    const,
    copy_async,
    get_llvm_ptr,
    if_else,
    if_then,
    join,
    load,
    loop,
    minimum,
    prefetch_l2,
    rewiden,
    row_reduce,
    split,
    store,
    to_f32,
    wait_async,
)
from ..dsl.exchange import LaggedExchange
from ..dsl.values import scalar_type, vector_type
from ..dtypes import ELEMENT_BYTES
from .config import RowConfig


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

    def __init__(self, k: Kernel, cfg: RowConfig, rows: V, row_group: V | None = None):
        """`rows` is M (i64). `row_group` (default: the block's, or with a cluster the
        cluster's, index) picks the rows; a block of a cluster covers slice `rank` of them."""
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
        self.offset = self.row * cfg.N + self.first

    def offset_in(self, rows: GroupedRows | None) -> V:
        """Where this thread's slice of its row starts in an array laid out as `rows` says
        (None: dense (M, N) rows, `offset`)."""
        return self.offset if rows is None else rows.offset(self)

    # ------------------------------------------------------------------ columns

    def columns(self, start: V | int = 0) -> list[V]:
        """Column of each of this thread's vectors within the block's slice of the row (the
        row without a cluster), from chunk `start`."""
        c = self.cfg
        base = self.lane * c.vec + start
        return [base + i * c.threads_per_row * c.vec for i in range(c.iters)]

    def inside(self, start: V | int = 0) -> list[V | None]:
        """Per vector: whether its columns lie inside the slice (None: always, no test)."""
        return [self._guarded(col) for col in self.columns(start)]

    def _guarded(self, col: V) -> V | None:
        return None if self.cfg.exact else col < self.cfg.slice

    # ------------------------------------------------------------------ loads and stores

    def load(
        self, base: V, dtype: str, start: V | int = 0, rows: GroupedRows | None = None
    ) -> list[V]:
        """This thread's vectors of its row of `base`, raw (in `dtype`); zeros past N.
        `rows`: the array's rows are grouped at a stride (GroupedRows), not dense."""
        return self._load(base, self.offset_in(rows), dtype, start)

    def load_row(self, base: V, row: V, dtype: str, start: V | int = 0) -> list[V]:
        """Like `load`, from row `row` of an (R, N) array (a workspace) instead of this row."""
        return self._load(base, row * self.cfg.N + self.first, dtype, start)

    def load_param(self, base: V, dtype: str, start: V | int = 0) -> list[V]:
        """This thread's vectors of a length-N parameter (weight, bias), raw."""
        return self._load(base, const(0, "i64") + self.first, dtype, start)

    def _load(self, base: V, offset: V, dtype: str, start: V | int) -> list[V]:
        out = []
        for col in self.columns(start):
            ptr = get_llvm_ptr(base, offset + col, dtype)
            guard = self._guarded(col)
            if guard is None:
                out.append(load(ptr, dtype, self.cfg.vec))
            else:
                zero = vector_type(dtype, self.cfg.vec) if self.cfg.vec > 1 else scalar_type(dtype)
                out.append(
                    if_else(
                        guard,
                        lambda p=ptr: load(p, dtype, self.cfg.vec),
                        lambda z=zero: const(0, z),
                    )
                )
        return out

    def store(self, base: V, values: list[V], dtype: str, start: V | int = 0) -> None:
        """Store fp32 `values` (one per column vector) as `dtype` into this thread's row."""
        self._store(base, self.offset, values, dtype, start, self.valid)

    def store_row(self, base: V, row: V, values: list[V], dtype: str, start: V | int = 0) -> None:
        """Store into row `row` of an (R, N) array (a workspace), whatever this row's validity."""
        self._store(base, row * self.cfg.N + self.first, values, dtype, start, None)

    def _store(self, base, offset, values, dtype, start, valid: V | None) -> None:
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
            self._store(base, slot * cfg.N + self.first, values, "f32", 0, storing)

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

    def load_row_scalar(self, base: V) -> V:
        """One f32 per row (the saved rstd, mean), read by every thread of the row."""
        return load(get_llvm_ptr(base, self.row, "f32"), "f32")

    def store_row_scalar(self, base: V, value: V) -> None:
        """Write one f32 per row (rstd, mean) from the row's first thread."""
        first = self.lane < 1
        guard = first if self.valid is None else first & self.valid
        if_then(guard, lambda: store(value, get_llvm_ptr(base, self.row, "f32")))

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


STATIC_SHARED_BYTES = 40 * 1024  # with the row sums' slots, under the 48 KB static limit


def shared_array(k: Kernel, count: int, dtype: str, static_bytes: int = STATIC_SHARED_BYTES) -> V:
    """A shared array of `count` elements: declared statically while the kernel's static
    shared memory stays within `static_bytes`, past that as dynamic shared memory (reserved
    at launch; see Kernel.dynamic_shared)."""
    if k.shared_bytes + count * ELEMENT_BYTES[dtype] <= static_bytes:
        return k.shared(count, dtype)
    return k.dynamic_shared(count, dtype)


class ThreadShared:
    """Shared memory that each thread uses alone: `n` values per thread, each `width`
    elements of `dtype`, kept off the register file (dw/db partials; parameters a persistent
    block reads for every row). A value is stored as 16-byte pieces, each piece contiguous
    over the block's threads, so a warp's accesses fall on distinct banks. A thread reads
    back only what it wrote: no barriers.

    Static or dynamic shared memory as `shared_array` decides, within `static_bytes`."""

    def __init__(
        self, k: Kernel, n: int, dtype: str, width: int, static_bytes: int = STATIC_SHARED_BYTES
    ):
        self.k, self.n, self.dtype, self.width = k, n, dtype, width
        self.sub = min(width, 16 // ELEMENT_BYTES[dtype])  # elements per piece
        self.pieces = width // self.sub
        count = n * width * k.block
        self.bytes = count * ELEMENT_BYTES[dtype]
        self.base = shared_array(k, count, dtype, static_bytes)
        self.tid = k.thread_id()

    def _slots(self, i: int) -> list[V]:
        block, sub = self.k.block, self.sub
        first = i * self.pieces * block
        return [
            get_llvm_ptr(self.base, (self.tid + (first + q * block)) * sub, self.dtype)
            for q in range(self.pieces)
        ]

    def get(self, i: int) -> V:
        return join([load(ptr, self.dtype, self.sub) for ptr in self._slots(i)])

    def slot(self, i: int) -> V:
        """The address of value i, when it is one 16-byte piece (an async copy's target)."""
        if self.pieces != 1 or self.sub * ELEMENT_BYTES[self.dtype] != 16:
            raise ValueError("a single-slot value must be 16 bytes")
        return self._slots(i)[0]

    def put(self, i: int, value: V) -> None:
        for ptr, piece in zip(self._slots(i), split(value, self.sub), strict=True):
            store(piece, ptr)


class Staged:
    """One step's staged row group, as RowStage.loop hands it to the body: `values` (per
    array, this thread's raw vectors, read when the step began), `reload()` (read them again
    from shared memory: the body need not hold them in registers across its reductions) and
    `release()` (the buffer is free: start copying the group `depth` steps ahead into it;
    call it once, after the last read)."""

    def __init__(self, stage: RowStage, buffer: V | int, upcoming: RowTile):
        self._stage, self._buffer, self._upcoming = stage, buffer, upcoming
        self.values = stage.take(buffer)
        self.released = False

    def reload(self) -> list[list[V]]:
        if self.released:
            raise ValueError("a staged row group was read after its buffer was released")
        return self._stage.read(self._buffer)

    def release(self) -> None:
        if self.released:
            raise ValueError("a staged row group was released twice")
        self.released = True
        self._stage.issue(self._upcoming, self._buffer)


class RowStage:
    """Rows copied into shared memory ahead of their use (`copy_async`, bypassing registers
    and L1): a persistent kernel keeps the copies of its next row groups in flight while it
    works on the current one. Each thread copies, and later reads, only its own 16-byte
    vectors (ThreadShared): no barriers. Exact rows of 16-byte vectors. `arrays`: (base,
    dtype) pairs, or (base, dtype, rows) for an array of GroupedRows.

    `depth` buffers (b = 0 .. depth - 1, an i64 value), each holding one row group; `loop`
    cycles through them: it fills all, then each step takes the current buffer and, once the
    body releases it, copies the group `depth` steps ahead into it. A body that releases
    right after its first read has `depth` groups in flight while it works; one that reloads
    the rows after its reductions and releases at its end has `depth - 1` (and holds fewer
    registers)."""

    def __init__(self, k: Kernel, cfg: RowConfig, arrays: list[tuple], depth: int = 1):
        arrays = [(a[0], a[1], a[2] if len(a) > 2 else None) for a in arrays]
        if not (cfg.exact and all(cfg.vec * ELEMENT_BYTES[d] == 16 for _, d, _ in arrays)):
            raise ValueError("staged rows must be exact rows of 16-byte vectors")
        if depth < 1:
            raise ValueError(f"stage depth must be at least 1, not {depth}")
        self.k, self.cfg, self.arrays, self.depth = k, cfg, arrays, depth
        self.slots = [ThreadShared(k, cfg.iters * depth, d, cfg.vec) for _, d, _ in arrays]

    def _slot(self, slots: ThreadShared, i: int, buffer: V | int) -> V:
        ptr = slots.slot(i)
        if isinstance(buffer, int) and buffer == 0:
            return ptr
        return get_llvm_ptr(ptr, buffer * (self.cfg.iters * self.k.block * slots.sub), slots.dtype)

    def loop(self, walk: RowGroups, init: list[V], body, ahead=()) -> list[V]:
        """walk.loop with staged rows: body(g, phase, carried, staged: Staged) -> carried.
        `ahead` is passed on to walk.loop (L2 prefetch), for the first group not yet staged."""
        k, cfg, depth = self.k, self.cfg, self.depth
        for j in range(depth):  # fill every buffer: buffer j with the block's j-th group
            self.issue(RowTile(k, cfg, walk.rows, row_group=walk.first + j * walk.stride), j)
        extra = 1 if depth > 1 else 0  # the buffer index, carried first

        def step(g: V, phase: V | None, carried: list[V]) -> list[V]:
            buffer = carried[0] if extra else 0
            upcoming = RowTile(k, cfg, walk.rows, row_group=g + depth * walk.stride)
            staged = Staged(self, buffer, upcoming)
            if k.trace is not None:
                k.trace.mark("landed")
            out = body(g, phase, carried[extra:], staged)
            if not staged.released:
                raise ValueError("the body of a staged loop must release its row group")
            return ([(buffer + 1) % depth] if extra else []) + out

        first = [const(0, "i64")] if extra else []
        out = walk.loop(first + list(init), step, ahead, distance=depth + 1)[extra:]
        wait_async(0)  # the copies started for groups past the end land before the kernel ends
        return out

    def issue(self, t: RowTile, buffer: V | int) -> None:
        """Start copying this thread's vectors of t's row of each array into `buffer`."""
        for (base, dtype, rows), slots in zip(self.arrays, self.slots, strict=True):
            offset = t.offset_in(rows)
            for i, col in enumerate(t.columns()):
                src = get_llvm_ptr(base, offset + col, dtype)
                copy_async(self._slot(slots, i, buffer), src)
        commit_async()

    def take(self, buffer: V | int) -> list[list[V]]:
        """Wait for the oldest copies in flight (those of `buffer`) and read them."""
        wait_async(self.depth - 1)
        return self.read(buffer)

    def read(self, buffer: V | int) -> list[list[V]]:
        """Per array, this thread's raw vectors in `buffer` (landed: see `take`)."""
        return [
            [load(self._slot(s, i, buffer), s.dtype, s.sub) for i in range(self.cfg.iters)]
            for s in self.slots
        ]


class RowGroups:
    """A persistent grid's walk over the row groups: cluster c (block c, without clusters)
    takes groups c, c + clusters, ...; its blocks each cover their slice of those rows."""

    def __init__(self, k: Kernel, cfg: RowConfig, rows: V):
        C = cfg.cluster
        self.k, self.cfg, self.rows = k, cfg, rows
        self.first = k.block_id() / C if C > 1 else k.block_id()
        self.stride = k.grid_size() / C if C > 1 else k.grid_size()
        self.count = (rows + (cfg.rows_per_block - 1)) / cfg.rows_per_block

    def loop(
        self, init: list[V], body, ahead: list[tuple[V, str]] = (), distance: int = 1
    ) -> list[V]:
        """body(g, phase, carried) -> carried, for each of this block's row groups g.
        `phase` (i32), the kernel's exchange phase (dsl.exchange.ClusterExchange: which half
        of a cluster row sum's buffers a row uses, and its mbarrier parity), goes from
        `first_phase` through `next_phase`; None without a cluster.

        `ahead`: (array, dtype) pairs whose slice of the rows `distance` groups ahead one
        thread asks into L2 at the start of each step (`prefetch_l2`), so the loads of them
        meet L2 instead of DRAM; 16-byte vectors only."""
        k, cfg = self.k, self.cfg
        C = cfg.cluster
        if C > 1:
            k.ensure_cluster_started()  # before the loop: its row sums store into peer blocks

        trace, exchange = k.trace, k.exchange

        def step(g: V, carried: list[V]) -> list[V]:
            if trace is not None:
                trace.iteration = (g - self.first) / self.stride
                trace.mark("start")
            if ahead:
                self._prefetch(g + distance * self.stride, ahead)
            if C == 1:
                out = body(g, None, carried)
            else:
                out = [exchange.next_phase(carried[0])] + body(g, carried[0], carried[1:])
            if trace is not None:
                trace.mark("end")
            return out

        init = list(init) if C == 1 else [exchange.first_phase()] + list(init)
        out = loop(self.first, self.count, self.stride, init, step)
        if trace is not None:
            trace.iteration = None  # its value lives in the loop only
        return out if C == 1 else out[1:]

    def _prefetch(self, g: V, arrays: list[tuple[V, str]]) -> None:
        cfg = self.cfg
        first_row = g * cfg.rows_per_block
        # The group's rows are contiguous: whole rows, or one row's slice.
        n_rows = minimum(self.rows - first_row, const(cfg.rows_per_block, "i64"))
        first = self.k.cluster_rank() * cfg.slice if cfg.cluster > 1 else 0

        if cfg.cluster > 1 and cfg.rows_per_block > 1:
            raise ValueError("L2 prefetch needs a group's slice to be contiguous (one row)")

        def issue() -> None:
            for base, dtype in arrays:
                if cfg.vec * ELEMENT_BYTES[dtype] != 16:
                    raise ValueError("L2 prefetch needs rows of 16-byte vectors")
                ptr = get_llvm_ptr(base, first_row * cfg.N + first, dtype)
                prefetch_l2(ptr, n_rows * (cfg.slice * ELEMENT_BYTES[dtype]))

        if_then((g < self.count) & (self.k.thread_id() < 1), issue)


def widen(values: list[V]) -> list[V]:
    return [to_f32(v) for v in values]


def rewiden_all(values: list[V], by_words: bool = False) -> list[V]:
    """Widen raw row values a second time without an fp32 copy kept alive (dsl.rewiden)."""
    return [rewiden(v, by_words) for v in values]
