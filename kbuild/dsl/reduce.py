"""Reductions across the threads that share a row: warp shuffles, then shared memory, then
(for a row split over a cluster of blocks) distributed shared memory, through the kernel's
cluster exchange (dsl.exchange: a cluster barrier, or `st.async` stores counted by mbarriers).

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

from mlir import ir
from mlir.dialects import gpu, vector

from .control import if_then
from .exchange import Merge
from .kernel import Kernel
from .math import exp
from .memory import get_llvm_ptr, load, store
from .values import (
    NEG_INF,
    V,
    _element_type,
    describe,
    eq,
    hsum,
    i32,
    maximum,
    ne,
    need_int,
    need_numeric,
    select,
)


def _exchange(v: V | float, offset: int, width: V) -> V | float:
    if not isinstance(v, V):
        return v  # uniform: the partner holds the same
    return V(gpu.ShuffleOp(v.value, i32(offset).value, width.value, gpu.ShuffleMode.XOR).results[0])


def _states(a: list[V], b: list[V], fn: str, size: int | None = None) -> None:
    """Two states of one merge: lists of equal length (`size` where the merge fixes it)."""
    for what, s in (("a", a), ("b", b)):
        if not isinstance(s, (list, tuple)):
            raise TypeError(f"{fn}: {what} must be a list of values (a state), got {describe(s)}")
    if len(a) != len(b) or size is not None and len(a) != size:
        want = f"{size} values each" if size is not None else "states of one length"
        raise ValueError(f"{fn}: merges {want}, got {len(a)} and {len(b)}")


def add(a: list[V], b: list[V]) -> list[V]:
    """The merge of a sum: value by value."""
    _states(a, b, "dsl.add")
    return [x + y for x, y in zip(a, b, strict=True)]


def largest(a: list[V], b: list[V]) -> list[V]:
    """The merge of a maximum: value by value (a NaN wins, as in torch; pad with NEG_INF)."""
    _states(a, b, "dsl.largest")
    return [maximum(x, y) for x, y in zip(a, b, strict=True)]


def softmax_pair(a: list[V], b: list[V]) -> list[V]:
    """The merge of an online softmax's state [m, s]: the running maximum and the sum of
    exp(x - m) over the values seen. Merged: m = max(m_a, m_b), s = s_a * exp(m_a - m) +
    s_b * exp(m_b - m), symmetric bit for bit (the two products are added in either order).
    A side that has seen only padding (m = -inf, s = 0) adds nothing: its exp(-inf - m) is 0,
    and where both are -inf the difference is taken as 0, not NaN."""
    _states(a, b, "dsl.softmax_pair", 2)
    (ma, sa), (mb, sb) = a, b
    m = maximum(ma, mb)
    safe = select(eq(m, NEG_INF), 0.0, m)
    return [m, sa * exp(ma - safe) + sb * exp(mb - safe)]


def first_largest(a: list[V], b: list[V]) -> list[V]:
    """The merge of an argmax's state [value, index] (index as f32, exact below 2^24): the
    larger value, and of equal values the smaller index (torch.argmax's first maximum); a NaN
    beats every number, as in torch, and of two NaNs the smaller index wins. Symmetric, so
    every lane ends with the same pair."""
    _states(a, b, "dsl.first_largest", 2)
    (va, ia), (vb, ib) = a, b
    a_nan, b_nan = ne(va, va), ne(vb, vb)
    first = ib < ia
    numbers = ~a_nan & ~b_nan & ((vb > va) | (eq(vb, va) & first))
    take_b = (b_nan & (~a_nan | first)) | numbers
    return [select(take_b, vb, va), select(take_b, ib, ia)]


def _thread_values(values: list[V] | V, fn: str) -> list[V]:
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    if not values:
        raise ValueError(f"{fn}: takes at least one value, got an empty list")
    for i, v in enumerate(values):
        need_numeric(v, fn, f"value {i}")
    return values


def thread_sum(values: list[V] | V) -> V:
    """The sum of every lane of a thread's values (its vectors of a row): added vector by
    vector, then across the lanes; the per-thread partial of a row sum."""
    values = _thread_values(values, "dsl.thread_sum")
    total = values[0]
    for v in values[1:]:
        total = total + v
    return hsum(total)


def thread_max(values: list[V] | V) -> V:
    """The largest lane of a thread's values: the per-thread partial of a row maximum."""
    values = _thread_values(values, "dsl.thread_max")
    top = values[0]
    for v in values[1:]:
        top = maximum(top, v)
    if top.width == 1:
        return top
    kind = vector.CombiningKind.MAXIMUMF if top.is_float else vector.CombiningKind.MAXSI
    return V(vector.reduction(_element_type(top.type), kind, top.value))


def _group(group: int, k: Kernel, fn: str, what: str) -> None:
    group = need_int(group, fn, what)
    if group & (group - 1) or group > k.warp_size:
        raise ValueError(
            f"{fn}: {what} must be a power of two up to the warp size ({k.warp_size}), got {group}"
        )


def group_reduce(k: Kernel, state: list[V], group: int, merge: Merge = add) -> list[V]:
    """Merge a state across aligned groups of `group` lanes (a power of two <= warp size);
    butterfly (xor) shuffles leave the result in every lane of the group."""
    _group(group, k, "dsl.group_reduce", "group")
    for i, v in enumerate(state):  # entries that are numbers are uniform: never shuffled
        if isinstance(v, V):
            t = _element_type(need_numeric(v, "dsl.group_reduce", f"state value {i}"))
            if isinstance(t, ir.IndexType):
                raise TypeError(f"dsl.group_reduce: state value {i} is an index: cast it first")
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
    reads them. A call in a loop may pass `phase` (the row loop's phase, i32) instead: the
    slots alternate between two halves (`k.exchange.half(phase)`), so the next write to a half
    comes a barrier later, after every warp's reads of it. Which of the two a row split over a
    cluster needs is its exchange's call (ClusterExchange.block_slots).
    """
    threads_per_row = need_int(threads_per_row, "dsl.row_reduce", "threads_per_row")
    if threads_per_row > k.warp_size and threads_per_row % k.warp_size:
        raise ValueError(
            f"dsl.row_reduce: threads_per_row beyond a warp must be whole warps of "
            f"{k.warp_size}, got {threads_per_row}"
        )
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
        half = k.exchange.half(phase) * (rows * warps)
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
