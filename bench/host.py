"""Host cost per call, as a user makes the call: kbuild (C++ hot path and Python launch path)
beside torch eager, at shapes where the kernels cost almost nothing.

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/host.py OUT_DIR

For rmsnorm, layernorm and fused_add_rmsnorm at (4, 4096) and (1, 4096) bf16 (bf16 weights),
and the softmax of examples/custom_softmax.py (an op declared with kbuild.Op: its CUDA kernel
and autograd are the generic ones, no C++ of its own) beside torch.softmax:
- forward under torch.no_grad(), and forward + backward through torch.autograd.grad: wall us
  per call, 2000 calls issued back to back then one synchronize (median of 5 rounds);
- the same forward + backward captured once in a CUDA graph and replayed (us per replay).
Routes: "kbuild" is the default (C++ extension), "kbuild_python" the Python launch path
(what runs where the extension cannot be built), "torch" torch.nn.functional.
Writes OUT_DIR/host.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kbuild  # noqa: E402
from bench.harness import commit  # noqa: E402
from kbuild.kernels.norms import api  # noqa: E402
from kbuild.timing import host_us_per_call  # noqa: E402

CALLS = 1200
SHAPES = ((4, 4096), (1, 4096))
F = torch.nn.functional


def interleaved(entries: dict, rounds: int = 7, calls: int = CALLS // 4) -> dict:
    """{label: median us per call}: every entry timed once per round, rounds interleaved, so
    a slow spell of the machine (its host timings drift by 20-40%) falls on all of them."""
    for fn in entries.values():
        for _ in range(50):
            fn()
    samples = {label: [] for label in entries}
    for _ in range(rounds):
        for label, fn in entries.items():
            samples[label].append(host_us_per_call(fn, calls, warmup=0))
    return {label: sorted(v)[len(v) // 2] for label, v in samples.items()}


def captured(fn):
    """fn captured in a CUDA graph (warmed on a side stream, as torch documents): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def calls(M: int, N: int):
    """{op: {route: (forward, forward + backward)}} at (M, N) bf16."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, N, **bf, requires_grad=True)
    r = torch.randn(M, N, **bf, requires_grad=True)
    w = torch.randn(N, **bf, requires_grad=True)
    b = torch.randn(N, **bf, requires_grad=True)
    dy = torch.randn(M, N, **bf)

    def grad(f, inputs):
        return lambda: torch.autograd.grad(f(), inputs, dy)

    ops = {
        "rmsnorm": (
            lambda: kbuild.rmsnorm(x, w),
            lambda: F.rms_norm(x, (N,), w, 1e-6),
            [x, w],
        ),
        "layernorm": (
            lambda: kbuild.layernorm(x, w, b),
            lambda: F.layer_norm(x, (N,), w, b, 1e-5),
            [x, w, b],
        ),
        "fused_add_rmsnorm": (
            lambda: kbuild.fused_add_rmsnorm(x, r, w)[0],
            lambda: F.rms_norm(x + r, (N,), w, 1e-6),
            [x, r, w],
        ),
    }
    routes = {
        op: {"kbuild": (k, grad(k, inputs)), "torch": (t, grad(t, inputs))}
        for op, (k, t, inputs) in ops.items()
    }
    if softmax is not None:
        # kbuild_python: the op's Python launch path (what runs without the C++ extension),
        # its backward op launched the same way
        routes["softmax (kbuild.Op)"] = {
            "kbuild": (lambda: softmax(x), grad(lambda: softmax(x), [x])),
            "kbuild_python": (
                lambda: softmax._launch_cuda(x),
                lambda: softmax.backward._launch_cuda(softmax._launch_cuda(x), dy),
            ),
            "torch": (lambda: torch.softmax(x, -1), grad(lambda: torch.softmax(x, -1), [x])),
        }
    return routes


def _example_softmax():
    """The example's op, where this tree has it (its kernels warmed with --module)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    if not os.path.exists(os.path.join(path, "custom_softmax.py")):
        return None
    sys.path.insert(0, path)
    import custom_softmax

    return getattr(custom_softmax, "softmax", None)


softmax = _example_softmax()


def on_route(fn, route: str, entry):
    """fn run with kbuild's C++ entry points set to `entry` (None: the Python launch path)."""
    if route == "torch" or entry is native_default:  # the default route: not wrapped
        return fn

    def call():
        api._native = entry
        try:
            return fn()
        finally:
            api._native = native_default

    return call


def no_grad(fn, route: str, entry):
    routed = on_route(fn, route, entry)

    def call():
        with torch.no_grad():
            return routed()

    return call


native_default = kbuild.native.load()  # (loaded at the first CUDA call otherwise)


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    native = native_default
    result = {
        "gpu": torch.cuda.get_device_name(),
        "commit": os.environ.get("KBUILD_COMMIT", commit()),
        "torch": torch.__version__,
        "native": native is not None,
        "calls": CALLS,
        "timing": "wall us per call: 500 calls back to back then one synchronize; median of 7"
        " rounds, every entry once per round (interleaved)",
    }
    for M, N in SHAPES:
        table = {}
        for op, by_route in calls(M, N).items():
            entries = {}
            for route, entry in (("kbuild", native), ("kbuild_python", None), ("torch", None)):
                fwd, fwd_bwd = by_route.get(route, by_route["kbuild"])
                entries[f"{route} fwd"] = no_grad(fwd, route, entry)
                entries[f"{route} fwd+bwd"] = on_route(fwd_bwd, route, entry)
                if route != "kbuild_python":
                    entries[f"{route} fwd+bwd graph replay"] = captured(fwd_bwd)
            row = interleaved(entries)
            for kind in ("fwd", "fwd+bwd", "fwd+bwd graph replay"):
                row[f"ratio {kind} kbuild/torch"] = row[f"kbuild {kind}"] / row[f"torch {kind}"]
            table[op] = {k: round(v, 3) for k, v in row.items()}
            print(f"({M}, {N}) {op}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))
        result[f"{M}x{N}"] = table
    with open(os.path.join(out_dir, "host.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
