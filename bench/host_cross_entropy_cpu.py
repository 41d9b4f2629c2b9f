"""Host cost of kbuild.cross_entropy on the CPU machine (no GPU, no driver): its CUDA path's
Python, under the interpreter with the kernels stubbed out (the launcher does nothing, the
interpreter's memory table is not kept), so what is timed is the host work of a GPU call
less the driver's launches.

    python bench/host_cross_entropy_cpu.py [out.json]

Routes, taking turns each round, in this thread's CPU time (torch on one thread), best of
the rounds, us per call, at (64, 512) bf16 logits (the host work does not depend on the shape):
- "fwd+bwd, Op.run": `kbuild.cross_entropy(x, t).backward()` as it is (the forward op and
  the backward's rescale run without the dispatcher: op/opdef.py `Op.run`);
- "fwd+bwd, dispatcher": the same with `plain_eager` answering no, as through torch.ops and
  torch.library's Python autograd;
- "fwd no_grad, Op.run" and "fwd no_grad, dispatcher": the forward alone, no gradient;
- "torch F.cross_entropy fwd+bwd": torch's, which computes on the CPU: a scale, not a peer.
On the device the driver adds its launch cost to each kernel and torch op (a few us each).
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["KBUILD_INTERPRET"] = "1"  # before kbuild is imported: CPU tensors take the CUDA path

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kbuild  # noqa: E402
from bench.harness import commit, interleaved  # noqa: E402
from kbuild.interpret import launcher as interpreted  # noqa: E402
from kbuild.interpret import memory  # noqa: E402
from kbuild.kernels.loss import cross_entropy as ce  # noqa: E402
from kbuild.op import opdef  # noqa: E402


def through_dispatcher(fn):
    """`fn` with Op.run's check for a plain eager call answering no (the dispatcher's route)."""

    def run():
        saved = opdef.plain_eager, ce.plain_eager
        opdef.plain_eager = ce.plain_eager = lambda values: False
        try:
            fn()
        finally:
            opdef.plain_eager, ce.plain_eager = saved

    return run


def main() -> None:
    interpreted.run = lambda *args, **kwargs: None  # the kernels: stubbed
    memory.ALLOCATIONS.note = lambda tensor: None
    torch.Tensor.data_ptr = torch._C.TensorBase.data_ptr  # the interpreter's tracking: off
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 512, generator=g) * 4).bfloat16().requires_grad_()
    t = torch.randint(0, 512, (64,), generator=g)

    def train():
        x.grad = None
        kbuild.cross_entropy(x, t).backward()

    def infer():
        with torch.no_grad():
            kbuild.cross_entropy(x, t)

    def torch_train():
        x.grad = None
        F.cross_entropy(x, t).backward()

    times = interleaved({
        "fwd+bwd, Op.run": train,
        "fwd+bwd, dispatcher": through_dispatcher(train),
        "fwd no_grad, Op.run": infer,
        "fwd no_grad, dispatcher": through_dispatcher(infer),
        "torch F.cross_entropy fwd+bwd": torch_train,
    }, calls=2000)  # fmt: skip
    for name, us in times.items():
        print(f"{name:32s} {us:7.1f} us")
    result = {
        "what": "host us per call of kbuild.cross_entropy, kernels stubbed (module docstring)",
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "torch": torch.__version__,
        "shape": [64, 512],
        "dtype": "bf16",
        "us_per_call": times,
    }
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
