"""LayerNorm forward and backward: kbuild vs torch eager vs torch.compile, bf16 with bf16
weight and bias, M*N = 64 Mi, copy bandwidth in the same run.

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/bench_layernorm.py [out.json]

Bytes: forward reads x, writes y; backward reads x, dy, writes dx (as for RMSNorm). Its
results file is the "layernorm" columns of README.md's speed table (bench/readme_table.py;
default name bench/results/<gpu>_layernorm.json).
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


def cases() -> list[Case]:
    torch._functorch.config.donated_buffer = False  # replaying a compiled backward
    compiled = torch.compile(F.layer_norm)
    out = []
    for N in BENCH_N:
        M = BENCH_ELEMENTS // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        xi, wi, bi = x.detach(), w.detach(), b.detach()
        fwd = {
            "kbuild": lambda xi=xi, wi=wi, bi=bi: kbuild.layernorm(xi, wi, bi),
            "eager": lambda xi=xi, wi=wi, bi=bi, N=N: F.layer_norm(xi, (N,), wi, bi),
            "compile": lambda xi=xi, wi=wi, bi=bi, N=N: compiled(xi, (N,), wi, bi),
        }
        out.append(Case("layernorm_fwd", (M, N), 2 * x.numel() * 2, fwd))
        bwd = {
            "kbuild": grad_fn(kbuild.layernorm, (x, w, b), [x, w, b], [dy]),
            "eager": grad_fn(F.layer_norm, (x, (N,), w, b), [x, w, b], [dy]),
            "compile": grad_fn(compiled, (x, (N,), w, b), [x, w, b], [dy]),
        }
        out.append(Case("layernorm_bwd", (M, N), 3 * x.numel() * 2, bwd))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "out", nargs="?", help="results JSON (default: bench/results/<gpu>_layernorm.json)"
    )
    path = parser.parse_args().out or default_path("{gpu}_layernorm.json")
    copy = measure_copy()
    write_results(path, run_cases(cases(), copy, device_time=True), copy)


if __name__ == "__main__":
    main()
