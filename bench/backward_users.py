"""The backward passes timed as users run them: torch.autograd.grad, calls queued back to back
with CUDA events around each (host time included where it shows), beside the kernels' own
device time (profiler), kbuild and torch eager, bf16, M * N = 64 Mi.

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/backward_users.py [out.json]

The cases (shapes, bytes) are those of bench_rmsnorm_bwd.py and bench_layernorm.py; in the
results, "event_ms" / "event_of_copy" is the users' timing, "ms" / "of_copy" the device time.
Default file: bench/results/<gpu>_backward_users.json (h200_backward_users.json on the H200).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import bench_layernorm, bench_rmsnorm_bwd  # noqa: E402
from bench.harness import (  # noqa: E402
    add_event_of_copy,
    default_path,
    measure_copy,
    run_cases,
    write_results,
)
from kbuild.timing import host_us_per_call  # noqa: E402

IMPLS = ("kbuild", "eager")


def cases():
    out = []
    for module in (bench_rmsnorm_bwd, bench_layernorm):
        for case in module.cases():
            if case.op.endswith("_bwd"):
                case.impls = {k: v for k, v in case.impls.items() if k in IMPLS}
                out.append(case)
    return out


def engine_floor_us() -> dict[str, float]:
    """Host us per torch.autograd.grad call through graphs whose backward does (almost)
    nothing: the engine's own per-call cost on this machine, the floor under every event_ms
    above (a call cannot finish sooner than its host work is issued)."""
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    graphs = {"view (no kernel)": (x.view(-1), dy.view(-1)), "mul (one kernel)": (x * 2, dy)}
    floor = {}
    for name, (y, g) in graphs.items():
        us = host_us_per_call(lambda y=y, g=g: torch.autograd.grad(y, x, g, retain_graph=True))
        floor[name] = round(us, 1)
    return floor


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "out", nargs="?", help="results JSON (default: bench/results/<gpu>_backward_users.json)"
    )
    path = parser.parse_args().out or default_path("{gpu}_backward_users.json")
    copy = measure_copy()
    done = run_cases(cases(), copy, device_time=True)
    add_event_of_copy(done, copy)
    floor = engine_floor_us()
    print(f"torch.autograd.grad host floor, us per call: {floor}")
    write_results(path, done, copy, {"engine_floor_us": floor})
    for case in done:
        k = case.results.get("kbuild", {})
        print(
            f"{case.op:24s} {case.shape}: autograd.grad back to back "
            f"{k.get('event_of_copy', 0):.1%}, kernels {k.get('of_copy', 0):.1%}"
        )


if __name__ == "__main__":
    main()
