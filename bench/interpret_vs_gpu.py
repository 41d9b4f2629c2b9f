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

# (name, rows, width, dtype): shapes of the GPU suite's kinds, kept small enough to interpret.
# rope / qk_norm_rope: rows = B * T tokens of 4 q heads and 2 k heads of D = width;
# linear_cross_entropy: rows tokens of H = 256 against V = width; encoder: rows = B * T tokens
# of C = width (V = 512); bias_grad: rows x width; "cross_entropy many rows": the plan of a
# call of many rows (one block a row, the row walked in chunks) at a few rows.
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
    ("cross_entropy many rows", 8, 128256, torch.bfloat16),
    ("linear_cross_entropy", 96, 32000, torch.bfloat16),
    ("swiglu", 64, 14336, torch.bfloat16),
    ("geglu", 64, 9216, torch.bfloat16),
    ("gelu", 64, 3072, torch.float32),
    ("rope", 32, 128, torch.bfloat16),
    ("qk_norm_rope", 32, 128, torch.bfloat16),
    ("encoder", 64, 768, torch.bfloat16),
    ("bias_grad", 256, 2304, torch.bfloat16),
]
HEADS = (4, 2)  # q and k heads of the rope cases
LOSS_H = 256  # hidden size of the linear_cross_entropy case
ENCODER_V = 512  # vocabulary of the encoder case


def _inputs(name, M, N, dtype):
    """The case's arguments, made on the CPU from a seed of its name and shape."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name} {M} {N}".encode()))

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    if name.startswith("cross_entropy"):
        return [randn(M, N, scale=3.0), torch.randint(0, N, (M,), generator=g)]
    if name == "linear_cross_entropy":
        target = torch.randint(0, N, (M,), generator=g)
        return [randn(M, LOSS_H), randn(N, LOSS_H, scale=0.2), target]
    if name in ("rope", "qk_norm_rope"):
        B, T = 2, M // 2
        theta = torch.rand(B, T, N // 2, generator=g, dtype=torch.float64) * 20 - 10
        emb = torch.cat([theta, theta], dim=-1)
        qk = [randn(B, h, T, N) for h in HEADS]
        trig = [emb.cos().to(dtype), emb.sin().to(dtype)]
        if name == "rope":
            return qk + trig
        return qk + [randn(N, scale=0.5) + 1, randn(N, scale=0.5) + 1] + trig
    if name == "encoder":
        tokens = torch.randint(0, ENCODER_V, (2, M // 2), generator=g)
        return [tokens, randn(ENCODER_V, N), randn(M // 2, N)]
    if name in ("swiglu", "geglu"):
        return [randn(M, N), randn(M, N)]
    if name in ("softmax", "log_softmax", "gelu", "bias_grad"):
        return [randn(M, N, scale=2.0)]
    x, w = randn(M, N), randn(N, scale=0.5) + 1
    if name == "fused_add_rmsnorm":
        return [x, randn(M, N), w]
    if name == "layernorm":
        return [x, w, randn(N, scale=0.1)]
    return [x, w]


# the arguments of each case that take a gradient (default: every floating one)
_CONSTANT = {"rope": (2, 3), "qk_norm_rope": (4, 5), "bias_grad": (0,)}


def _call(name, args):
    import kbuild

    if name == "cross_entropy":
        return [kbuild.cross_entropy(args[0], args[1], label_smoothing=0.1)]
    if name == "cross_entropy many rows":
        from kbuild.kernels.loss import kernels as ce

        many, ce.MANY_ROWS = ce.MANY_ROWS, 1  # the plan of a call of many rows, at a few
        try:
            return [kbuild.cross_entropy(args[0], args[1])]
        finally:
            ce.MANY_ROWS = many
    if name == "fused_add_rmsnorm":
        return list(kbuild.fused_add_rmsnorm(*args, prenorm=True))
    if name in ("softmax", "log_softmax"):
        return [getattr(kbuild, name)(args[0], -1)]
    return list(_as_tuple(getattr(kbuild, name)(*args)))


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def run(device: str, path: str) -> None:
    results = {}
    for name, M, N, dtype in CASES:
        args = [a.to(device) for a in _inputs(name, M, N, dtype)]
        for i, a in enumerate(args):
            if a.is_floating_point() and i not in _CONSTANT.get(name, ()):
                a.requires_grad_()
        outs = _call(name, args)
        g = torch.Generator().manual_seed(7)
        grads = [torch.randn(o.shape, generator=g).to(o.dtype).to(device) for o in outs]
        if any(o.requires_grad for o in outs):
            torch.autograd.backward(outs, grads)
        key = f"{name} ({M}, {N}) {str(dtype).removeprefix('torch.')}"
        results[key] = [o.detach().cpu() for o in outs] + [
            a.grad.cpu() for a in args if a.requires_grad
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
