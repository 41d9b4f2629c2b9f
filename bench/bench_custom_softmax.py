"""The user-written row softmax (examples/custom_softmax.py) beside torch.softmax, bf16, at the
shapes its acceptance names, copy bandwidth measured in the same run.

    kbuild warmup --arch sm_90 --module examples/custom_softmax.py --cache-dir .kbuild-aot
    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/bench_custom_softmax.py [out.json]

Bytes (what must move): the forward reads x and writes y; the backward reads y and dy and
writes dx; forward + backward through autograd, as users call it, moves both. "op" is the
op called as users call it (kbuild.Op: its checks, torch's dispatcher, then the C++ generic
kernel, kbuild/native/generic.h); "python launch" the op's Python launch path (what runs
where the C++ extension cannot be built); torch's backward is `torch._softmax_backward_data`,
what its autograd runs. Backward and autograd rows record the kernels' device time
(profiler) and the events around each call.
"""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

import custom_softmax as user  # noqa: E402

from bench.harness import (  # noqa: E402
    Case,
    add_event_of_copy,
    measure_copy,
    run_cases,
    write_results,
)

SHAPES = ((16384, 4096), (4096, 32768))


def cases_for(M: int, N: int) -> tuple[list[Case], list[Case]]:
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    y = torch.softmax(x, -1)
    leaf = x.clone().requires_grad_()
    size = M * N * x.element_size()
    forward = Case(
        "softmax fwd",
        (M, N),
        2 * size,
        {
            "kbuild op": lambda: user.softmax(x),
            "kbuild python launch": lambda: user.softmax._launch_cuda(x),
            "torch": lambda: torch.softmax(x, -1),
        },
    )
    backward = Case(
        "softmax bwd",
        (M, N),
        3 * size,
        {
            "kbuild op": lambda: user.softmax.backward(y, dy),
            "kbuild python launch": lambda: user.softmax.backward._launch_cuda(y, dy),
            "torch": lambda: torch._softmax_backward_data(dy, y, -1, torch.bfloat16),
        },
    )
    both = Case(
        "softmax fwd+bwd (autograd)",
        (M, N),
        5 * size,
        {
            "kbuild": lambda: torch.autograd.grad(user.softmax(leaf), leaf, dy),
            "torch": lambda: torch.autograd.grad(torch.softmax(leaf, -1), leaf, dy),
        },
    )
    checks = (
        (user.softmax(x), y),
        (user.softmax.backward(y, dy), torch._softmax_backward_data(dy, y, -1, x.dtype)),
        (user.softmax._launch_cuda(x), y),
    )
    for got, want in checks:  # a fast wrong kernel must not pass for a result
        # relative by norm, per row: values near 1/N would pass an elementwise bound as zeros
        want = want.float()
        error = ((got.float() - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
        assert error < 2e-2, f"{M} x {N}: relative error {error}"
    return [forward], [backward, both]


def main(path: str | None) -> None:
    copy = measure_copy()
    events, profiled = [], []
    for M, N in SHAPES:
        f, b = cases_for(M, N)
        events += run_cases(f, copy)
        profiled += run_cases(b, copy, device_time=True)
    add_event_of_copy(events + profiled, copy)
    if path:
        write_results(path, events + profiled, copy)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
