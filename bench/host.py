"""Host cost per call, as a user makes the call: kbuild (C++ hot path and Python launch path)
beside torch eager, at shapes where the kernels cost almost nothing.

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/host.py OUT_DIR

For rmsnorm, layernorm and fused_add_rmsnorm at (4, 4096) and (1, 4096) bf16 (bf16 weights):
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
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kbuild  # noqa: E402
from kbuild.ops import api  # noqa: E402

CALLS = 2000
SHAPES = ((4, 4096), (1, 4096))
F = torch.nn.functional


def us_per_call(fn, calls: int = CALLS) -> float:
    """Median over 5 rounds of `calls` calls then one synchronize (the host runs ahead)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        rounds.append(1e6 * (time.perf_counter() - start) / calls)
    return sorted(rounds)[2]


def replay_us(fn, calls: int = 500) -> float:
    """fn captured in a CUDA graph (warmed on a side stream, as torch documents), replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return us_per_call(graph.replay, calls)


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
    return {
        op: {"kbuild": (k, grad(k, inputs)), "torch": (t, grad(t, inputs))}
        for op, (k, t, inputs) in ops.items()
    }


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    native = api._native
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "native": native is not None,
        "calls": CALLS,
        "timing": "wall us per call, calls back to back then one synchronize, median of 5",
    }
    routes = [("kbuild", native), ("kbuild_python", None), ("torch", None)]
    for M, N in SHAPES:
        table = {}
        for op, by_route in calls(M, N).items():
            row = {}
            for route, entry in routes:
                api._native = entry
                fwd, fwd_bwd = by_route["torch" if route == "torch" else "kbuild"]
                with torch.no_grad():
                    row[f"{route} fwd"] = us_per_call(fwd)
                row[f"{route} fwd+bwd"] = us_per_call(fwd_bwd)
                if route != "kbuild_python":
                    row[f"{route} fwd+bwd graph replay"] = replay_us(fwd_bwd)
            api._native = native
            for kind in ("fwd", "fwd+bwd"):
                row[f"ratio {kind} kbuild/torch"] = row[f"kbuild {kind}"] / row[f"torch {kind}"]
            table[op] = {k: round(v, 3) for k, v in row.items()}
            print(f"({M}, {N}) {op}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))
        result[f"{M}x{N}"] = table
    with open(os.path.join(out_dir, "host.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
