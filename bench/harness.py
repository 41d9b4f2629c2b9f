"""Benchmark harness: time each implementation of a case, report GB/s next to copy bandwidth.

A case is a name, the bytes it must move (each input read once, each output written once) and
a dict of implementations. An implementation that overwrites its inputs carries a `prepare`
attribute (a callable restoring them), run before each timed call outside the events. Shapes
are L2-cold by size (M * N = 64 Mi elements). Results go to a JSON file with the GPU, the
date, the commit and the copy bandwidth of the same run.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kbuild.cases import BENCH_ELEMENTS
from kbuild.timing import copy_gbps, device_ms, gbps, median_ms

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def gpu_tag() -> str:
    """This device's short name as result files spell it: "h200", "h100", "mi300x"."""
    name = torch.cuda.get_device_name()
    found = re.search(r"\b([A-Z]{1,3}[0-9]{2,4}[A-Z]?)\b", name)
    return found.group(1).lower() if found else re.sub(r"\W+", "_", name).strip("_").lower()


def default_path(pattern: str) -> str:
    """The default results file: bench/results/ + pattern, its {gpu} (gpu_tag()) and {date}
    (today, YYYY-MM-DD) filled in, so a run's file is named as the committed ones are."""
    date = datetime.date.today().isoformat()
    name = pattern.format(gpu=gpu_tag() if "{gpu}" in pattern else "", date=date)
    return os.path.join(RESULTS, name)


def grad_fn(fn, args, inputs, grads):
    """Time only the backward: the graph of fn(*args) built once, replayed (retain_graph)."""
    outputs = fn(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return lambda: torch.autograd.grad(outputs, inputs, grads[: len(outputs)], retain_graph=True)


@dataclass
class Case:
    op: str
    shape: tuple[int, int]
    nbytes: int
    impls: dict[str, Callable[[], object]]
    results: dict[str, dict[str, float]] = field(default_factory=dict)


def run_cases(cases: list[Case], copy: float, device_time: bool = False,
              device_too: bool = False) -> list[Case]:  # fmt: skip
    """Time every implementation of every case. `device_time`: sum the kernels' GPU time
    (profiler) instead of events around the call, for calls bound by host time (backward
    passes replayed through the autograd engine); both numbers are recorded then.
    `device_too`: the call's time stays the events', the kernels' GPU time is recorded
    beside it ("device_ms"): where the first is well above the second, the call is bound by
    its host work, not its kernels."""
    for case in cases:
        for name, fn in case.impls.items():
            try:
                wall = median_ms(fn, prepare=getattr(fn, "prepare", None))
                gpu = device_ms(fn) if device_time or device_too else None
                ms = gpu if device_time else wall
            except Exception as err:  # a peer failing (torch.compile) must not hide our numbers
                case.results[name] = {"error": f"{type(err).__name__}: {err}"[:200]}
                continue
            bw = gbps(case.nbytes, ms)
            case.results[name] = {
                "ms": round(ms, 4),
                "gbps": round(bw, 1),
                "of_copy": round(bw / copy, 4),
                "event_ms": round(wall, 4),
                "timing": "device (profiler)" if device_time else "events",
            }
            if device_too:
                case.results[name]["device_ms"] = round(gpu, 4)
        print(format_row(case, copy), flush=True)
    return cases


def format_row(case: Case, copy: float) -> str:
    cells = []
    for name, r in case.results.items():
        if "gbps" not in r:
            cells.append(f"{name} error")
            continue
        cell = f"{name} {r['gbps']:6.0f} GB/s {r['of_copy']:6.1%}"
        if r.get("device_ms"):  # the kernels alone, where the call's host work may bound it
            cell += f" (kernels {gbps(case.nbytes, r['device_ms']) / copy:.1%})"
        cells.append(cell)
    return f"{case.op:<24}{str(case.shape):>16}  " + " | ".join(cells)


def commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


def write_results(path: str, cases: list[Case], copy: float, extra: dict | None = None) -> None:
    doc = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "commit": os.environ.get("KBUILD_COMMIT", commit()),
        "torch": torch.__version__,
        "copy_gbps": round(copy, 1),
        "cases": [
            {"op": c.op, "shape": list(c.shape), "bytes": c.nbytes, "results": c.results}
            for c in cases
        ],
        **(extra or {}),
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")


def measure_copy() -> float:
    """Copy bandwidth of one 64 Mi-element bf16 tensor (128 MB read + 128 MB written): the
    benchmark shapes' own size, so fixed launch and tail costs weigh the same on both sides.
    A 1 GB copy is printed beside it for reference."""
    copy = copy_gbps(BENCH_ELEMENTS * 2)
    large = copy_gbps(1 << 30)
    print(
        f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s (128 MB), {large:.0f} GB/s (1 GB)",
        flush=True,
    )
    return copy


def add_event_of_copy(cases: list[Case], copy: float) -> None:
    """Each result's users' timing (events around back-to-back calls) as a fraction of copy
    bandwidth too ("event_of_copy"), beside the device time's "of_copy"."""
    for case in cases:
        for r in case.results.values():
            if "event_ms" in r:
                r["event_of_copy"] = round(case.nbytes / r["event_ms"] / 1e6 / copy, 4)


def interleaved(routes: dict, calls: int = 20000, rounds: int = 7) -> dict[str, float]:
    """Best of `rounds` mean us per call of each route, the routes taking turns each round,
    in this thread's CPU time (torch on one thread): a shared CPU's other work, which drifts
    between minutes, is left out."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for fn in routes.values():
            for _ in range(300):
                fn()
        best = dict.fromkeys(routes, float("inf"))
        for _ in range(rounds):
            for name, fn in routes.items():
                start = time.thread_time()
                for _ in range(calls):
                    fn()
                best[name] = min(best[name], (time.thread_time() - start) / calls * 1e6)
    finally:
        torch.set_num_threads(threads)
    return {name: round(t, 2) for name, t in best.items()}
