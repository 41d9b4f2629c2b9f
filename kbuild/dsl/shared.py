"""Shared memory a kernel sizes at build time: arrays declared statically while they fit and
dynamically past that (`shared_array`), and per-thread slots used without barriers
(`ThreadShared`: dw/db partials, parameters a persistent block holds, staged rows)."""

from __future__ import annotations

from ..dtypes import ELEMENT_BYTES
from .kernel import Kernel
from .memory import get_llvm_ptr, load, store
from .values import V, describe, dtype_name, join, need_int, split

STATIC_SHARED_BYTES = 40 * 1024  # with the row sums' slots, under the 48 KB static limit


def shared_array(k: Kernel, count: int, dtype: str, static_bytes: int = STATIC_SHARED_BYTES) -> V:
    """A shared array of `count` elements: declared statically while the kernel's static
    shared memory stays within `static_bytes`, past that as dynamic shared memory (reserved
    at launch; see Kernel.dynamic_shared)."""
    dtype_name(dtype, "dsl.shared_array", ELEMENT_BYTES)
    count = need_int(count, "dsl.shared_array", "count")
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
        fn = "ThreadShared"
        dtype_name(dtype, fn, ELEMENT_BYTES)
        n, width = need_int(n, fn, "n"), need_int(width, fn, "width")
        self.k, self.n, self.dtype, self.width = k, n, dtype, width
        self.sub = min(width, 16 // ELEMENT_BYTES[dtype])  # elements per piece
        if width % self.sub:
            raise ValueError(
                f"{fn}: width must be a multiple of {self.sub} ({dtype}: 16 bytes), got {width}"
            )
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

    def _index(self, i: int, fn: str) -> None:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n:
            raise ValueError(f"{fn}: i must be an int in [0, {self.n}), got {describe(i)}")

    def get(self, i: int) -> V:
        self._index(i, "ThreadShared.get")
        return join([load(ptr, self.dtype, self.sub) for ptr in self._slots(i)])

    def slot(self, i: int) -> V:
        """The address of value i, when it is one 16-byte piece (an async copy's target)."""
        self._index(i, "ThreadShared.slot")
        if self.pieces != 1 or self.sub * ELEMENT_BYTES[self.dtype] != 16:
            raise ValueError("a single-slot value must be 16 bytes")
        return self._slots(i)[0]

    def put(self, i: int, value: V) -> None:
        fn = "ThreadShared.put"
        self._index(i, fn)
        want = f"vector<{self.width}x{self.dtype}>" if self.width > 1 else self.dtype
        if not isinstance(value, V) or str(value.type) != want:
            raise TypeError(
                f"{fn}: value must be a {want} (the slots' type), got {describe(value)}"
            )
        for ptr, piece in zip(self._slots(i), split(value, self.sub), strict=True):
            store(piece, ptr)
