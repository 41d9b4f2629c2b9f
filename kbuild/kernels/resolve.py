"""The C++ hot path's one call into Python: from a key's parameter values to a launch record.

The extension (kbuild/native/kbuild_native.cpp) keys its kernels by (kernel, device, the
kernel table's parameter values), each value set by its parameter's name (launch.h Value,
whose names and kinds a CPU test holds equal to the table's). On a miss it calls `resolve`
with the values it set, by name, decoded to their Python kinds. The values are those the
Python launch functions give (kernels/norms/rmsnorm.py, layernorm.py, encoder.py's bias_grad; a CPU
test holds the two paths to the same specs and launches); this turns them into the table's
positional values (its defaults for what is not set), loads the kernel through `launcher_for`
(the memory and disk tiers) and returns what a launch needs, by field name (`Record`): the
driver function handle, block, shared memory, grid shape and the argument slots in the
table's order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..op.launch import launcher_for, record_fields
from ..registry import KERNELS as TABLE
from ..registry import KernelDef
from ..spec import Scalar
from .llmc import launch as llmc_launch

# The extension's kernel codes, in order (its `kernel_names`; a test compares them).
NATIVE_KERNELS = (
    "rmsnorm_fwd", "fused_add_rmsnorm_fwd", "layernorm_fwd", "rmsnorm_bwd",
    "fused_add_rmsnorm_bwd", "layernorm_bwd", "column_sum", "bias_grad",
)  # fmt: skip
KERNELS = {name: TABLE[name] for name in NATIVE_KERNELS}
# The argument slots (the extension's `slot_names`, in its order).
SLOT_NAMES = (
    "x", "weight", "bias", "residual", "y", "residual_out", "mean", "rstd", "dy",
    "dresidual_out", "dx", "dw_partial", "db_partial", "M", "partial", "out", "out1", "R",
    "dout", "rows_per_chunk", "dresidual", "x_group", "x_stride", "x_group_magic",
)  # fmt: skip
SLOTS = {name: i for i, name in enumerate(SLOT_NAMES)}
# The parameters of the native kernels and their kinds, in the order they first appear: the
# extension's `value_names` and `value_kinds` (a test compares them).
VALUE_KINDS = {p.name: p.kind for kernel in KERNELS.values() for p in kernel.params}


@dataclass(frozen=True)
class Record:
    """What the extension keeps of a loaded kernel (Record in kbuild/native/launch.h), read
    there by field name once per key."""

    function_handle: int  # the driver's CUfunction
    block: int  # threads per block
    shared: int  # dynamic shared memory, bytes
    cluster: int  # blocks per cluster
    rows_per_block: int
    resident_clusters: int  # clusters the device holds at once (a persistent grid's size)
    persistent: bool  # grid: min(row groups, resident clusters) clusters, else one per group
    columns_per_block: int  # columns a block sums (column_sum and bias_grad: their grids)
    slots: tuple[int, ...]  # the launch arguments' slots (SLOT_NAMES), in the table's order
    name: str  # the spec's short name, for messages (and the CPU tests' launch hook)
    units: int  # the device's multiprocessors where they size the grid (bias_grad), else 1


def table_values(kernel: KernelDef, values: Mapping[str, Scalar]) -> tuple[Scalar, ...]:
    """The table's positional values for parameter values given by name: the table's default
    for a parameter not given, and none past the last one given, as the Python launch
    functions leave them (their memory-tier key: a process running both paths loads a kernel
    once)."""
    names = [p.name for p in kernel.params]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(
            f"kbuild native: {kernel.name} has no parameter {unknown}; it takes {names}"
        )
    last = max((i for i, name in enumerate(names) if name in values), default=-1)
    return tuple(values.get(p.name, p.default) for p in kernel.params[: last + 1])


def launch_record(launcher, name: str, units: int = 1) -> Record:
    """What the extension keeps of a loaded launcher (runtime/cuda.py Launcher)."""
    missing = [name for name in launcher.names if name not in SLOTS]
    if missing:  # e.g. a trace build: the hot path launches production kernels only
        raise ValueError(f"kbuild native: no argument slot for {missing} of {launcher.names}")
    return Record(
        **record_fields(launcher),
        columns_per_block=int(launcher.meta.get("columns_per_block", 1)),
        slots=tuple(SLOTS[name] for name in launcher.names),
        name=name,
        units=units,
    )


def resolve(kernel: str, device: int, values: Mapping[str, Scalar]) -> Record:
    """The launch record of `kernel` with these parameter values (by name) on `device`."""
    kdef = KERNELS[kernel]
    positional = table_values(kdef, values)
    name = kdef.spec(**values).short()  # the table's checks: a value missing or of a wrong kind
    # Only the bias gradient's grid is sized by the multiprocessors: no device query for the
    # others.
    units = llmc_launch.multiprocessors(device) if kernel == "bias_grad" else 1
    return launch_record(launcher_for(kdef, device, positional), name, units)
