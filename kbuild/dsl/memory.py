"""Global and shared memory access through raw LLVM pointers.

`get_llvm_ptr(base, offset, dtype)` is base + offset * sizeof(dtype) with a 64-bit offset, so
tensors past 2^31 elements index correctly. Vector loads and stores carry an explicit
alignment: with 16 bytes LLVM emits one 128-bit access (`ld.global.v4.b32` on NVIDIA),
without it the access is split into scalars.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import llvm, nvvm

from ..dtypes import ELEMENT_BYTES
from .values import (
    V,
    _const,
    cast,
    describe,
    element_bytes,
    need_float,
    need_int,
    need_int_scalar,
    need_numeric,
    need_v,
    scalar_type,
    vector_type,
)

_DYNAMIC = -(2**31)  # GEPOp's marker for "this index is a dynamic operand"
_SPACES = {1: "global", 3: "shared", 7: "cluster shared"}


def need_pointer(ptr: V, fn: str, what: str = "ptr", space: int | None = None) -> llvm.PointerType:
    """The type of `ptr`, a pointer V (in address space `space` where given)."""
    t = need_v(ptr, fn, what).type
    if not isinstance(t, llvm.PointerType):
        raise TypeError(
            f"{fn}: {what} must be a pointer (k.ptr, dsl.get_llvm_ptr, k.shared), got {t}"
        )
    if space is not None and t.address_space != space:
        raise TypeError(
            f"{fn}: {what} must point to {_SPACES.get(space, space)} memory ({space}), got {t}"
        )
    return t


_STORABLE = tuple(ELEMENT_BYTES)  # f32, f16, bf16, i8, i32, i64


def _dtype(dtype: str, fn: str) -> str:
    """`dtype` if memory holds it (a key of ELEMENT_BYTES), else a TypeError / ValueError."""
    if not isinstance(dtype, str):
        raise TypeError(f"{fn}: a dtype is a string such as 'f32', got {describe(dtype)}")
    if dtype not in ELEMENT_BYTES:
        raise ValueError(f"{fn}: unknown dtype {dtype!r}; one of {', '.join(_STORABLE)}")
    return dtype


def get_llvm_ptr(base: V, offset: V | int, dtype: str) -> V:
    """Address of element `offset` (i64) of a `dtype` array starting at `base`."""
    fn = "dsl.get_llvm_ptr"
    base_type = need_pointer(base, fn, "base")
    element = scalar_type(_dtype(dtype, fn))
    if isinstance(offset, int):
        offset = _const(offset, "i64", fn)
    elif need_int_scalar(offset, fn, "offset").type != scalar_type("i64"):
        offset = cast(offset, "i64", fn)
    gep = llvm.GEPOp(
        base_type,
        base.value,
        [offset.value],
        [_DYNAMIC],
        element,
        llvm.GEPNoWrapFlags.none,
    )
    return V(gep.result)


def _align(dtype: str, width: int, aligned: bool) -> int:
    """Largest power-of-two alignment the access may assume (capped at 16 bytes)."""
    size = element_bytes(dtype) * width
    if not aligned:
        return element_bytes(dtype)
    return min(16, size & -size)


def load(ptr: V, dtype: str, width: int = 1, aligned: bool = True) -> V:
    """Load `width` elements (a vector when width > 1) of `dtype`."""
    fn = "dsl.load"
    need_pointer(ptr, fn)
    _dtype(dtype, fn)
    width = need_int(width, fn, "width")
    t = vector_type(dtype, width) if width > 1 else scalar_type(dtype)
    return V(llvm.LoadOp(t, ptr.value, alignment=_align(dtype, width, aligned)).result)


def store(value: V, ptr: V, aligned: bool = True) -> None:
    """Store `value` (a scalar or a vector of f32, f16, bf16, i8, i32 or i64) at `ptr`."""
    fn = "dsl.store"
    t = need_numeric(value, fn, "value")
    need_pointer(ptr, fn)
    elem = t.element_type if isinstance(t, ir.VectorType) else t
    dtype = {ir.F32Type: "f32", ir.F16Type: "f16", ir.BF16Type: "bf16"}.get(type(elem))
    if isinstance(elem, ir.IntegerType):
        dtype = f"i{elem.width}"
    if dtype not in _STORABLE:
        hint = " (a flag: dsl.select(flag, 1, 0) on an i8 or i32 first)" if dtype == "i1" else ""
        raise TypeError(
            f"{fn}: stores {', '.join(_STORABLE)} values or vectors of them, got {t}{hint}"
        )
    llvm.StoreOp(value.value, ptr.value, alignment=_align(dtype, value.width, aligned))


def atomic_add(ptr: V, value: V) -> None:
    """Relaxed fp32 atomic add (never on a default path: it is not deterministic)."""
    fn = "dsl.atomic_add"
    need_pointer(ptr, fn)
    if need_float(value, fn, "value") != scalar_type("f32"):
        raise TypeError(f"{fn}: adds an f32 scalar, got {value.type}")
    llvm.AtomicRMWOp(llvm.AtomicBinOp.fadd, ptr.value, value.value, llvm.AtomicOrdering.monotonic)


# ---------------------------------------------------------------------- asynchronous copies
# NVIDIA only: kernels ask the Target (`l2_prefetch`, `async_copy`) before using these.


def prefetch_l2(ptr: V, nbytes: V | int) -> None:
    """Start bringing `nbytes` (a multiple of 16) of global memory at `ptr` (16-byte aligned)
    into L2, without waiting and without registers (sm_90 `cp.async.bulk.prefetch.L2`): one
    thread can ask for a whole row slice ahead of its loads."""
    fn = "dsl.prefetch_l2"
    need_pointer(ptr, fn, space=1)
    if isinstance(nbytes, int):
        if nbytes <= 0 or nbytes % 16:
            raise ValueError(f"{fn}: nbytes must be a positive multiple of 16, got {nbytes}")
        size = _const(nbytes, "i32", fn)
    else:
        size = cast(need_int_scalar(nbytes, fn, "nbytes"), "i32", fn)
    nvvm.CpAsyncBulkPrefetchOp(ptr.value, size.value)


def copy_async(shared_dst: V, global_src: V) -> None:
    """Start a 16-byte copy from global to shared memory that bypasses registers (and L1):
    `cp.async.cg`, sm_80 on. It lands after `wait_async`."""
    need_pointer(shared_dst, "dsl.copy_async", "shared_dst", space=3)
    need_pointer(global_src, "dsl.copy_async", "global_src", space=1)
    nvvm.CpAsyncOp(shared_dst.value, global_src.value, 16, nvvm.LoadCacheModifierKind.CG)


def commit_async() -> None:
    """Close the group of `copy_async`s this thread issued since the last commit."""
    nvvm.CpAsyncCommitGroupOp()


def wait_async(pending: int = 0) -> None:
    """Wait until at most `pending` committed groups of this thread are still in flight; the
    finished copies are then visible to this thread (others need a barrier too)."""
    nvvm.CpAsyncWaitGroupOp(need_int(pending, "dsl.wait_async", "pending", low=0))
