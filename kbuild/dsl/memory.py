"""Global and shared memory access through raw LLVM pointers.

`get_llvm_ptr(base, offset, dtype)` is base + offset * sizeof(dtype) with a 64-bit offset, so
tensors past 2^31 elements index correctly. Vector loads and stores carry an explicit
alignment: with 16 bytes LLVM emits one 128-bit access (`ld.global.v4.b32` on NVIDIA),
without it the access is split into scalars.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import llvm, nvvm

from .values import V, cast, const, element_bytes, scalar_type, vector_type

_DYNAMIC = -(2**31)  # GEPOp's marker for "this index is a dynamic operand"


def get_llvm_ptr(base: V, offset: V | int, dtype: str) -> V:
    """Address of element `offset` (i64) of a `dtype` array starting at `base`."""
    if isinstance(offset, int):
        offset = const(offset, "i64")
    elif offset.type != scalar_type("i64"):
        offset = cast(offset, "i64")
    gep = llvm.GEPOp(
        base.type,
        base.value,
        [offset.value],
        [_DYNAMIC],
        scalar_type(dtype),
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
    t = vector_type(dtype, width) if width > 1 else scalar_type(dtype)
    return V(llvm.LoadOp(t, ptr.value, alignment=_align(dtype, width, aligned)).result)


def store(value: V, ptr: V, aligned: bool = True) -> None:
    t = value.type
    elem = t.element_type if isinstance(t, ir.VectorType) else t
    dtype = {ir.F32Type: "f32", ir.F16Type: "f16", ir.BF16Type: "bf16"}.get(type(elem), "f32")
    if isinstance(elem, ir.IntegerType):
        dtype = f"i{elem.width}"
    llvm.StoreOp(value.value, ptr.value, alignment=_align(dtype, value.width, aligned))


def atomic_add(ptr: V, value: V) -> None:
    """Relaxed fp32 atomic add (never on a default path: it is not deterministic)."""
    llvm.AtomicRMWOp(llvm.AtomicBinOp.fadd, ptr.value, value.value, llvm.AtomicOrdering.monotonic)


# ---------------------------------------------------------------------- asynchronous copies
# NVIDIA only: kernels ask the Target (`l2_prefetch`, `async_copy`) before using these.


def prefetch_l2(ptr: V, nbytes: V | int) -> None:
    """Start bringing `nbytes` (a multiple of 16) of global memory at `ptr` (16-byte aligned)
    into L2, without waiting and without registers (sm_90 `cp.async.bulk.prefetch.L2`): one
    thread can ask for a whole row slice ahead of its loads."""
    size = const(nbytes, "i32") if isinstance(nbytes, int) else cast(nbytes, "i32")
    nvvm.CpAsyncBulkPrefetchOp(ptr.value, size.value)


def copy_async(shared_dst: V, global_src: V) -> None:
    """Start a 16-byte copy from global to shared memory that bypasses registers (and L1):
    `cp.async.cg`, sm_80 on. It lands after `wait_async`."""
    nvvm.CpAsyncOp(shared_dst.value, global_src.value, 16, nvvm.LoadCacheModifierKind.CG)


def commit_async() -> None:
    """Close the group of `copy_async`s this thread issued since the last commit."""
    nvvm.CpAsyncCommitGroupOp()


def wait_async(pending: int = 0) -> None:
    """Wait until at most `pending` committed groups of this thread are still in flight; the
    finished copies are then visible to this thread (others need a barrier too)."""
    nvvm.CpAsyncWaitGroupOp(pending)
