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
- "call": `softmax(x)` as users call it (Op.__call__ included) at (4, 4096) f32, on a twin of
  the op whose CPU key runs the C++ generic kernel (launch hook a no-op), so a CPU call does a
  CUDA call's host work: the fast path (checks in C++, generic.h `call`) against the Python
  path it replaces (`_fast` off: `Op.check(Op.bind(...))`, then the torch.ops call), the
  torch.ops call alone (`softmax.overload(x)`) and torch.softmax (which computes on a CPU: its
  (4, 8) call is nearly all host work); then the same with x wanting a gradient. Routes
  interleaved round by round, in thread CPU time on one torch thread. "Op.__call__ over
  torch.ops" is a route's time less the torch.ops call's.
- "fwd+bwd": `torch.autograd.grad(softmax(x), x, dy)` at (4, 64) f32 on CPU tensors, the op's
  autograd as the C++ kernel against the same op declared without the extension
  (torch.library's Python formula); both run the same CPU reference kernels, so the
  difference is the autograd's host cost. torch.softmax's own is beside them.
Elsewhere best of 5 rounds of mean us per call. The H200 figures (with the driver): bench/host.py.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

import custom_softmax as example  # noqa: E402

from bench.harness import commit, interleaved  # noqa: E402
from kbuild import native as kbuild_native  # noqa: E402
from kbuild.op import binding as op_launch  # noqa: E402
from kbuild.op import opdef  # noqa: E402
from kbuild.op.opdef import Op  # noqa: E402


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


def twin(op: Op, suffix: str, native) -> Op:
    """The op and its backward declared again in namespaces ending in `suffix`, with
    opdef.NATIVE[0] `native` meanwhile: None, as where the extension does not load (Python
    autograd), or OnCPU(...)."""
    saved, opdef.NATIVE[0] = opdef.NATIVE[0], native
    try:
        bwd = op.backward
        backward = Op(f"{bwd.namespace}{suffix}::{bwd.op_name}", args=bwd.args,
                      outputs=bwd.outputs, launch=bwd.launches,
                      reference=bwd.reference)  # fmt: skip
        return Op(f"{op.namespace}{suffix}::{op.op_name}", args=op.args, outputs=op.outputs,
                  launch=op.launches, reference=op.reference, backward=backward)  # fmt: skip
    finally:
        opdef.NATIVE[0] = saved


class OnCPU:
    """The extension, with the generic kernels it defines registered on the CPU key too (over
    the reference): a twin op declared under it does on CPU tensors a CUDA call's host work."""

    def __init__(self, module):
        self.module = module

    def define_generic(self, namespace, name, program):
        keys = {"dispatch_keys": ["CUDA", "CPU"]}
        return self.module.define_generic(namespace, name, {**program, **keys})

    def __getattr__(self, name):
        return getattr(self.module, name)


def call_routes(op: Op, x: torch.Tensor) -> dict[str, float]:
    """softmax(x) on both paths of Op.__call__, the torch.ops call, torch.softmax; then x
    wanting a gradient (a training step's forward: the autograd node recorded too)."""
    assert op._fast is not None and op.generic_native, "the op has no fast path"
    python_path = copy.copy(op)  # the same op, its __call__ without the fast path: as before
    python_path._fast = None
    small = torch.randn(4, 8)
    xg, smallg = x.clone().requires_grad_(), small.clone().requires_grad_()
    fast, slow, ops = "softmax(x): fast path", "softmax(x): Python path", "softmax.overload(x)"
    times = interleaved({
        fast: lambda: op(x),
        slow: lambda: python_path(x),
        ops: lambda: op.overload(x),
        "torch.softmax(x) (computes)": lambda: torch.softmax(x, -1),
        "torch.softmax at (4, 8)": lambda: torch.softmax(small, -1),
        "x wanting a gradient: fast path": lambda: op(xg),
        "x wanting a gradient: Python path": lambda: python_path(xg),
        "x wanting a gradient: torch.softmax at (4, 8)": lambda: torch.softmax(smallg, -1),
    })  # fmt: skip
    for route in (fast, slow):
        times[f"Op.__call__ over torch.ops, {route.split(': ')[1]}"] = round(
            times[route] - times[ops], 2
        )
    return times


def main(path: str | None) -> None:
    native = kbuild_native.load(force=True)  # on a CPU too: its kernels through the hook
    if native is None:
        sys.exit("the C++ extension is unavailable: nothing to compare")
    softmax, result = example.softmax, {"commit": commit(), "torch": torch.__version__}
    python_autograd = twin(softmax, "_python", None)
    on_cpu = twin(softmax, "_host", OnCPU(native))  # its generic kernel on the CPU key too
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
        result["call"] = call_routes(on_cpu, x)
    finally:
        native.set_launch_hook(None)
    x = torch.randn(4, 64, requires_grad=True)
    dy = torch.randn(4, 64)
    result["fwd+bwd"] = {
        "C++ autograd kernel": us_per_call(lambda: torch.autograd.grad(softmax(x), x, dy)),
        "Python autograd (torch.library)": us_per_call(
            lambda: torch.autograd.grad(python_autograd(x), x, dy)
        ),
        "torch.softmax": us_per_call(lambda: torch.autograd.grad(torch.softmax(x, -1), x, dy)),
    }
    print(json.dumps(result, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
