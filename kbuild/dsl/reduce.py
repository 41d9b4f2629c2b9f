"""Reductions across the threads that share a row: warp shuffles, then shared memory, then
(for a row split over a cluster of blocks) distributed shared memory, through a cluster
barrier or through `st.async` stores counted by mbarriers (see `cluster_reduce`).

Sized by the target's warp size (32 on NVIDIA, 64 on CDNA), never by a constant, and always
combined in a fixed order, so a result never depends on timing. A reduction combines a
*state*, a list of f32 values, with a `merge(a, b) -> state` function: `add` sums each value;
kernels pass their own (LayerNorm's forward merges (count, mean, M2) triples). Butterfly
shuffles merge (a, b) in one lane and (b, a) in its partner, so `merge` must be symmetric
bit for bit (commutative arithmetic is) for every lane to end with the same bits.

A state entry may also be a Python float: a value known to be the same in every thread
(LayerNorm's element count when the row needs no predicates). It is never shuffled or
stored, and the merge folds it at build time.
"""

from __future__ import annotations

from collections.abc import Callable

from mlir.dialects import gpu

from .control import if_then
from .kernel import Kernel
from .mbarrier import (
    arrive_expect_tx,
    fence_mbarrier_init,
    mbarrier_init,
    store_async,
    wait_parity,
    wait_phase,
)
from .memory import get_llvm_ptr, load, store
from .values import V, cast, const, i32

Merge = Callable[[list[V], list[V]], list[V]]


def _exchange(v: V | float, offset: int, width: V) -> V | float:
    if not isinstance(v, V):
        return v  # uniform: the partner holds the same
    return V(gpu.ShuffleOp(v.value, i32(offset).value, width.value, gpu.ShuffleMode.XOR).results[0])


def add(a: list[V], b: list[V]) -> list[V]:
    """The merge of a sum: value by value."""
    return [x + y for x, y in zip(a, b, strict=True)]


def group_reduce(k: Kernel, state: list[V], group: int, merge: Merge = add) -> list[V]:
    """Merge a state across aligned groups of `group` lanes (a power of two <= warp size);
    butterfly (xor) shuffles leave the result in every lane of the group."""
    width = i32(k.warp_size)
    offset = group // 2
    while offset >= 1:
        state = merge(state, [_exchange(v, offset, width) for v in state])
        offset //= 2
    return state


def row_reduce(
    k: Kernel,
    state: list[V],
    threads_per_row: int,
    row_in_block: V,
    rows: int,
    reused: bool = False,
    merge: Merge = add,
    phase: V | None = None,
) -> list[V]:
    """Merge a per-thread state over the `threads_per_row` threads of one row.

    Threads of a row are consecutive; a block holds `rows` rows. Up to a warp this is only
    shuffles; beyond, each warp's result goes to shared memory, one barrier, and every thread
    merges the row's warp results in warp order. `reused` (a call inside a loop) adds a
    trailing barrier so the next iteration cannot overwrite the slots while a slow warp still
    reads them. A call in a loop may pass `phase` (an iteration count, i64) instead: the slots
    alternate between two halves, so the next write to a half comes a barrier later, after
    every warp's reads of it.
    """
    group = min(threads_per_row, k.warp_size)
    partial = group_reduce(k, state, group, merge)
    if threads_per_row <= k.warp_size:
        return partial
    warps = threads_per_row // k.warp_size
    tid = k.thread_id()
    warp = tid / k.warp_size  # warp index within the block
    lane = tid % k.warp_size
    halves = 1 if phase is None else 2
    slots = [k.shared(halves * rows * warps) if isinstance(v, V) else v for v in partial]
    first, mine = row_in_block * warps, warp  # the row's first slot; this warp's
    if phase is not None:
        half = cast(phase % 2, "i64") * (rows * warps)
        first, mine = first + half, mine + half

    def write() -> None:
        for slot, p in zip(slots, partial, strict=True):
            if isinstance(p, V):
                store(p, get_llvm_ptr(slot, mine, "f32"))

    if_then(lane < 1, write)
    k.barrier()

    def warp_state(w: int) -> list[V]:
        return [
            load(get_llvm_ptr(slot, first + w, "f32"), "f32") if isinstance(slot, V) else slot
            for slot in slots
        ]

    total = warp_state(0)
    for w in range(1, warps):
        total = merge(total, warp_state(w))
    if reused:
        k.barrier()
    return total


def cluster_reduce(
    k: Kernel,
    state: list[V],
    phase: V | None = None,
    merge: Merge = add,
    meanwhile: Callable[[], None] | None = None,
    rows: int = 1,
    row: V | None = None,
    lane: V | None = None,
) -> list[V]:
    """Merge block results (the same in every thread of a row of a block) over a cluster's
    blocks. A block may hold `rows` rows: thread `lane` of row `row` (default: the thread
    index; a block of one row).

    Block r's first `cluster` threads of each row store the row's state into slot r of every
    block's shared buffer (distributed shared memory), then each thread merges its row's slots
    in rank order:
    every block gets the same bits. A call inside a loop passes `phase`, the iteration count
    modulo 4 (i64): slots alternate between two halves, so a fast block writing the next
    iteration's state never lands on a half a slow block still reads (it would first need
    that block's state of the iteration between, which the slow block sends only after
    reading). `meanwhile()` runs while the other blocks' states are awaited: work that does
    not need the result.

    How a block learns that the states have arrived is `k.cluster_exchange`:
    - "barrier": plain remote stores and a cluster barrier (arrive, `meanwhile`, wait). The
      arrive releases every earlier store of the thread, global ones included, at cluster
      scope, and the whole cluster steps together.
    - "mbarrier": the states are sent with `st.async`, which counts their bytes against an
      mbarrier in the receiving block (one per half); a block waits only for its own
      mbarrier, with no cluster barrier and no release of its other stores.
    """
    lane = k.thread_id() if lane is None else lane
    slots = _Slots(k, state, phase, rows, row)
    if k.cluster_exchange == "mbarrier":
        return _cluster_reduce_mbarrier(k, state, phase, merge, meanwhile, slots, lane)
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
    return _merge_slots(slots, state, k.cluster, merge)


class _Slots:
    """A cluster exchange's buffer in each block: [half][rank][row][value] f32."""

    def __init__(self, k: Kernel, state: list[V], phase: V | None, rows: int, row: V | None):
        self.n, self.rows = len(state), rows
        size = k.cluster * rows * self.n
        self.buffer = k.shared(2 * size)
        self.which = const(0, "i64") if phase is None else cast(phase % 2, "i64")
        self.base = self.which * size
        if rows > 1:
            self.base = self.base + row * self.n

    def slot(self, rank: V | int, j: int) -> V:
        """Where block `rank` puts value j of this thread's row."""
        return get_llvm_ptr(self.buffer, self.base + rank * (self.rows * self.n) + j, "f32")


def _merge_slots(slots: _Slots, state: list[V], cluster: int, merge: Merge) -> list[V]:
    """Merge the cluster's states of this thread's row in rank order."""

    def block_state(r: int) -> list[V]:
        return [
            load(slots.slot(r, j), "f32") if isinstance(v, V) else v for j, v in enumerate(state)
        ]

    total = block_state(0)
    for r in range(1, cluster):
        total = merge(total, block_state(r))
    return total


def _cluster_reduce_mbarrier(
    k: Kernel,
    state: list[V],
    phase: V | None,
    merge: Merge,
    meanwhile: Callable[[], None] | None,
    slots: _Slots,
    lane: V,
) -> list[V]:
    """cluster_reduce through `st.async` and one mbarrier per half of the buffer.

    Each row, the block's thread 0 arrives on the half's local mbarrier expecting the bytes of
    every block's state; block r's thread t sends its state into block t with `st.async`.
    Bytes that land before the arrival count too, so no ordering between blocks is needed
    beyond the causality the halves already rely on. The i-th use of a half waits for the
    mbarrier phase of parity i % 2, which is `phase // 2` for the iteration count modulo 4.
    """
    cluster = k.cluster
    live = [j for j, v in enumerate(state) if isinstance(v, V)]
    bars_name = k.shared_array(2, "i64")
    with k.at_cluster_start():  # initialised before the block announces it has started

        def init() -> None:
            bars = k.shared_address(bars_name)
            for h in range(2):
                mbarrier_init(get_llvm_ptr(bars, h, "i64"), 1)
            fence_mbarrier_init()

        if_then(k.thread_id() < 1, init)
    bar = get_llvm_ptr(k.shared_address(bars_name), slots.which, "i64")
    rank = k.cluster_rank()
    k.ensure_cluster_started()
    nbytes = cluster * slots.rows * len(live) * 4  # every row's state from every block

    def publish() -> None:  # thread t of a row sends into block t
        for j in live:
            store_async(slots.slot(rank, j), state[j], bar, lane)

    if_then(lane < cluster, publish)
    if meanwhile is not None:
        meanwhile()
    if_then(k.thread_id() < 1, lambda: arrive_expect_tx(bar, nbytes))
    if phase is None:
        wait_parity(bar, 0)
    else:  # bar and parity rederived from phase: nothing extra held across `meanwhile`
        wait_phase(k.shared_address(bars_name), phase)
    # The slots just read are written again by peers' st.async two rows on. No proxy fence
    # orders the two: every thread has consumed its reads before its block's barrier of the
    # next row, and a peer can only send that later row after this block's state of the next
    # row, sent after that barrier. (Measured with and without fence.proxy.async here: no
    # difference.)
    return _merge_slots(slots, state, cluster, merge)
