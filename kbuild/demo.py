"""The GPU half of `kbuild demo`: run the standard kernels against torch and time them."""

from __future__ import annotations

import torch

from .manifest import BENCH_ELEMENTS, STANDARD_N


def run_on_gpu(root: str) -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU here: kernels compiled and cached only")
        return 0
    import os

    import torch.nn.functional as F

    from . import rmsnorm
    from .timing import copy_gbps, gbps, median_ms

    os.environ.setdefault("KBUILD_CACHE_DIR", root)
    copy = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy:.0f} GB/s")
    print(f"{'kernel':<28}{'max err':>10}{'GB/s':>9}{'of copy':>9}")
    failures = 0
    for N in STANDARD_N:
        M = BENCH_ELEMENTS // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        y = rmsnorm(x, w, 1e-6)
        ref = F.rms_norm(x.float(), (N,), w.float(), 1e-6)
        err = (y.float() - ref).abs().max().item()
        failures += err > 0.05 * ref.abs().max().item()
        ms = median_ms(lambda: rmsnorm(x, w, 1e-6))
        bw = gbps(2 * x.numel() * x.element_size(), ms)
        print(f"{f'rmsnorm bf16 {M}x{N}':<28}{err:>10.2e}{bw:>9.0f}{bw / copy:>9.1%}")
    return 1 if failures else 0
