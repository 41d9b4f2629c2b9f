"""The interpreter as a launch backend: what `kbuild.jit` loads in place of a driver module
when `KBUILD_INTERPRET` is set, with the attributes the launch path reads of a CUDA one."""

from __future__ import annotations

import functools
import os
import threading

from ..runtime.prepared import fewest_clusters
from ..spec import KernelSpec
from ..targets import Target, target_for_arch
from .machine import run
from .memory import ALLOCATIONS
from .program import Program

# The emulated device: few SMs, so persistent kernels walk several row groups a block at the
# small shapes CPU tests use (a fixed count: the reduction order of dw is fixed by it).
SMS = 4
THREADS_PER_SM = 2048
BLOCKS_PER_SM = 32
SHARED_PER_SM = 228 * 1024


def from_lowered() -> bool:
    """KBUILD_INTERPRET_LOWERED=1: run the lowered module (NVVM / ROCDL) instead of the
    builder's, so the lowering's own ops execute too."""
    return os.environ.get("KBUILD_INTERPRET_LOWERED", "") not in ("", "0")


def interpret_target() -> Target:
    """The target the interpreted kernels are built for: KBUILD_INTERPRET names an arch
    (sm_90, gfx942, ...); "1" means sm_90."""
    value = os.environ.get("KBUILD_INTERPRET", "")
    return target_for_arch("sm_90" if value in ("", "0", "1") else value)


def track(tensor) -> None:
    """Tell the interpreter's allocation table about a CPU tensor (data_ptr does, while the
    interpreter is on): its bytes are then valid global memory for kernels."""
    ALLOCATIONS.note(tensor)


def track_data_ptr() -> None:
    """Make `torch.Tensor.data_ptr` note each CPU tensor it is asked about in the allocation
    table (the launch path's pointers come from it); done once, when KBUILD_INTERPRET is on."""
    import torch

    if getattr(torch.Tensor.data_ptr, "_kbuild_tracked", False):
        return
    plain = torch.Tensor.data_ptr

    def data_ptr(self):
        if self.device.type == "cpu":
            ALLOCATIONS.note(self)
        return plain(self)

    data_ptr._kbuild_tracked = True
    torch.Tensor.data_ptr = data_ptr


_built: dict[tuple, tuple[Program, dict]] = {}
_lock = threading.Lock()


def program_for(spec: KernelSpec, target: Target, lowered: bool = False) -> tuple[Program, dict]:
    """(the kernel as closures, its launch metadata), built once per process."""
    key = (spec.canonical_json(), target.arch, lowered)
    with _lock:
        got = _built.get(key)
        if got is None:
            from ..compiler import _lowered, build, kernel_meta

            kernel = build(spec, target)
            meta = kernel_meta(kernel, spec, target)
            with kernel.context:
                if lowered:
                    from mlir import ir

                    text = _lowered(kernel, spec, target)
                    module = ir.Module.parse(text)
                    program = Program(module.operation, kernel.name)
                else:
                    program = Program(kernel.module.operation, kernel.name)
            got = _built[key] = (program, meta)
    return got


class Launcher:
    """A kernel "loaded" on the interpreter's device: the launch path's view of it."""

    function_handle = 0  # no driver function: the C++ hot path stays off under the interpreter

    def __init__(self, spec: KernelSpec, target: Target, lowered: bool | None = None) -> None:
        lowered = from_lowered() if lowered is None else lowered
        self.program, self.meta = program_for(spec, target, lowered)
        self.target = target
        self.block = int(self.meta["block"])
        self.rows_per_block = int(self.meta.get("rows_per_block", 1))
        self.cluster = int(self.meta.get("cluster", 1))
        self.dynamic_shared = int(self.meta.get("dynamic_shared_bytes", 0))
        self.names = [name for name, _ in self.meta["signature"]]
        shared = self.meta.get("shared_bytes", 0) + self.dynamic_shared
        per_sm = min(BLOCKS_PER_SM, THREADS_PER_SM // self.block)
        if shared:
            per_sm = min(per_sm, SHARED_PER_SM // shared)
        self.resident_blocks = max(1, per_sm) * SMS
        self.resident_clusters = max(1, self.resident_blocks // self.cluster)
        self.resident_clusters = max(self.resident_clusters, fewest_clusters(self.meta))

    def __call__(self, grid, stream: int, *args) -> None:
        if len(args) != len(self.names):
            raise TypeError(f"kernel takes {', '.join(self.names)}; got {len(args)} arguments")
        run(self.program, grid, args, self.target.warp_size, self.dynamic_shared)


@functools.cache
def _cached_launcher(spec: KernelSpec, arch: str, lowered: bool) -> Launcher:
    return Launcher(spec, target_for_arch(arch), lowered)


def launcher_for(spec: KernelSpec, target: Target | None = None, lowered: bool = False):
    """The interpreted launcher of `spec` (its `meta`, `cluster`, `rows_per_block`: what a
    grid is computed from), built once per process."""
    return _cached_launcher(spec, (target or interpret_target()).arch, lowered)


def run_spec(spec: KernelSpec, grid, *args, target: Target | None = None, lowered=False):
    """Run the kernel `spec` over `grid` blocks with `args` (tensors for pointers, ints):
    for sm_90 unless `target` says, from the builder's module, or the lowered one."""
    import torch

    launcher = launcher_for(spec, target, lowered)
    values = []
    for a in args:
        if isinstance(a, torch.Tensor):
            track(a)
            values.append(a.data_ptr())
        else:
            values.append(a)
    launcher(grid, 0, *values)
    return launcher
