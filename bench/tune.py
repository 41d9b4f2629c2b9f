"""Launch-shape sweep: time each kernel variant of the `tune` manifest (launch-plan fields
forced: threads per row, blocks per row in a cluster, prefetch, a persistent grid, ...), the
kernel alone (a backward with the column sum of its dw/db partials, as the op runs it), back
to back. Shapes as the benchmarks (bf16, M*N = 64 Mi).

    kbuild warmup --manifest tune ...   then   python bench/tune.py [out.json] [kernel:N ...]

(`kernel:N` arguments, e.g. layernorm_bwd:65536: only those kernels' variants.) Default file:
bench/results/<gpu>_tune_<date>.json; name the sweep by a word before the date, as the
committed ones are (h200_tune_lagged_2026-12-04.json).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import default_path, measure_copy  # noqa: E402
from kbuild.cases import BENCH_ELEMENTS  # noqa: E402
from kbuild.cli.manifest import manifest  # noqa: E402
from kbuild.jit import artifact_for, device_target  # noqa: E402
from kbuild.op.launch import column_sum, persistent_grid, rows_grid  # noqa: E402
from kbuild.op.tensors import stream_of  # noqa: E402
from kbuild.plan.norms import BackwardPlan, ForwardPlan  # noqa: E402
from kbuild.plan.rows import override_keywords  # noqa: E402
from kbuild.runtime.cuda import Launcher  # noqa: E402
from kbuild.timing import gbps, median_ms  # noqa: E402
from kbuild.trace_layout import TRACE_ITERATIONS, TRACE_WORDS  # noqa: E402

# Row-sized arrays each kernel reads (the rest it writes); the byte count is the tensors of
# M x N elements the kernel must move (row stats and parameters are noise at these sizes).
_MOVED = {
    "rmsnorm_fwd": 2,
    "layernorm_fwd": 2,
    "rmsnorm_bwd": 3,
    "layernorm_bwd": 3,
    "fused_add_rmsnorm_fwd": 4,  # x, residual -> y, residual_out
    "fused_add_rmsnorm_bwd": 4,  # x (residual_out), dy, dresidual_out -> dx
}


ROUNDS = 5
# Launch-plan fields a variant may force, by builder keyword (kbuild/plan/norms.py).
_OPTIONS = tuple(dict.fromkeys(override_keywords(ForwardPlan) + override_keywords(BackwardPlan)))
# Diagnostic: these kernels also run on a fraction of their persistent grid. If the time per
# row group stays the same with half the clusters, the loop is bound by its per-row chain
# (latency); if the bandwidth holds, by the memory system.
_GRID_FRACTIONS = {("layernorm_fwd", 65536): (0.5,), ("layernorm_bwd", 65536): (0.5,)}
# Diagnostic: these kernels also run on a row count that their resident clusters divide
# (the persistent grid's last round full): the gap to the standard M is the tail's cost.
_EVEN_ROUNDS = {("layernorm_fwd", 65536), ("layernorm_bwd", 65536)}


def _arguments(
    launcher: Launcher, M: int, N: int, fraction: float = 1.0
) -> tuple[int, list[int], dict[str, torch.Tensor]]:
    """Grid (persistent grids: `fraction` of it), and arguments bound by signature name
    (inputs random, outputs scratch), with the tensors behind the pointers by name, which
    must outlive the launches."""
    if launcher.meta.get("grid") == "persistent":
        grid, partial_rows = persistent_grid(launcher, M)
        clusters = max(1, int(grid // launcher.cluster * fraction))
        grid, partial_rows = clusters * launcher.cluster, clusters
    else:
        grid, partial_rows = rows_grid(launcher, M), 0
    keep = {}

    def tensor(name: str) -> torch.Tensor:
        if name in ("weight", "bias"):
            t = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        elif name in ("mean", "rstd"):
            t = torch.rand(M, device="cuda") + 0.5
        elif name == "trace":  # a diagnostic build's timestamps (dsl.trace)
            t = torch.zeros(grid, TRACE_ITERATIONS, TRACE_WORDS, device="cuda", dtype=torch.int64)
        elif name.endswith("_partial"):  # a plane of the op's one workspace
            if "workspace" not in keep:
                planes = sum(n.endswith("_partial") for n in launcher.names)
                keep["workspace"] = torch.empty(planes, partial_rows, N, device="cuda")
            t = keep["workspace"][sum(n.endswith("_partial") for n in keep)]
        else:
            t = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        keep[name] = t
        return t

    args = [M if name == "M" else tensor(name).data_ptr() for name in launcher.names]
    return grid, args, keep


def _with_column_sum(kernel, workspace: torch.Tensor) -> None:
    kernel()
    column_sum(workspace, torch.bfloat16, 0, stream_of(0))


def _error(spec, t: dict[str, torch.Tensor]) -> float | None:
    """Largest error of the variant's output (y, or dx, and a backward's dw and db from its
    workspace) against an fp32 torch reference of the same inputs, relative to the output's
    largest magnitude: a variant that is fast but wrong shows here (bf16 rounding alone is
    about 4e-3)."""
    f = {n: v.float() for n, v in t.items() if not n.endswith("_partial") and n != "workspace"}
    x, w = f["x"], f.get("weight")
    if spec.kernel == "fused_add_rmsnorm_fwd":
        return None  # its reference needs the residual sum first; the GPU tests check it
    if spec.kernel.endswith("_fwd"):
        eps = spec["eps"]
        if spec.kernel == "layernorm_fwd":
            ref = torch.nn.functional.layer_norm(x, x.shape[-1:], w, f.get("bias"), eps)
        else:
            ref = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
            ref = ref if w is None else ref * w
        out = f["y"]
    elif spec.kernel in ("rmsnorm_bwd", "layernorm_bwd"):
        rstd = f["rstd"][:, None]
        x_hat = (x - f["mean"][:, None]) * rstd if "mean" in f else x * rstd
        wdy = f["dy"] if w is None else f["dy"] * w
        g = wdy - x_hat * (wdy * x_hat).mean(-1, keepdim=True)
        if "mean" in f:
            g = g - wdy.mean(-1, keepdim=True)
        ref, out = g * rstd, f["dx"]
        if "workspace" in t:  # dw and/or db: the sums of the workspace's partial rows
            references = {"dw_partial": (f["dy"] * x_hat).sum(0), "db_partial": f["dy"].sum(0)}
            planes = [n for n in t if n.endswith("_partial")]  # in the workspace's order
            sums = t["workspace"].sum(1)
            errors = [_relative(s, references[n]) for n, s in zip(planes, sums, strict=True)]
            return max([_relative(out, ref)] + errors)
    else:
        return None
    return _relative(out, ref)


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", nargs="?", help="results JSON (default: see above)")
    parser.add_argument("kernels", nargs="*", metavar="kernel:N", help="only these kernels")
    args = parser.parse_args()
    path = args.out or default_path("{gpu}_tune_{date}.json")
    copy = measure_copy()
    rows = []
    variants = []
    only = set(args.kernels)
    for spec in manifest("tune"):
        if only and f"{spec.kernel}:{spec['N']}" not in only:
            continue
        launcher = Launcher(artifact_for(spec, device_target(0)), 0)
        N = spec["N"]
        M = BENCH_ELEMENTS // N
        chosen = not any(k in spec.kwargs for k in _OPTIONS)  # the chooser's own pick
        shapes = [(1.0, M)]
        if chosen:
            shapes += [(f, M) for f in _GRID_FRACTIONS.get((spec.kernel, N), ())]
            if (spec.kernel, N) in _EVEN_ROUNDS and launcher.meta.get("grid") == "persistent":
                groups = launcher.resident_clusters * launcher.rows_per_block
                shapes.append((1.0, M // groups * groups))
        for fraction, m in shapes:
            grid, args, tensors = _arguments(launcher, m, N, fraction)
            fn = functools.partial(launcher, grid, stream_of(0), *args)
            if "workspace" in tensors:  # a backward: its column sum too, as the op runs it
                fn = functools.partial(_with_column_sum, fn, tensors["workspace"])
            moved = _MOVED[spec.kernel] * m * N * 2
            variants.append((spec, launcher, fn, moved, tensors, fraction, grid, m))
    # Rounds over all variants, so a drift in the GPU's state hits each variant alike; the
    # median over rounds is reported, with the spread.
    times = [[] for _ in variants]
    for _ in range(ROUNDS):
        for (_, _, fn, *_), ts in zip(variants, times, strict=True):
            ts.append(median_ms(fn, reps=20, warmup_ms=30.0))
    for (spec, launcher, _, moved, tensors, fraction, grid, M), ts in zip(
        variants, times, strict=True
    ):
        ts = sorted(ts)
        bw = gbps(moved, ts[len(ts) // 2])
        meta = launcher.meta
        row = dict(
            kernel=spec.kernel,
            N=spec["N"],
            block=meta.get("block"),
            cluster=meta.get("cluster"),
            options={k: v for k, v in spec.kwargs.items() if k in _OPTIONS},
            affine=spec.kwargs.get("weight_dtype") is not None,
            smem=meta.get("dynamic_shared_bytes", 0) + meta.get("shared_bytes", 0),
            regs=meta.get("registers"),
            spills=meta.get("spill_stores"),
            gbps=round(bw),
            of_copy=round(bw / copy, 3),
            spread=[round(gbps(moved, t) / copy, 3) for t in (ts[-1], ts[0])],
            resident_clusters=launcher.resident_clusters,
            grid=grid,
            grid_fraction=fraction,
            M=M,
            error=_error(spec, tensors),
        )
        print(row, flush=True)
        rows.append(row)
    with open(path, "w") as f:
        commit = os.environ.get("KBUILD_COMMIT")
        json.dump({"commit": commit, "copy_gbps": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
