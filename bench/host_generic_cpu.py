"""Host cost of an op declared with kbuild.Op on the CPU machine (no GPU, no driver): the
example's softmax (examples/custom_softmax.py) through the C++ generic kernel and autograd
kernel (kbuild/native/generic.h) beside its Python launch path and torch.library's Python
autograd.

    python bench/host_generic_cpu.py [out.json]

- "launch": one forward call's host work up to the launch, at (4, 4096) f32: the C++ generic
  kernel (entered through `run_generic`, the launch hook set to a C builtin that does
  nothing) against the Python launch path (`Op._launch_cuda`, the launcher a Python stand-in
  that does nothing). What the driver call costs (about 6 us through ctypes on the H200
  machine, 2-3 through C++) is in neither.
- "fwd+bwd": `torch.autograd.grad(softmax(x), x, dy)` at (4, 64) f32 on CPU tensors, the op's
  autograd as the C++ kernel against the same op declared without the extension
  (torch.library's Python formula); both run the same CPU reference kernels, so the
  difference is the autograd's host cost. torch.softmax's own is beside them.
Best of 5 rounds of mean us per call. The H200 figures (with the driver): bench/host.py.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

import custom_softmax as example  # noqa: E402

from bench.harness import commit  # noqa: E402
from kbuild import native as kbuild_native  # noqa: E402
from kbuild.ops import op_launch, opdef  # noqa: E402
from kbuild.ops.opdef import Op  # noqa: E402


def us_per_call(fn, calls: int = 5000, rounds: int = 5) -> float:
    for _ in range(300):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return round(best, 2)


class StandIn:
    """A loaded kernel that launches nothing: what both paths read of one."""

    def __init__(self, kernel, values):
        spec = kernel.spec(*values)
        self.names = kernel.arg_names(spec)
        self.function_handle, self.block, self.dynamic_shared = 0, 128, 0
        self.cluster, self.rows_per_block, self.resident_clusters, self.meta = 1, 1, 1, {}

    def __call__(self, grid, stream, *args):
        pass


def python_twin(op: Op) -> Op:
    """The op declared again as where the extension does not load (Python autograd)."""
    saved, opdef.NATIVE[0] = opdef.NATIVE[0], None
    try:
        bwd = op.backward
        backward = Op(
            f"{bwd.namespace}_python::{bwd.op_name}",
            args=bwd.args,
            outputs=bwd.outputs,
            launch=bwd.launches,
            reference=bwd.reference,
        )
        return Op(f"{op.namespace}_python::{op.op_name}", args=op.args, outputs=op.outputs,
                  launch=op.launches, reference=op.reference, backward=backward)  # fmt: skip
    finally:
        opdef.NATIVE[0] = saved


def main(path: str | None) -> None:
    native = kbuild_native.load(force=True)  # on a CPU too: its kernels through the hook
    if native is None:
        sys.exit("the C++ extension is unavailable: nothing to compare")
    softmax, result = example.softmax, {"commit": commit(), "torch": torch.__version__}
    twin = python_twin(softmax)
    stand_ins: dict = {}

    def launcher_for(kernel, device, values):
        key = (kernel.name, values)
        if key not in stand_ins:
            stand_ins[key] = StandIn(kernel, values)
        return stand_ins[key]

    op_launch.launcher_for, op_launch.stream_of = launcher_for, lambda device: 0
    opdef.device_guard = lambda t: torch.no_grad()
    x = torch.randn(4, 4096)
    native.set_launch_hook(slice)
    try:
        result["launch"] = {
            "C++ generic kernel (run_generic)": us_per_call(
                lambda: native.run_generic(softmax.name, [x])
            ),
            "Python launch path (Op._launch_cuda)": us_per_call(lambda: softmax._launch_cuda(x)),
            "torch.empty_like(x) alone": us_per_call(lambda: torch.empty_like(x)),
        }
    finally:
        native.set_launch_hook(None)
    x = torch.randn(4, 64, requires_grad=True)
    dy = torch.randn(4, 64)
    result["fwd+bwd"] = {
        "C++ autograd kernel": us_per_call(lambda: torch.autograd.grad(softmax(x), x, dy)),
        "Python autograd (torch.library)": us_per_call(lambda: torch.autograd.grad(twin(x), x, dy)),
        "torch.softmax": us_per_call(lambda: torch.autograd.grad(torch.softmax(x, -1), x, dy)),
    }
    print(json.dumps(result, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
