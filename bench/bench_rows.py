"""Rows of any width at vector speed: the row kernels at widths that are not a whole number of
16-byte vectors (peeled rows, dsl/rows.py) beside the aligned width next to them, and the user
softmax (examples/custom_softmax.py) beside torch.softmax at GPT-2's vocabulary, at long rows
and at the shapes its acceptance names ((16384, 4096), (4096, 32768)), with the copy
bandwidth measured in the same run.

    kbuild warmup --arch sm_90 --module bench/bench_rows.py --cache-dir .kbuild-aot
    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/bench_rows.py [out.json]

Before timing, every kernel timed here is checked against an fp64 reference on rows of every
phase (a fast wrong kernel must not pass for a result). The softmax rows also time the
launch-plan alternatives for long rows (`cluster`: blocks a row is split over), which is how
the example's plan for them was chosen. Norms: forward by CUDA events, backward by the kernels'
device time (profiler) through autograd's replayed graph, as bench_rmsnorm_bwd.py does.

Softmax routes: "kbuild" is the op called as users call it (kbuild.Op: its checks, torch's
dispatcher, then the C++ generic kernel, kbuild/native/generic.h); "kbuild python launch" the
op's Python launch path (what runs where the C++ extension cannot be built); torch's backward
is `torch._softmax_backward_data`, what its autograd runs. "softmax fwd+bwd (autograd)" is
`torch.autograd.grad(softmax(x), x, dy)` as users call it (bytes: both passes'). Backward and
autograd rows record the kernels' device time (profiler) and the events around each call
(`event_of_copy`). Results are written only where out.json is named.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

import custom_softmax as user  # noqa: E402

import kbuild  # noqa: E402
from bench.harness import (  # noqa: E402
    Case,
    add_event_of_copy,
    grad_fn,
    measure_copy,
    run_cases,
    write_results,
)
from kbuild.cases import BENCH_ELEMENTS  # noqa: E402

SOFTMAX = ((4096, 50257), (4096, 32768), (16384, 4096), (4096, 4097))
NORM_N = (4096, 4097, 5120, 5123)
# The widths check_values holds to fp64 (the norms and the softmax) before timing: peeled rows
# in one block (4097, 5123, f32 1001) and split over a cluster (50257, 65537).
CHECKS = ((torch.bfloat16, (4097, 5123, 50257, 65537)), (torch.float32, (1001,)))
# Launch-plan alternatives timed beside the chooser's pick: rows split over `cluster` blocks.
CLUSTERS = {32768: (2, 4, 8), 50257: (2, 4, 8)}


def variant_specs() -> list:
    return [
        build.spec(N=N, dtype="bf16", cluster=c)
        for build in (user.build_softmax_fwd, user.build_softmax_bwd)
        for N, clusters in CLUSTERS.items()
        for c in clusters
    ]


def warmup_specs() -> list:
    """What `kbuild warmup --module bench/bench_rows.py` compiles: every kernel it launches,
    the example's softmax and the norms (training steps, for_width) at the timed widths and
    at check_values' widths, and the plan alternatives."""
    from kbuild.cli.widths import for_width

    names = {torch.bfloat16: "bf16", torch.float32: "f32"}
    widths = [(torch.bfloat16, N) for _, N in SOFTMAX]
    widths += [(dtype, N) for dtype, Ns in CHECKS for N in Ns]
    specs = []
    for dtype, N in dict.fromkeys(widths):
        specs += user.softmax.warm_specs(N, names[dtype], misaligned=False)
    for dtype, N in dict.fromkeys([(torch.bfloat16, N) for N in NORM_N] + widths[len(SOFTMAX) :]):
        specs += for_width(N, names[dtype])
    return list(dict.fromkeys(specs + variant_specs()))


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error of a row relative to the row's norm (values near 1/N would pass an
    elementwise bound as zeros)."""
    got, want = got.double(), want.double()
    return ((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)).max().item()


def check_values() -> dict:
    """Peeled rows against fp64: 37 rows (every phase of 8-element vectors, several times),
    forward and every gradient, for the norms and the softmax; returns the errors."""
    torch.manual_seed(0)
    errors = {}
    for dtype, widths in CHECKS:
        for N in widths:
            errors.update(check_width(N, dtype))
    return errors


def check_width(N: int, dtype: torch.dtype) -> dict:
    bound = 2e-2 if dtype == torch.bfloat16 else 1e-5
    x = torch.randn(37, N, device="cuda", dtype=dtype, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(N, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    x64, r64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, r, w, b))
    F = torch.nn.functional
    runs = {
        "rmsnorm": (
            lambda: kbuild.rmsnorm(x, w, 1e-6),
            lambda: F.rms_norm(x64, (N,), w64, 1e-6),
            (x, w),
            (x64, w64),
        ),
        "layernorm": (
            lambda: kbuild.layernorm(x, w, b, 1e-5),
            lambda: F.layer_norm(x64, (N,), w64, b64, 1e-5),
            (x, w, b),
            (x64, w64, b64),
        ),
        "fused_add_rmsnorm": (
            lambda: kbuild.fused_add_rmsnorm(x, r, w, 1e-6)[0],
            lambda: F.rms_norm(x64 + r64, (N,), w64, 1e-6),
            (x, r, w),
            (x64, r64, w64),
        ),
        "softmax": (lambda: user.softmax(x), lambda: torch.softmax(x64, -1), (x,), (x64,)),
    }
    errors = {}
    for name, (ours, ref, inputs, inputs64) in runs.items():
        y, y64 = ours(), ref()
        grads = torch.autograd.grad(y, inputs, dy)
        grads64 = torch.autograd.grad(y64, inputs64, dy.double())
        worst = relative(y, y64)
        for g, g64 in zip(grads, grads64, strict=True):
            worst = max(worst, relative(g.reshape(-1, N), g64.reshape(-1, N)))
        errors[f"{name} {N} {str(dtype)[6:]}"] = worst
        print(f"check {name:18} N={N:6} {str(dtype)[6:]:9} worst {worst:.2e}", flush=True)
        assert worst < bound, (name, N, dtype, worst)
    return errors


def softmax_cases() -> tuple[list[Case], list[Case]]:
    from kbuild.op.launch import rows_grid

    forward, backward = [], []
    for M, N in SOFTMAX:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        y = torch.softmax(x, -1)
        leaf = x.clone().requires_grad_()
        size = M * N * 2
        fwd = {
            "kbuild": lambda x=x: user.softmax(x),
            "kbuild python launch": lambda x=x: user.softmax._launch_cuda(x),
            "torch": lambda x=x: torch.softmax(x, -1),
        }
        bwd = {
            "kbuild": lambda y=y, dy=dy: user.softmax.backward(y, dy),
            "kbuild python launch": lambda y=y, dy=dy: user.softmax.backward._launch_cuda(y, dy),
            "torch": lambda y=y, dy=dy: torch._softmax_backward_data(dy, y, -1, y.dtype),
        }
        both = {
            "kbuild": lambda leaf=leaf, dy=dy: torch.autograd.grad(user.softmax(leaf), leaf, dy),
            "torch": lambda leaf=leaf, dy=dy: torch.autograd.grad(
                torch.softmax(leaf, -1), leaf, dy
            ),
        }
        want_dx = torch._softmax_backward_data(dy, y, -1, y.dtype)
        for got, want in (
            (user.softmax._launch_cuda(x), y),
            (user.softmax.backward._launch_cuda(y, dy), want_dx),
        ):  # the Python launch path: its own binding of the same kernels
            error = relative(got, want)
            assert error < 2e-2, (N, "python launch", error)
        for c in CLUSTERS.get(N, ()):
            out = torch.empty_like(x)

            def grid(launcher, M=M):
                return rows_grid(launcher, M)

            def fwd_variant(c=c, x=x, out=out, M=M, N=N):
                kbuild.launch(user.build_softmax_fwd, grid, x, out, M, N=N, dtype="bf16", cluster=c)
                return out

            def bwd_variant(c=c, y=y, dy=dy, out=out, M=M, N=N):
                kbuild.launch(
                    user.build_softmax_bwd, grid, y, dy, out, M, N=N, dtype="bf16", cluster=c
                )
                return out

            for fn, want in ((fwd_variant, y), (bwd_variant, user.softmax.backward(y, dy))):
                error = relative(fn(), want)
                assert error < 2e-2, (N, c, error)
            fwd[f"cluster {c}"] = fwd_variant
            bwd[f"cluster {c}"] = bwd_variant
        forward.append(Case("softmax fwd", (M, N), 2 * size, fwd))
        backward.append(Case("softmax bwd", (M, N), 3 * size, bwd))
        backward.append(Case("softmax fwd+bwd (autograd)", (M, N), 5 * size, both))
    return forward, backward


def norm_cases() -> tuple[list[Case], list[Case]]:
    import torch.nn.functional as F

    forward, backward = [], []
    for N in NORM_N:
        M = BENCH_ELEMENTS // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        xi, wi, bi = x.detach(), w.detach(), b.detach()
        size = M * N * 2
        forward.append(Case("rmsnorm fwd", (M, N), 2 * size, {
            "kbuild": lambda xi=xi, wi=wi: kbuild.rmsnorm(xi, wi),
            "torch": lambda xi=xi, wi=wi, N=N: F.rms_norm(xi, (N,), wi, 1e-6),
        }))  # fmt: skip
        forward.append(Case("layernorm fwd", (M, N), 2 * size, {
            "kbuild": lambda xi=xi, wi=wi, bi=bi: kbuild.layernorm(xi, wi, bi),
            "torch": lambda xi=xi, wi=wi, bi=bi, N=N: F.layer_norm(xi, (N,), wi, bi),
        }))  # fmt: skip
        backward.append(Case("rmsnorm bwd", (M, N), 3 * size, {
            "kbuild": grad_fn(kbuild.rmsnorm, (x, w), [x, w], [dy]),
            "torch": grad_fn(F.rms_norm, (x, (N,), w, 1e-6), [x, w], [dy]),
        }))  # fmt: skip
        backward.append(Case("layernorm bwd", (M, N), 3 * size, {
            "kbuild": grad_fn(kbuild.layernorm, (x, w, b), [x, w, b], [dy]),
            "torch": grad_fn(F.layer_norm, (x, (N,), w, b), [x, w, b], [dy]),
        }))  # fmt: skip
    return forward, backward


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", nargs="?", help="results JSON (none written without it)")
    path = parser.parse_args().out
    errors = check_values()
    copy = measure_copy()
    cases = []
    for make in (softmax_cases, norm_cases):
        forward, backward = make()
        cases += run_cases(forward, copy)
        cases += run_cases(backward, copy, device_time=True)
    add_event_of_copy(cases, copy)
    if path:
        write_results(path, cases, copy, {"max_relative_errors": errors})


if __name__ == "__main__":
    main()
