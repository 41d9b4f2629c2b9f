"""Where a persistent row loop's steps spend their time: runs the `trace` manifest's
diagnostic builds (per-row timestamps, dsl.trace) on the benchmark shapes and prints, per
kernel, the median and 90th percentile over blocks and steps of each phase of a step, in
nanoseconds:

    wait      start -> row landed      (staged rows: the copy issued a step earlier)
    block     landed -> block reduction done   (moments or sums, warp shuffles, block barrier)
    exchange  block -> cluster exchange done   (waiting for the peers' row sums)
    finish    exchange -> step end     (normalise, w and b, stores issued)
    period    start -> next step's start

    kbuild warmup --manifest trace ...   then   python bench/trace_rows.py [out.json]

Default file: bench/results/<gpu>_trace_rows_<date>.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import default_path  # noqa: E402
from bench.tune import _arguments  # noqa: E402
from kbuild.cases import BENCH_ELEMENTS  # noqa: E402
from kbuild.cli.manifest import manifest  # noqa: E402
from kbuild.jit import artifact_for, device_target  # noqa: E402
from kbuild.op.tensors import stream_of  # noqa: E402
from kbuild.runtime.cuda import Launcher  # noqa: E402
from kbuild.trace_layout import TRACE_POINTS as POINTS  # noqa: E402

PHASES = {
    "wait": ("start", "landed"),
    "block": ("landed", "block"),
    "exchange": ("block", "cluster"),
    "finish": ("cluster", "end"),
}


def _quantiles(values: torch.Tensor) -> list[float]:
    q = torch.quantile(values.double(), torch.tensor([0.5, 0.9], dtype=torch.float64))
    return [round(float(v), 1) for v in q]


def summarize(trace: torch.Tensor) -> dict:
    """Phase times (ns) of the steps a block took after its first and before its last (the
    first waits for the grid to start, the last for nothing after it)."""
    trace = trace.cpu()
    cycles, ns = trace[..., : len(POINTS)].double(), trace[..., len(POINTS)].double()
    taken = cycles[..., 0] > 0  # [block, step]
    steps = taken.sum(1).tolist()
    keep = torch.zeros_like(taken)  # the steps measured: neither a block's first nor last
    rate, first, last = [], [], []  # SM clock per block (cycles per ns); first/last step's ns
    for b, n in enumerate(steps):
        keep[b, 1 : max(1, n - 1)] = True
        if n > 0:
            first.append(float(ns[b, 0]))
            last.append(float(ns[b, n - 1]))
        if n >= 3 and ns[b, n - 1] > ns[b, 0]:
            cycles_taken = cycles[b, n - 1, 0] - cycles[b, 0, 0]
            rate.append(float(cycles_taken / (ns[b, n - 1] - ns[b, 0])))
    ghz = sorted(rate)[len(rate) // 2]
    out = {"sm_ghz": round(ghz, 3), "steps_per_block": [min(steps), max(steps)]}
    for name, (a, b) in PHASES.items():
        i, j = POINTS.index(a), POINTS.index(b)
        passed = keep & (cycles[..., i] > 0) & (cycles[..., j] > 0)
        if passed.any():
            out[name] = _quantiles((cycles[..., j] - cycles[..., i])[passed] / ghz)
    nxt = torch.zeros_like(keep)
    nxt[:, :-1] = keep[:, :-1] & taken[:, 1:]
    period = (cycles[:, 1:, 0] - cycles[:, :-1, 0]) / ghz
    out["period"] = _quantiles(period[nxt[:, :-1]])
    # When each block started its first and its last step, against the earliest: the grid's
    # start and its tail.
    out["first_step_start_spread_ns"] = round(max(first) - min(first))
    out["last_step_start_spread_ns"] = round(max(last) - min(last))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", nargs="?", help="results JSON (default: see above)")
    path = parser.parse_args().out or default_path("{gpu}_trace_rows_{date}.json")
    results = []
    for spec in manifest("trace"):
        launcher = Launcher(artifact_for(spec, device_target(0)), 0)
        N = spec["N"]
        M = BENCH_ELEMENTS // N
        grid, args, tensors = _arguments(launcher, M, N)
        fn = functools.partial(launcher, grid, stream_of(0), *args)
        for _ in range(20):  # warm clocks; the last launch's timestamps are read
            fn()
        torch.cuda.synchronize()
        row = dict(
            kernel=spec.kernel,
            N=N,
            options={k: v for k, v in spec.kwargs.items() if k in ("resident_params", "stage")},
            grid=grid,
            **summarize(tensors["trace"]),
        )
        print(row, flush=True)
        results.append(row)
    with open(path, "w") as f:
        json.dump({"commit": os.environ.get("KBUILD_COMMIT"), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
