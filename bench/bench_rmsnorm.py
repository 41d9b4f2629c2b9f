"""RMSNorm forward: kbuild vs torch eager F.rms_norm vs torch.compile, bf16, M*N = 64 Mi.

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/bench_rmsnorm.py [out.json]

Bytes: read x + write y (the weight, N elements, is noise). Also host microseconds per call
at a tiny shape, and the cost of a disk-cache hit in a fresh process. Its results file is
the "rmsnorm fwd" column of README.md's speed table (bench/readme_table.py); the default name,
bench/results/<gpu>_rmsnorm_fwd.json, is the one that table reads (h200_rmsnorm_fwd.json).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kbuild  # noqa: E402
from bench.harness import Case, default_path, measure_copy, run_cases, write_results  # noqa: E402
from kbuild.cases import BENCH_ELEMENTS, BENCH_N, TINY_SHAPE  # noqa: E402
from kbuild.timing import host_us_per_call  # noqa: E402

COLD_LOAD = r"""
import time, torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
from kbuild.jit import artifact_for, device_target
from kbuild.kernels.norms.rmsnorm import rmsnorm_fwd_spec
from kbuild.runtime.cuda import Launcher
spec = rmsnorm_fwd_spec(4096, "bf16", "bf16", False, 1e-6)
target = device_target(0)
t0 = time.perf_counter(); a = artifact_for(spec, target); t1 = time.perf_counter()
Launcher(a, 0); t2 = time.perf_counter()
print(f"{1e3*(t1-t0):.3f} {1e3*(t2-t1):.3f}")
"""


def forward_cases() -> list[Case]:
    compiled = torch.compile(F.rms_norm)
    cases = []
    for N in BENCH_N:
        M = BENCH_ELEMENTS // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        impls = {
            "kbuild": lambda x=x, w=w: kbuild.rmsnorm(x, w, 1e-6),
            "eager": lambda x=x, w=w, N=N: F.rms_norm(x, (N,), w, 1e-6),
            "compile": lambda x=x, w=w, N=N: compiled(x, (N,), w, 1e-6),
        }
        cases.append(Case("rmsnorm_fwd", (M, N), 2 * x.numel() * 2, impls))
    return cases


def host_overhead() -> dict[str, float]:
    M, N = TINY_SHAPE
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    from kbuild.kernels.norms.rmsnorm import rmsnorm_fwd

    out = {
        "kbuild_us": host_us_per_call(lambda: kbuild.rmsnorm(x, w, 1e-6)),
        "eager_us": host_us_per_call(lambda: F.rms_norm(x, (N,), w, 1e-6)),
        "kbuild_unchecked_us": host_us_per_call(lambda: rmsnorm_fwd(x, w, 1e-6, False)),
        "empty_like_us": host_us_per_call(lambda: torch.empty_like(x)),
    }
    from kbuild.jit import artifact_for, device_target
    from kbuild.kernels.norms.rmsnorm import rmsnorm_fwd_spec
    from kbuild.op.tensors import stream_of
    from kbuild.runtime.cuda import Launcher

    y = torch.empty_like(x)
    spec = rmsnorm_fwd_spec(N, "bf16", "bf16", False, 1e-6)
    launcher = Launcher(artifact_for(spec, device_target(0)), 0)
    stream = stream_of(0)
    args = (x.data_ptr(), w.data_ptr(), y.data_ptr(), M)
    out["raw_launch_us"] = host_us_per_call(functools.partial(launcher, M, stream, *args))
    print(f"host us/call at {TINY_SHAPE}: " + ", ".join(f"{k} {v:.2f}" for k, v in out.items()))
    return {k: round(v, 2) for k, v in out.items()}


def cold_load() -> dict[str, float]:
    """Disk-cache hit + module load in a fresh process (ms), median of 5 processes."""
    disk, load = [], []
    for _ in range(5):
        out = subprocess.run(
            [sys.executable, "-c", COLD_LOAD], capture_output=True, text=True, check=True
        )
        d, m = map(float, out.stdout.split())
        disk.append(d)
        load.append(m)
    res = {"disk_hit_ms": sorted(disk)[2], "module_load_ms": sorted(load)[2]}
    disk_ms, load_ms = res["disk_hit_ms"], res["module_load_ms"]
    print(f"fresh process: disk hit {disk_ms:.2f} ms, module load {load_ms:.2f} ms")
    return res


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "out", nargs="?", help="results JSON (default: bench/results/<gpu>_rmsnorm_fwd.json)"
    )
    path = parser.parse_args().out or default_path("{gpu}_rmsnorm_fwd.json")
    copy = measure_copy()
    cases = run_cases(forward_cases(), copy)
    extra = {"host_overhead": host_overhead(), "cold_load": cold_load()}
    write_results(path, cases, copy, extra)


if __name__ == "__main__":
    main()
