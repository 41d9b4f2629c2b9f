"""The interpreter against the GPU: each op's forward and backward on fixed inputs, run on a
CUDA device and under KBUILD_INTERPRET=1 on the CPU, outputs compared element by element.

    # on the GPU (kernels warmed with `kbuild warmup --module bench/interpret_vs_gpu.py`):
    python bench/interpret_vs_gpu.py run cuda gpu.pt
    # here, on the CPU:
    KBUILD_INTERPRET=1 python bench/interpret_vs_gpu.py run cpu cpu.pt
    python bench/interpret_vs_gpu.py compare gpu.pt cpu.pt

The inputs are made on the CPU from fixed seeds, so both runs see the same bits. Kernels whose
reductions span blocks (the norms' weight gradients) sum in an order fixed by the grid, which
follows the device's SM count (132 on an H100, 4 on the interpreter's device): their
difference is rounding, not error, and is reported as it is.
"""

from __future__ import annotations

import sys
import zlib

import torch

# (name, rows, width, dtype): shapes of the GPU suite's kinds, kept small enough to interpret
CASES = [
    ("rmsnorm", 64, 4096, torch.bfloat16),
    ("rmsnorm", 8, 65537, torch.float32),  # peeled rows split over a cluster
    ("fused_add_rmsnorm", 32, 4097, torch.bfloat16),
    ("layernorm", 64, 2048, torch.bfloat16),
    ("layernorm", 4, 65536, torch.float32),
    ("softmax", 16, 50257, torch.bfloat16),
    ("log_softmax", 16, 4099, torch.float32),
    ("cross_entropy", 32, 128256, torch.bfloat16),
    ("cross_entropy", 16, 50257, torch.float32),
    ("swiglu", 64, 14336, torch.bfloat16),
    ("geglu", 64, 9216, torch.bfloat16),
    ("gelu", 64, 3072, torch.float32),
]


def _inputs(name, M, N, dtype):
    g = torch.Generator().manual_seed(zlib.crc32(f"{name} {M} {N}".encode()))

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    if name == "cross_entropy":
        return [randn(M, N, scale=3.0), torch.randint(0, N, (M,), generator=g)]
    if name in ("swiglu", "geglu"):
        return [randn(M, N), randn(M, N)]
    if name in ("softmax", "log_softmax", "gelu"):
        return [randn(M, N, scale=2.0)]
    x, w = randn(M, N), randn(N, scale=0.5) + 1
    if name == "fused_add_rmsnorm":
        return [x, randn(M, N), w]
    if name == "layernorm":
        return [x, w, randn(N, scale=0.1)]
    return [x, w]


def _call(name, args):
    import kbuild

    if name == "cross_entropy":
        return [kbuild.cross_entropy(args[0], args[1], label_smoothing=0.1)]
    if name == "fused_add_rmsnorm":
        return list(kbuild.fused_add_rmsnorm(*args, prenorm=True))
    if name in ("softmax", "log_softmax"):
        return [getattr(kbuild, name)(args[0], -1)]
    return [getattr(kbuild, name)(*args)]


def run(device: str, path: str) -> None:
    results = {}
    for name, M, N, dtype in CASES:
        args = [a.to(device) for a in _inputs(name, M, N, dtype)]
        for a in args:
            if a.is_floating_point():
                a.requires_grad_()
        outs = _call(name, args)
        g = torch.Generator().manual_seed(7)
        grads = [torch.randn(o.shape, generator=g).to(o.dtype).to(device) for o in outs]
        torch.autograd.backward(outs, grads)
        key = f"{name} ({M}, {N}) {str(dtype).removeprefix('torch.')}"
        results[key] = [o.detach().cpu() for o in outs] + [
            a.grad.cpu() for a in args if a.is_floating_point()
        ]
        print(key, "done", flush=True)
    torch.save(results, path)


def compare(gpu_path: str, cpu_path: str) -> None:
    gpu, cpu = torch.load(gpu_path), torch.load(cpu_path)
    print("case | tensor | largest |difference| | relative to the largest |value| | bitwise")
    for key, tensors in gpu.items():
        for i, (a, b) in enumerate(zip(tensors, cpu[key], strict=True)):
            d = (a.double() - b.double()).abs().max().item()
            scale = a.double().abs().max().item() or 1.0
            print(f"{key} | {i} | {d:.3g} | {d / scale:.3g} | {torch.equal(a, b)}")


def warmup_specs():
    """The kernels `run` launches on an sm_90 GPU (`kbuild warmup --module` reads this):
    recorded by running it once here under the interpreter."""
    import importlib
    import json
    import os
    import subprocess
    import tempfile

    from kbuild.cli.model_specs import KERNEL_MODULES
    from kbuild.spec import KernelSpec

    for module in KERNEL_MODULES:  # they declare the kernels the record names
        importlib.import_module(module)

    with tempfile.TemporaryDirectory() as tmp:
        record = os.path.join(tmp, "record.jsonl")
        env = dict(os.environ, KBUILD_INTERPRET="1", KBUILD_RECORD=record)
        subprocess.run([sys.executable, __file__, "run", "cpu", os.path.join(tmp, "x.pt")],
                       env=env, check=True, capture_output=True)  # fmt: skip
        with open(record) as f:
            return [KernelSpec.from_json(json.loads(line)) for line in f if line.strip()]


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    else:
        compare(sys.argv[2], sys.argv[3])
