"""Where the host time of a kbuild call goes, at a tiny shape where the kernels cost nothing.

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/host_profile.py OUT_DIR

Prints (and writes OUT_DIR/host_profile.json, OUT_DIR/cprofile_*.txt):
- wall us per call, 2000 calls then one synchronize, kbuild beside torch eager, for the
  forward without grad and forward + backward through torch.autograd.grad;
- the pieces of the kbuild path timed alone (checks, allocations, the autograd Function's own
  cost with an empty body, the launcher call, the column-sum launch);
- cProfile of the forward + backward, the top functions by own time.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kbuild  # noqa: E402
from kbuild.ops import common  # noqa: E402
from kbuild.ops.rmsnorm import rmsnorm_fwd  # noqa: E402

CALLS = 2000
SHAPES = ((4, 4096), (1, 4096))


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


class Empty(torch.autograd.Function):
    """The autograd Function machinery with nothing inside: its own host cost."""

    @staticmethod
    def forward(ctx, x, w, eps):
        ctx.save_for_backward(x, w)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy, None, None


def ops(shape):
    M, N = shape
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, N, **bf, requires_grad=True)
    r = torch.randn(M, N, **bf, requires_grad=True)
    w = torch.randn(N, **bf, requires_grad=True)
    b = torch.randn(N, **bf, requires_grad=True)
    dy = torch.randn(M, N, **bf)
    F = torch.nn.functional

    def grad(f, inputs):
        return lambda: torch.autograd.grad(f(), inputs, dy)

    def fused_k():
        out, res = kbuild.fused_add_rmsnorm(x, r, w)
        return out

    def fused_t():
        res = x + r
        return F.rms_norm(res, (N,), w, 1e-6)

    fwd = {  # timed under torch.no_grad()
        "rmsnorm": (lambda: kbuild.rmsnorm(x, w), lambda: F.rms_norm(x, (N,), w, 1e-6)),
        "layernorm": (
            lambda: kbuild.layernorm(x, w, b),
            lambda: F.layer_norm(x, (N,), w, b, 1e-5),
        ),
        "fused_add_rmsnorm": (fused_k, fused_t),
    }
    bwd = {
        "rmsnorm": (
            grad(lambda: kbuild.rmsnorm(x, w), [x, w]),
            grad(lambda: F.rms_norm(x, (N,), w, 1e-6), [x, w]),
        ),
        "layernorm": (
            grad(lambda: kbuild.layernorm(x, w, b), [x, w, b]),
            grad(lambda: F.layer_norm(x, (N,), w, b, 1e-5), [x, w, b]),
        ),
        "fused_add_rmsnorm": (grad(fused_k, [x, r, w]), grad(fused_t, [x, r, w])),
    }
    return x, w, dy, fwd, bwd


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": CALLS}
    for shape in SHAPES:
        x, w, dy, fwd, bwd = ops(shape)
        rows = {}
        for op, (k, t) in fwd.items():
            with torch.no_grad():
                rows[f"{op} fwd no_grad"] = (us_per_call(k), us_per_call(t))
        for op, (k, t) in bwd.items():
            rows[f"{op} fwd+bwd autograd.grad"] = (us_per_call(k), us_per_call(t))
        result[f"{shape[0]}x{shape[1]}"] = {
            name: {"kbuild_us": round(a, 2), "torch_us": round(b, 2), "ratio": round(a / b, 3)}
            for name, (a, b) in rows.items()
        }
        for name, (a, b) in rows.items():
            print(f"{shape}  {name:36s} kbuild {a:7.1f} us  torch {b:7.1f} us  x{a / b:.2f}")

    # The pieces, at 4 x 4096.
    x, w, dy, fwd, bwd = ops((4, 4096))
    xd = x.detach()
    with torch.no_grad():
        pieces = {
            "check_input+check_param+check_eps": lambda: (
                common.check_input("x", xd),
                common.check_param("weight", w, xd),
                common.check_eps(1e-6),
            ),
            "torch.empty_like(x)": lambda: torch.empty_like(xd),
            "torch.empty(M) fp32": lambda: torch.empty(4, dtype=torch.float32, device="cuda"),
            "rmsnorm_fwd launch path (alloc + lookup + launch)": lambda: rmsnorm_fwd(
                xd, w, 1e-6, False
            ),
            "torch.cuda.device guard": lambda: torch.cuda.device(0).__enter__(),
        }
        timed = {name: us_per_call(fn) for name, fn in pieces.items()}
    timed["empty autograd.Function fwd+bwd"] = us_per_call(
        lambda: torch.autograd.grad(Empty.apply(x, w, 1e-6), [x], dy)
    )
    result["pieces_us_4x4096"] = {k: round(v, 2) for k, v in timed.items()}
    for name, value in timed.items():
        print(f"piece  {name:52s} {value:7.2f} us")

    for op, (k, _) in bwd.items():
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(500):
            k()
        torch.cuda.synchronize()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
        with open(os.path.join(out_dir, f"cprofile_{op}_bwd.txt"), "w") as f:
            f.write(text.getvalue())

    from torch.profiler import ProfilerActivity, profile

    for op, (k, _) in bwd.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                k()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        result.setdefault("device_kernels_per_call", {})[op] = {
            "launches": len(kernels) / 20,
            "names": sorted({e.name[:60] for e in kernels}),
        }
    with open(os.path.join(out_dir, "host_profile.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["device_kernels_per_call"], indent=1))


if __name__ == "__main__":
    main()
