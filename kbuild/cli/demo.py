"""The GPU half of `kbuild demo`: run the standard kernels against torch, report error and
bandwidth next to the copy bandwidth measured in the same run."""

from __future__ import annotations

import torch

from ..cases import BENCH_ELEMENTS, STANDARD_N


def _cases(N: int, device: str = "cuda"):
    """(name, kbuild fn, torch fp32 reference fn, inputs needing grad, bytes fwd, bytes bwd)."""
    import torch.nn.functional as F

    from .. import fused_add_rmsnorm, layernorm, rmsnorm

    M = BENCH_ELEMENTS // N

    def make(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True)

    x, r, w, b = make(M, N), make(M, N), make(N), make(N)
    elem = x.numel() * 2
    yield (
        "rmsnorm",
        lambda: rmsnorm(x, w, 1e-6),
        lambda: F.rms_norm(x.float(), (N,), w.float(), 1e-6),
        (x, w),
        2 * elem,
        3 * elem,
    )
    yield (
        "fused_add_rmsnorm",
        lambda: fused_add_rmsnorm(x, r, w, 1e-6)[0],
        lambda: F.rms_norm(x.float() + r.float(), (N,), w.float(), 1e-6),
        (x, r, w),
        4 * elem,
        4 * elem,
    )
    yield (
        "layernorm",
        lambda: layernorm(x, w, b, 1e-5),
        lambda: F.layer_norm(x.float(), (N,), w.float(), b.float(), 1e-5),
        (x, w, b),
        2 * elem,
        3 * elem,
    )


def run_on_gpu(root: str) -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU here: kernels compiled and cached only")
        return 0
    import os

    from ..timing import copy_gbps, device_ms, gbps, median_ms

    os.environ["KBUILD_CACHE_DIR"] = root  # run from the cache the demo just warmed
    copy = copy_gbps(BENCH_ELEMENTS * 2)
    print(f"\n{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s (128 MB read + written)")
    print(f"{'kernel':<34}{'rel err':>10}{'GB/s':>8}{'of copy':>9}")
    failures = 0
    for N in STANDARD_N:
        for name, fn, ref_fn, inputs, fwd_bytes, bwd_bytes in _cases(N):
            out = fn()
            with torch.no_grad():
                ref = ref_fn()
                err = ((out.float() - ref).norm() / ref.norm()).item()
            failures += not err < 1e-2
            dy = torch.randn_like(out)
            grads = torch.autograd.grad(out, inputs, dy, retain_graph=True)
            failures += not all(torch.isfinite(g).all() for g in grads)
            with torch.no_grad():
                fwd = gbps(fwd_bytes, median_ms(fn))
            bwd = gbps(
                bwd_bytes,
                device_ms(
                    lambda o=out, d=dy, i=inputs: torch.autograd.grad(o, i, d, retain_graph=True)
                ),
            )
            shape = f"{BENCH_ELEMENTS // N}x{N}"
            print(f"{f'{name} fwd bf16 {shape}':<34}{err:>10.1e}{fwd:>8.0f}{fwd / copy:>9.1%}")
            print(f"{f'{name} bwd bf16 {shape}':<34}{'':>10}{bwd:>8.0f}{bwd / copy:>9.1%}")
            del out, grads
    return 1 if failures else 0
