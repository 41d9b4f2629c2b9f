"""Reductions across the threads that share a row: warp shuffles, then shared memory, then
(for a row split over a cluster of blocks) distributed shared memory.

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
from .memory import get_llvm_ptr, load, store
from .values import V, const, i32

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
) -> list[V]:
    """Merge a per-thread state over the `threads_per_row` threads of one row.

    Threads of a row are consecutive; a block holds `rows` rows. Up to a warp this is only
    shuffles; beyond, each warp's result goes to shared memory, one barrier, and every thread
    merges the row's warp results in warp order. `reused` (a call inside a loop) adds a
    trailing barrier so the next iteration cannot overwrite the slots while a slow warp still
    reads them.
    """
    group = min(threads_per_row, k.warp_size)
    partial = group_reduce(k, state, group, merge)
    if threads_per_row <= k.warp_size:
        return partial
    warps = threads_per_row // k.warp_size
    tid = k.thread_id()
    warp = tid / k.warp_size  # warp index within the block
    lane = tid % k.warp_size
    slots = [k.shared(rows * warps) if isinstance(v, V) else v for v in partial]

    def write() -> None:
        for slot, p in zip(slots, partial, strict=True):
            if isinstance(p, V):
                store(p, get_llvm_ptr(slot, warp, "f32"))

    if_then(lane < 1, write)
    k.barrier()
    first = row_in_block * warps

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
) -> list[V]:
    """Merge block results (the same in every thread of a block) over a cluster's blocks.

    Block r's first `cluster` threads store its state into slot r of every block's shared
    buffer (distributed shared memory), one cluster barrier, then each thread merges the
    slots in rank order: every block gets the same bits. A call inside a loop passes `phase`
    (iteration % 2, i64): slots alternate between two halves, so a fast block writing the next
    iteration's state never lands on a half a slow block still reads (it would first have to
    pass the barrier of the iteration between, which the slow block reaches only after
    reading). `meanwhile()` runs between arriving at the barrier and waiting on it: work that
    does not need the result hides the wait for the other blocks.
    """
    cluster, n = k.cluster, len(state)
    buffer = k.shared(2 * cluster * n)
    half = const(0, "i64") if phase is None else phase * (cluster * n)
    rank = k.cluster_rank()
    tid = k.thread_id()

    def publish() -> None:  # thread t writes into block t
        for j, v in enumerate(state):
            if isinstance(v, V):
                store(v, k.remote(get_llvm_ptr(buffer, half + rank * n + j, "f32"), tid))

    k.ensure_cluster_started()
    if_then(tid < cluster, publish)
    k.cluster_arrive()
    if meanwhile is not None:
        meanwhile()
    k.cluster_wait()

    def block_state(r: int) -> list[V]:
        return [
            load(get_llvm_ptr(buffer, half + (r * n + j), "f32"), "f32") if isinstance(v, V) else v
            for j, v in enumerate(state)
        ]

    total = block_state(0)
    for r in range(1, cluster):
        total = merge(total, block_state(r))
    return total
