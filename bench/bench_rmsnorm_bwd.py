"""RMSNorm backward and fused add + RMSNorm forward/backward: kbuild vs torch eager vs
torch.compile, bf16, M*N = 64 Mi, copy bandwidth measured in the same run.

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/bench_rmsnorm_bwd.py [out.json]

Bytes (what must move): rmsnorm backward reads x, dy and writes dx; fused forward reads x,
residual and writes residual_out, out; fused backward reads dy, d(residual_out),
residual_out and writes dx (dresidual is the same tensor). The weight gradient's traffic is
not counted (it is part of our cost, not of the budget). Backward times are of
torch.autograd.grad over the same graph for every implementation. Its results file is the
"rmsnorm bwd", "fused add fwd" and "fused add bwd" columns of README.md's speed table
(bench/readme_table.py; default name bench/results/<gpu>_rmsnorm_bwd_fused.json).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch._functorch.config
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kbuild  # noqa: E402
from bench.harness import (  # noqa: E402
    Case,
    default_path,
    grad_fn,
    measure_copy,
    run_cases,
    write_results,
)
from kbuild.cases import BENCH_ELEMENTS, BENCH_N  # noqa: E402


def torch_fused(x, residual, w, eps):
    added = x + residual
    return F.rms_norm(added, (x.shape[-1],), w, eps), added


def cases() -> list[Case]:
    # Replaying one compiled backward needs retain_graph, which donated buffers forbid.
    torch._functorch.config.donated_buffer = False
    compiled_rms = torch.compile(F.rms_norm)
    compiled_fused = torch.compile(torch_fused)
    out = []
    for N in BENCH_N:
        M = BENCH_ELEMENTS // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        r = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        dres = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        elem = x.numel() * 2
        bwd = {
            "kbuild": grad_fn(kbuild.rmsnorm, (x, w), [x, w], [dy]),
            "eager": grad_fn(F.rms_norm, (x, (N,), w, 1e-6), [x, w], [dy]),
            "compile": grad_fn(compiled_rms, (x, (N,), w, 1e-6), [x, w], [dy]),
        }
        out.append(Case("rmsnorm_bwd", (M, N), 3 * elem, bwd))
        xi, ri, wi = x.detach(), r.detach(), w.detach()  # inference: nothing saved
        fwd = {
            "kbuild": lambda xi=xi, ri=ri, wi=wi: kbuild.fused_add_rmsnorm(xi, ri, wi),
            "eager": lambda xi=xi, ri=ri, wi=wi: torch_fused(xi, ri, wi, 1e-6),
            "compile": lambda xi=xi, ri=ri, wi=wi: compiled_fused(xi, ri, wi, 1e-6),
        }
        out.append(Case("fused_add_rmsnorm_fwd", (M, N), 4 * elem, fwd))
        fbwd = {
            "kbuild": grad_fn(kbuild.fused_add_rmsnorm, (x, r, w), [x, r, w], [dy, dres]),
            "eager": grad_fn(torch_fused, (x, r, w, 1e-6), [x, r, w], [dy, dres]),
            "compile": grad_fn(compiled_fused, (x, r, w, 1e-6), [x, r, w], [dy, dres]),
        }
        out.append(Case("fused_add_rmsnorm_bwd", (M, N), 4 * elem, fbwd))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "out", nargs="?", help="results JSON (default: bench/results/<gpu>_rmsnorm_bwd_fused.json)"
    )
    path = parser.parse_args().out or default_path("{gpu}_rmsnorm_bwd_fused.json")
    copy = measure_copy()
    write_results(path, run_cases(cases(), copy, device_time=True), copy)


if __name__ == "__main__":
    main()
