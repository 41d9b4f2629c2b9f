"""Reductions across the threads that share a row: warp shuffles, then shared memory.

Both are sized by the target's warp size (32 on NVIDIA, 64 on CDNA), never by a constant, and
both sum in a fixed order, so a result never depends on timing.
"""

from __future__ import annotations

from mlir.dialects import gpu

from .control import if_then
from .kernel import Kernel
from .memory import get_llvm_ptr, load, store
from .values import V, i32


def group_sum(k: Kernel, value: V, group: int) -> V:
    """Sum an f32 across aligned groups of `group` lanes (a power of two <= warp size).

    Butterfly (xor) shuffles leave the total in every lane of the group.
    """
    width = i32(k.warp_size)
    offset = group // 2
    while offset >= 1:
        other = gpu.ShuffleOp(value.value, i32(offset).value, width.value, gpu.ShuffleMode.XOR)
        value = value + V(other.results[0])
        offset //= 2
    return value


def row_sum(
    k: Kernel,
    values: list[V],
    threads_per_row: int,
    row_in_block: V,
    rows: int,
    reused: bool = False,
) -> list[V]:
    """Sum each f32 in `values` over the `threads_per_row` threads of one row.

    Threads of a row are consecutive; a block holds `rows` rows. Up to a warp this is only
    shuffles; beyond, each warp's partial goes to shared memory, one barrier, and every thread
    adds the row's warp partials in warp order. Several values share one barrier. `reused`
    (a call inside a loop) adds a trailing barrier so the next iteration cannot overwrite the
    slots while a slow warp still reads them.
    """
    group = min(threads_per_row, k.warp_size)
    partial = [group_sum(k, v, group) for v in values]
    if threads_per_row <= k.warp_size:
        return partial
    warps = threads_per_row // k.warp_size
    tid = k.thread_id()
    warp = tid / k.warp_size  # warp index within the block
    lane = tid % k.warp_size
    slots = [k.shared(rows * warps) for _ in values]
    is_lane0 = lane < 1

    def write() -> None:
        for slot, p in zip(slots, partial, strict=True):
            store(p, get_llvm_ptr(slot, warp, "f32"))

    if_then(is_lane0, write)
    k.barrier()
    first = row_in_block * warps
    totals = []
    for slot in slots:
        acc = load(get_llvm_ptr(slot, first, "f32"), "f32")
        for w in range(1, warps):
            acc = acc + load(get_llvm_ptr(slot, first + w, "f32"), "f32")
        totals.append(acc)
    if reused:
        k.barrier()
    return totals
