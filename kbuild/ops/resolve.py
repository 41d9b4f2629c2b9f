"""The C++ hot path's one call into Python: from what a call needs to a kernel's launch record.

The extension (kbuild/native/kbuild_native.cpp) keys its kernels by (kernel, N, dtype,
weight dtype, aux dtype, flags, eps, RMSNorm's weight offset, aligned, device). On a miss it
calls `resolve` with those fields; this turns them into the kernel table's parameter values,
exactly as the Python launch functions (ops/rmsnorm.py, layernorm.py, encoder.py's bias_grad)
do (a CPU test holds the two to the same specs and launches), loads the kernel through
`launcher_for` (the memory and disk tiers), and returns what a launch needs: the driver
function handle, block, shared memory, grid shape and the argument slots in the table's
order.
"""

from __future__ import annotations

from ..kernels.table import KERNELS as TABLE
from ..spec import Scalar
from . import encoder
from .launch import launcher_for

# The extension's kernel codes, in order (its `kernel_names`; a test compares them).
NATIVE_KERNELS = (
    "rmsnorm_fwd", "fused_add_rmsnorm_fwd", "layernorm_fwd", "rmsnorm_bwd",
    "fused_add_rmsnorm_bwd", "layernorm_bwd", "column_sum", "bias_grad",
)  # fmt: skip
KERNELS = {name: TABLE[name] for name in NATIVE_KERNELS}
# Flag bits of a key, and the argument slots (the extension's `slot_names`, in its order).
STATS, DW, DB, DRES, RES32, STRIDED = 1, 2, 4, 8, 16, 32
SLOT_NAMES = (
    "x", "weight", "bias", "residual", "y", "residual_out", "mean", "rstd", "dy",
    "dresidual_out", "dx", "dw_partial", "db_partial", "M", "partial", "out", "out1", "R",
    "dout", "rows_per_chunk", "dresidual", "x_group", "x_stride", "x_group_magic",
)  # fmt: skip
SLOTS = {name: i for i, name in enumerate(SLOT_NAMES)}


def values(
    kernel: str,
    N: int,
    dtype: str,
    weight: str | None,
    aux: str | None,
    flags: int,
    eps: float,
    aligned: bool,
    offset: float = 0.0,
) -> tuple[Scalar, ...]:
    """The kernel table's parameter values (its order) for a key's fields. `aux` is the bias
    dtype (layernorm_fwd) or the residual dtype (fused forms); for column_sum, `flags` is the
    number of planes; `offset` is RMSNorm's weight offset; RES32: the fused forms' fp32
    residual stream (read in fp32, its gradient written in fp32); STRIDED: RMSNorm's x read
    in place at a two-level stride (x_group, x_stride and x_group_magic follow M)."""
    res32 = "f32" if flags & RES32 else None
    strided = (True,) if flags & STRIDED else ()  # out of the table's values when False
    if kernel == "rmsnorm_fwd":
        return (N, dtype, weight, bool(flags & STATS), eps, aligned, offset, *strided)
    if kernel == "fused_add_rmsnorm_fwd":
        return (N, dtype, weight, aux, bool(flags & STATS), eps, aligned, offset, res32)
    if kernel == "layernorm_fwd":
        return (N, dtype, weight, aux, bool(flags & STATS), eps, aligned)
    if kernel == "rmsnorm_bwd":
        return (N, dtype, weight, bool(flags & DW), aligned, offset, *strided)
    if kernel == "fused_add_rmsnorm_bwd":
        dres, dw = bool(flags & DRES), bool(flags & DW)
        return (N, dtype, weight, aux, dres, dw, aligned, offset, res32)
    if kernel == "layernorm_bwd":
        return (N, dtype, weight, bool(flags & DW), bool(flags & DB), aligned)
    if kernel == "column_sum":
        return (N, dtype, flags)
    if kernel == "bias_grad":
        return (N, dtype, aligned)
    raise ValueError(f"kbuild native: unknown kernel {kernel!r}")


def launch_record(launcher, name: str, units: int = 1) -> tuple:
    """What the extension keeps of a loaded kernel (see Record in kbuild_native.cpp)."""
    missing = [name for name in launcher.names if name not in SLOTS]
    if missing:  # e.g. a trace build: the hot path launches production kernels only
        raise ValueError(f"kbuild native: no argument slot for {missing} of {launcher.names}")
    return (
        launcher.function_handle,
        launcher.block,
        launcher.dynamic_shared,
        launcher.cluster,
        launcher.rows_per_block,
        launcher.resident_clusters,
        launcher.meta.get("grid") == "persistent",
        int(launcher.meta.get("columns_per_block", 1)),
        [SLOTS[name] for name in launcher.names],
        name,
        units,  # the device's multiprocessors, for kernels whose grid is sized by them
    )


def resolve(kernel, device, N, dtype, weight, aux, flags, eps, aligned, offset=0.0) -> tuple:
    vals = values(kernel, N, dtype, weight, aux, flags, eps, aligned, offset)
    kdef = KERNELS[kernel]
    units = encoder._units(device) if kernel == "bias_grad" else 1
    return launch_record(launcher_for(kdef, device, vals), kdef.spec(*vals).short(), units)
