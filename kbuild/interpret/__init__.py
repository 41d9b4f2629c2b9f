"""The interpreter: kbuild's kernel modules run on CPU tensors, thread by thread in lockstep.

    KBUILD_INTERPRET=1 python3 -m pytest ...     # every op's CUDA path, on the CPU

`KBUILD_INTERPRET` (set before kbuild is imported) sends CPU tensors down the path a CUDA
tensor takes: the ops' Python launch code, launch plans, argument binding and autograd, with
this package standing in for the driver. The kernel is the module the builder emits, as it is
compiled (`KBUILD_INTERPRET=1` or `sm_90`: for sm_90; `gfx942`: for gfx942, wave64), before
the target's pipeline; `kbuild.interpret.run_spec` also runs the lowered (NVVM / ROCDL)
module.

What it checks that lockstep would hide or a CPU would not see: out-of-bounds and misaligned
global and shared accesses, barriers reached by part of a block, mbarrier waits that can never
complete, and shared-memory races (accesses no barrier orders): each a `KernelFault` naming
the kernel, the block, the thread and the address.
"""

from __future__ import annotations

from .launcher import Launcher, interpret_target, launcher_for, run_spec, track
from .memory import KernelFault, RaceError

__all__ = [
    "KernelFault",
    "Launcher",
    "RaceError",
    "interpret_target",
    "launcher_for",
    "run_spec",
    "track",
]
