"""Where the host time of one kbuild call goes, op by op (torch.profiler, CPU side).

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/host_trace.py OUT_DIR

For layernorm and rmsnorm forward + backward (torch.autograd.grad) at (4, 4096) bf16, kbuild
beside torch: the profiler's table of CPU time per operator (self and total) over 20 calls,
and a Chrome trace of them, written to OUT_DIR.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kbuild  # noqa: E402

F = torch.nn.functional


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    M, N = 4, 4096
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, N, **bf, requires_grad=True)
    w = torch.randn(N, **bf, requires_grad=True)
    b = torch.randn(N, **bf, requires_grad=True)
    dy = torch.randn(M, N, **bf)
    calls = {
        "kbuild_layernorm": lambda: torch.autograd.grad(kbuild.layernorm(x, w, b), [x, w, b], dy),
        "torch_layernorm": lambda: torch.autograd.grad(
            F.layer_norm(x, (N,), w, b, 1e-5), [x, w, b], dy
        ),
        "kbuild_rmsnorm": lambda: torch.autograd.grad(kbuild.rmsnorm(x, w), [x, w], dy),
        "torch_rmsnorm": lambda: torch.autograd.grad(F.rms_norm(x, (N,), w, 1e-6), [x, w], dy),
    }
    for name, fn in calls.items():
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        with open(os.path.join(out_dir, f"trace_{name}.txt"), "w") as f:
            f.write(table)
        prof.export_chrome_trace(os.path.join(out_dir, f"trace_{name}.json"))
        print(name)
        print(table)


if __name__ == "__main__":
    main()
