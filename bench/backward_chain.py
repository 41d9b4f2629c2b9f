"""The backward passes as a training step runs them: a chain of K norms, one
torch.autograd.grad for the whole chain, so the engine's per-call cost (100-150 us of host on
the H200 machine, more than these kernels take) is paid once per graph, as in training, not
once per norm as in bench/backward_users.py.

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/backward_chain.py [out.json]
        [--n 64,128,256] [--ops rmsnorm] [--view] [--profile] [--rounds 3]
                                                      (default: BENCH_N, both norms)

bf16, M x N = 64 Mi elements per norm, K = 8; reported per norm: ms (the chain's backward
time / K, CUDA events around the autograd.grad call, calls back to back) and % of the copy
bandwidth of the same run, kbuild beside torch eager. `--view`: QK-norm as a model with a
fused qkv projection runs it: each of the K norms reads the q of its own qkv buffer, a strided
(T, H, N) view (H = kbuild.cases.QK_HEADS), and the one grad call takes all K. `--profile`:
also each of kbuild's kernels in the chain, device us per norm (torch.profiler over a few
calls: the backward kernel beside the column sum of its dw/db partials), the split of the
figure above into kernels and what is left (launch gaps, the engine's fixed cost / K).
`--rounds R`: the whole sweep R times over, each entry's chain built afresh every round;
"ms" and "of_copy" are then the median over the rounds and "of_copy_range" their least and
most. On the H200 the spread between rounds is real (the board runs these kernels at its
700 W power cap and the SM clock moves between ~1500 and 1980 MHz: bench/NOTES.md,
"Measuring"), so a figure near a threshold is read from one run's rounds, not from one round.
Default file: bench/results/<gpu>_backward_chain_<date>.json (name a variant's run by a word
after the date, as the committed ones are: ..._2026-12-04_rounds.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kbuild  # noqa: E402
from bench.harness import default_path, measure_copy  # noqa: E402
from kbuild.cases import BENCH_ELEMENTS, BENCH_N, QK_HEADS  # noqa: E402
from kbuild.timing import kernel_device_us, median_ms  # noqa: E402

K = 8
F = torch.nn.functional


def chain(norm, N: int, with_bias: bool):
    """x -> K norms (each its own weight) -> the backward of all K through one grad call."""
    M = BENCH_ELEMENTS // N
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def param():
        return torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    ws, bs = [param() for _ in range(K)], [param() for _ in range(K)]
    h = x
    for w, b in zip(ws, bs, strict=True):
        h = norm(h, w, b, N)
    dy = torch.randn_like(h)
    inputs = [x, *ws, *(bs if with_bias else [])]
    return lambda: torch.autograd.grad(h, inputs, dy, retain_graph=True)


def views(norm, N: int, with_bias: bool):
    """K norms, each of the q view of its own (T, 3 * H * N) qkv buffer; one grad call for
    the K outputs with respect to the K views and weights."""
    T = BENCH_ELEMENTS // N // QK_HEADS
    outs, inputs, grads = [], [], []
    ws = []
    for _ in range(K):
        qkv = torch.randn(T, 3 * QK_HEADS * N, device="cuda", dtype=torch.bfloat16)
        q = qkv.requires_grad_().view(T, 3, QK_HEADS, N)[:, 0]
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        outs.append(norm(q, w, None, N))
        inputs.append(q)
        ws.append(w)
        grads.append(torch.randn_like(outs[-1]))
    inputs += ws
    return lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True)


NORMS = {
    "rmsnorm": {
        "kbuild": lambda h, w, b, N: kbuild.rmsnorm(h, w, 1e-6),
        "eager": lambda h, w, b, N: F.rms_norm(h, (N,), w, 1e-6),
    },
    "layernorm": {
        "kbuild": lambda h, w, b, N: kbuild.layernorm(h, w, b, 1e-5),
        "eager": lambda h, w, b, N: F.layer_norm(h, (N,), w, b, 1e-5),
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "path",
        nargs="?",
        help="results JSON (default: bench/results/<gpu>_backward_chain_<date>.json)",
    )
    parser.add_argument("--n", default=",".join(map(str, BENCH_N)), help="row lengths")
    parser.add_argument("--ops", default=",".join(NORMS), help="comma-separated norms")
    parser.add_argument("--view", action="store_true", help="q views of fused qkv buffers")
    parser.add_argument("--profile", action="store_true", help="kbuild's kernels, us per norm")
    parser.add_argument("--rounds", type=int, default=1, help="sweeps, each entry's median kept")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    build = views if args.view else chain
    path = args.path or default_path("{gpu}_backward_chain_{date}.json")
    copy = measure_copy()
    bytes_per_norm = 3 * BENCH_ELEMENTS * 2  # read x, dy; write dx

    def of_copy(ms: float) -> float:
        return bytes_per_norm / ms / 1e6 / copy

    entries = [(op, int(n)) for op in args.ops.split(",") for n in args.n.split(",")]
    times: dict[tuple[str, int, str], list[float]] = {}
    kernels: dict[tuple[str, int], dict[str, float]] = {}
    for r in range(args.rounds):
        for op, N in entries:
            line = {}
            for name, norm in NORMS[op].items():
                fn = build(norm, N, op == "layernorm")
                ms = median_ms(fn, reps=10) / K
                times.setdefault((op, N, name), []).append(ms)
                line[name] = round(of_copy(ms), 4)
                if args.profile and name == "kbuild" and r == 0:
                    per_call = kernel_device_us(fn, reps=4, warmup=1)
                    kernels[op, N] = {k: round(us / K, 2) for k, us in per_call.items()}
                del fn
            print(f"round {r}", op, N, "of copy", line, kernels.get((op, N), ""), flush=True)
            torch.cuda.empty_cache()

    def summary(ms: list[float]) -> dict:
        shares = sorted(of_copy(t) for t in ms)
        out = {"ms": round(statistics.median(ms), 4)}
        out["of_copy"] = round(statistics.median(shares), 4)
        if len(ms) > 1:
            out["of_copy_range"] = [round(shares[0], 4), round(shares[-1], 4)]
        return out

    rows = []
    for op, N in entries:
        row = {"op": op, "N": N}
        for name in NORMS[op]:
            row[name] = summary(times[op, N, name])
        if (op, N) in kernels:
            row["kbuild"]["kernels_us"] = kernels[op, N]
        rows.append(row)
        print(op, N, {k: v for k, v in row.items() if k not in ("op", "N")}, flush=True)
    with open(path, "w") as f:
        json.dump(
            {
                "gpu": torch.cuda.get_device_name(),
                "copy_gbps": copy,
                "K": K,
                "layout": "qkv views" if args.view else "dense",
                "rounds": args.rounds,
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
