"""The exchange of row states between the blocks of a cluster (a row split over them): one
`ClusterExchange` per kernel, made by `Kernel(..., exchange=mode)` and fixed from then on.

It owns everything that has to agree for the exchange to be correct: the mode, the slot
buffers and their halves, the mbarriers and their initialisation at cluster start, and the
mapping from a row loop's phase to the half a use takes and the mbarrier parity it waits for.
The kernels' row code asks it for those (dsl.rows.RowTile.reduce, dsl.row_walk.RowGroups).

Modes:
- "barrier": each block stores its state into slot `rank` of every block's buffer (remote
  shared stores), then a cluster barrier (arrive, `meanwhile`, wait). The arrive releases
  every earlier store of the thread, global ones included, at cluster scope, and the whole
  cluster steps together.
- "mbarrier": the states are sent with `st.async`, which counts their bytes against an
  mbarrier in the receiving block (one per half of its buffer); a block waits only for its
  own mbarrier, with no cluster barrier and no release of its other stores (sm_90 on).
- "lagged": "mbarrier" with the wait taken one row later. A row loop sends row r's state
  (`send`), works on row r + 1 up to sending its state, and only then takes row r's result
  (`receive`), so the exchange's latency hides behind a row's work instead of stalling it.
  The buffers are quarters instead of halves (below); `reduce` is not offered.

Why reusing the slots is safe (a call inside a row loop; `phase` is the loop's iteration
count modulo 2 * `buffers` (4, or 8 lagged), an i32 that RowGroups carries from
`first_phase` through `next_phase`):

- Cluster slots alternate between two halves (`half(phase)` = phase % 2) in both modes. A
  fast block writing the next iteration's state never lands on a half a slow block still
  reads: it would first need that block's state of the iteration between, which the slow
  block sends only after reading.
- The block's warp slots (dsl.row_reduce, rows of more than a warp): with a cluster barrier
  each row, every thread of every block passes it after its reads of them and before the
  next row's writes, so they need nothing more. With mbarriers nothing crosses the blocks'
  threads like that: the warp slots alternate halves too (`block_slots`), so the next write
  to a half comes a block barrier later (the next row's reduction), after every warp's reads
  of it. Rows of one warp or less have no block barrier per row and must keep the cluster
  barrier (plans.cluster_exchange refuses them the mbarrier mode).
- mbarriers: the i-th use of a half waits for the mbarrier phase of parity i % 2, which is
  `phase // 2`. Each row, thread 0 arrives on the half's mbarrier expecting the bytes of
  every block's state; bytes that land before the arrival count too, so no ordering between
  blocks is needed beyond the causality the halves already rely on. The slots just read are
  written again by peers' `st.async` two rows on, and no proxy fence orders the two: every
  thread has consumed its reads before its block's barrier of the next row, and a peer can
  only send that later row after this block's state of the next row, sent after that
  barrier. (Measured with and without fence.proxy.async here: no difference.)
- Lagged: a block sends row r + 1 before it reads row r's slots, so two rows' slots are
  live at once and the cluster slots (and their mbarriers) cycle through four buffers,
  `buffer(phase)` = phase % 4, the i-th use of one waiting for parity i % 2 = phase // 4.
  A block sends row r + 4 into row r's buffer only after it has received row r + 2, which
  each peer sent after a block barrier that follows its reads of row r's slots (it reads
  them while working on row r + 1): the halves' argument with one row of lag more. The
  same order keeps row r + 4's bytes off a buffer's mbarrier until its phase of row r has
  completed (a peer sends row r + 2 only after it has received row r). The block's warp
  slots still alternate halves: a row's block reduction is done within its own step.
  tests/test_lagged_protocol_cpu.py runs a model of this under random interleavings (three
  buffers fail it).
- The mbarriers are initialised before the block announces it has started (at cluster
  start, then `fence.mbarrier_init`), and no block stores into another before every block
  has started (Kernel.ensure_cluster_started).

A change to this protocol needs a bench/repeat_check.py run on the GPU (reruns every tune
variant, counts outputs that differ bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

from .control import if_else, if_then
from .mbarrier import (
    arrive_expect_tx,
    fence_mbarrier_init,
    mbarrier_init,
    store_async,
    wait_parity,
    wait_parity_derived,
)
from .memory import get_llvm_ptr, load, store
from .values import V, cast, const

Merge = Callable[[list[V], list[V]], list[V]]

MODES = ("barrier", "mbarrier", "lagged")
HALVES = 2  # the block's warp slots and, but lagged, the cluster slots: phase % 2


class ClusterKernel(Protocol):
    """What an exchange uses of its kernel (dsl.kernel.Kernel, which makes it): the cluster's
    size, thread and block ids, shared memory and the cluster barrier."""

    cluster: int

    def thread_id(self) -> V: ...
    def cluster_rank(self) -> V: ...
    def remote(self, shared_ptr: V, rank: V) -> V: ...
    def cluster_arrive(self) -> None: ...
    def cluster_wait(self) -> None: ...
    def at_cluster_start(self) -> AbstractContextManager: ...
    def ensure_cluster_started(self) -> None: ...
    def shared(self, count: int, dtype: str = "f32") -> V: ...
    def shared_array(self, count: int, dtype: str = "f32") -> str: ...
    def shared_address(self, name: str) -> V: ...


def _buffer_and_parity(buffers: int) -> str:
    """phase -> (buffer, parity) as the mbarrier wait derives them inside its instruction
    sequence (from the mbarriers' 32-bit shared address $0 and the i32 phase $1), so nothing
    but the phase stays live while the wait spins: buffer = phase % buffers (as `buffer`),
    parity = phase // buffers (the buffer's use count, modulo 2). `buffers`: 2 or 4."""
    shift = buffers.bit_length() - 1
    return (
        f"and.b32 offset, $1, {buffers - 1};\n"
        "shl.b32 offset, offset, 3;\n"  # its mbarrier, 8 bytes each
        "add.u32 bar, $0, offset;\n"
        f"shr.u32 parity, $1, {shift};\n"
    )


class ClusterExchange:
    """How the blocks of a cluster merge their block results of a row (see the module)."""

    __slots__ = ("_k", "_mode", "buffers")

    def __init__(self, k: ClusterKernel, mode: str = "barrier"):
        if mode not in MODES:
            raise ValueError(f"exchange must be one of {MODES}, not {mode!r}")
        if mode != "barrier" and k.cluster == 1:
            raise ValueError(f"exchange={mode!r} needs a kernel with clusters")
        self._k, self._mode = k, mode
        self.buffers = 4 if mode == "lagged" else HALVES  # cluster slot buffers (see module)

    @property
    def mode(self) -> str:
        """The mode, one of MODES (fixed when the kernel is made)."""
        return self._mode

    def __repr__(self) -> str:
        return f"ClusterExchange({self._mode!r}, cluster={self._k.cluster})"

    # ------------------------------------------------------------------ phases

    def first_phase(self) -> V:
        """The phase of a row loop's first iteration (i32)."""
        return const(0, "i32")

    def next_phase(self, phase: V) -> V:
        """The phase of the iteration after the one of `phase`."""
        return (phase + 1) % (2 * self.buffers)

    def buffer(self, phase: V | None) -> V:
        """The cluster slot buffer that the use of `phase` takes (i64): phase % buffers; 0
        outside a loop (no phase)."""
        return const(0, "i64") if phase is None else cast(phase % self.buffers, "i64")

    def half(self, phase: V | None) -> V:
        """The half of a double buffer that the use of `phase` takes (i64): phase % 2; 0
        outside a loop (no phase)."""
        return const(0, "i64") if phase is None else cast(phase % HALVES, "i64")

    def block_slots(self, reused: bool, phase: V | None) -> tuple[bool, V | None]:
        """How dsl.row_reduce reuses the block's warp slots before this exchange: its
        (`reused`, `phase`) arguments for a call that sits in a loop (`reused`) or not.
        Without clusters a trailing block barrier; a cluster barrier orders the reuse by
        itself; with mbarriers the slots alternate halves by `phase` (see the module)."""
        if self._k.cluster == 1:
            return reused, None
        if self._mode != "barrier" and reused:
            return False, phase
        return False, None

    # ------------------------------------------------------------------ the exchange

    def reduce(
        self,
        state: list[V],
        phase: V | None,
        merge: Merge,
        meanwhile: Callable[[], None] | None = None,
        lane: V | None = None,
    ) -> list[V]:
        """Merge block results (the same in every thread of the block's one row) over the
        cluster's blocks; every block gets the same bits. `lane`: this thread's index in the
        row (default: the thread index).

        Block r's first `cluster` threads of each row send the row's state into slot r of
        every block's buffer (thread t into block t), then each thread merges its row's slots
        in rank order. A call inside a loop passes its `phase`. `meanwhile()` runs while the
        other blocks' states are awaited: work that does not need the result."""
        k = self._k
        if k.cluster == 1:
            raise ValueError("a cluster exchange needs a kernel with clusters")
        if self._mode == "lagged":
            raise ValueError("a lagged exchange is taken in two calls: send, then receive")
        lane = k.thread_id() if lane is None else lane
        slots = _Slots(self, len(state), phase)
        if self._mode == "mbarrier":
            bars = self._mbarriers()
            self._send(state, slots, lane, bars)
            if meanwhile is not None:
                meanwhile()
            live = sum(isinstance(v, V) for v in state)  # Python floats are never sent
            self._wait(live, phase, slots, bars)
        else:
            self._send_and_step(state, meanwhile, slots, lane)
        return slots.merge(state, merge)

    def lagged(self, n: int) -> LaggedExchange:
        """A lagged exchange of `n`-value row states at one place of a row loop: its slot
        buffers and mbarriers, for its `send` and `receive` calls (see the module)."""
        if self._mode != "lagged":  # (a lagged exchange has clusters: see __init__)
            raise ValueError(f"send and receive are the lagged exchange's, not {self._mode!r}")
        return LaggedExchange(self, n)

    def _send_and_step(self, state, meanwhile, slots: _Slots, lane: V) -> None:
        """The "barrier" mode: remote stores, then the cluster barrier around `meanwhile`."""
        k = self._k
        rank = k.cluster_rank()

        def publish() -> None:  # thread t of a row writes into block t
            for j, v in enumerate(state):
                if isinstance(v, V):
                    store(v, k.remote(slots.slot(rank, j), lane))

        k.ensure_cluster_started()
        if_then(lane < k.cluster, publish)
        k.cluster_arrive()
        if meanwhile is not None:
            meanwhile()
        k.cluster_wait()

    def _send(self, state: list[V], slots: _Slots, lane: V, bars: str) -> None:
        """The mbarrier modes' send: `st.async` into each block (thread t of a row into block
        t), counted by the receiving buffer's mbarrier (of the array `bars`)."""
        k = self._k
        bar = get_llvm_ptr(k.shared_address(bars), slots.which, "i64")
        rank = k.cluster_rank()
        k.ensure_cluster_started()

        def publish() -> None:
            for j, v in enumerate(state):
                if isinstance(v, V):
                    store_async(slots.slot(rank, j), v, bar, lane)

        if_then(lane < k.cluster, publish)

    def _wait(self, live: int, phase: V | None, slots: _Slots, bars: str) -> None:
        """The mbarrier modes' wait: arrive on the buffer's mbarrier expecting every block's
        `live` values, then wait for its parity."""
        k = self._k
        bar = get_llvm_ptr(k.shared_address(bars), slots.which, "i64")
        nbytes = k.cluster * live * 4  # the row's state from every block
        if_then(k.thread_id() < 1, lambda: arrive_expect_tx(bar, nbytes))
        if phase is None:
            wait_parity(bar, 0)
        else:  # bar and parity rederived from phase: nothing extra held across the wait
            derive = _buffer_and_parity(self.buffers)
            buffers, shift = self.buffers, self.buffers.bit_length() - 1

            def meaning(base, word):  # `derive`, for the interpreter
                return base + (word & (buffers - 1)) * 8, word >> shift

            wait_parity_derived(k.shared_address(bars), phase, derive, meaning)

    def _mbarriers(self) -> str:
        """Fresh mbarriers for one place of the exchange (one per buffer, one arrival a
        phase), initialised at cluster start; the shared array's name."""
        k = self._k
        name = k.shared_array(self.buffers, "i64")
        with k.at_cluster_start():  # initialised before the block announces it has started

            def init() -> None:
                bars = k.shared_address(name)
                for h in range(self.buffers):
                    mbarrier_init(get_llvm_ptr(bars, h, "i64"), 1)
                fence_mbarrier_init()

            if_then(k.thread_id() < 1, init)
        return name


class LaggedExchange:
    """One place of a lagged exchange in a row loop (ClusterExchange.lagged): its buffers and
    mbarriers, shared by the `send` of each row and the `receive` of it a row later."""

    def __init__(self, ex: ClusterExchange, n: int):
        k = ex._k
        self.ex, self.n = ex, n
        self.buffer = k.shared(ex.buffers * k.cluster * n)
        self.bars = ex._mbarriers()

    def send(self, state: list[V], phase: V, lane: V | None = None) -> None:
        """Send this row's block result (as ClusterExchange.reduce) to the cluster's blocks
        and return without waiting; `receive` with the same phase takes the row's result,
        after the next row's `send`."""
        self._check(state)
        lane = self.ex._k.thread_id() if lane is None else lane
        self.ex._send(state, _Slots(self.ex, self.n, phase, self.buffer), lane, self.bars)

    def receive(self, phase: V, merge: Merge, sent: V | None = None) -> list[V]:
        """Wait for the row sent with `phase` and merge its n values in rank order. `sent`
        (i1, the same in the whole block): whether that row was sent at all; where not,
        nothing is waited for nor read (the slots may be taking a peer's st.async of the
        next row: reading them would race it) and the n values are zeros (the backward's row
        before the first: its stores are off and its terms zero)."""
        slots = _Slots(self.ex, self.n, phase, self.buffer)

        def received() -> list[V]:
            self.ex._wait(self.n, phase, slots, self.bars)
            return slots.merge([const(0.0)] * self.n, merge)  # every value was sent: _check

        if sent is None:
            return received()
        return if_else(sent, received, lambda: [const(0.0)] * self.n)

    def _check(self, state: list[V]) -> None:
        """Every row sends all n values (the bytes a receive waits for count on it)."""
        if len(state) != self.n or not all(isinstance(v, V) for v in state):
            raise ValueError(f"a lagged exchange sends {self.n} values a row, got {state!r}")


class _Slots:
    """One exchange's buffer in each block: [buffer][rank][value] f32, and the buffer this use
    takes."""

    def __init__(self, ex: ClusterExchange, n: int, phase: V | None, buffer: V | None = None):
        k = ex._k
        self.n, self.cluster = n, k.cluster
        size = k.cluster * n
        self.buffer = k.shared(ex.buffers * size) if buffer is None else buffer
        self.which = ex.buffer(phase)
        self.base = self.which * size

    def slot(self, rank: V | int, j: int) -> V:
        """Where block `rank` puts value j of the row's state."""
        return get_llvm_ptr(self.buffer, self.base + rank * self.n + j, "f32")

    def merge(self, state: list[V], merge: Merge) -> list[V]:
        """Merge the cluster's states of this thread's row in rank order (uniform entries of
        `state`, Python floats, were never sent: every block holds the same)."""

        def block_state(r: int) -> list[V]:
            return [
                load(self.slot(r, j), "f32") if isinstance(v, V) else v for j, v in enumerate(state)
            ]

        total = block_state(0)
        for r in range(1, self.cluster):
            total = merge(total, block_state(r))
        return total
