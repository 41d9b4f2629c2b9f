"""Launch-shape sweep: time each kernel variant of the `tune` manifest (threads per row,
blocks per row in a cluster, prefetch, where the backward's partials live), the kernel alone,
back to back. Shapes as the benchmarks (bf16, M*N = 64 Mi).

    kbuild warmup --manifest tune ...   then   python bench/tune.py [out.json]
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import measure_copy  # noqa: E402
from kbuild.jit import artifact_for, device_target  # noqa: E402
from kbuild.manifest import BENCH_ELEMENTS, manifest  # noqa: E402
from kbuild.ops.common import stream_of  # noqa: E402
from kbuild.ops.launch import persistent_grid, rows_grid  # noqa: E402
from kbuild.runtime.cuda import Launcher  # noqa: E402
from kbuild.timing import gbps, median_ms  # noqa: E402

# Row-sized arrays each kernel reads (the rest it writes); the byte count is the tensors of
# M x N elements the kernel must move (row stats and parameters are noise at these sizes).
_MOVED = {
    "rmsnorm_fwd": 2,
    "layernorm_fwd": 2,
    "rmsnorm_bwd": 3,
    "layernorm_bwd": 3,
    "fused_add_rmsnorm_bwd": 4,  # x (residual_out), dy, dresidual_out -> dx
}


def _arguments(launcher: Launcher, M: int, N: int) -> tuple[int, list[int], list[torch.Tensor]]:
    """Grid, and arguments bound by signature name (inputs random, outputs scratch), with the
    tensors behind the pointers, which must outlive the launches."""
    if launcher.meta.get("grid") == "persistent":
        grid, partial_rows = persistent_grid(launcher, M)
    else:
        grid, partial_rows = rows_grid(launcher, M), 0
    keep = []

    def tensor(name: str) -> torch.Tensor:
        if name in ("weight", "bias"):
            t = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        elif name in ("mean", "rstd"):
            t = torch.rand(M, device="cuda") + 0.5
        elif name.endswith("_partial"):
            t = torch.empty(partial_rows, N, device="cuda")
        else:
            t = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        keep.append(t)
        return t

    args = [M if name == "M" else tensor(name).data_ptr() for name in launcher.names]
    return grid, args, keep


def main() -> None:
    copy = measure_copy()
    rows = []
    for spec in manifest("tune"):
        launcher = Launcher(artifact_for(spec, device_target(0)), 0)
        N = spec["N"]
        M = BENCH_ELEMENTS // N
        grid, args, _tensors = _arguments(launcher, M, N)
        fn = functools.partial(launcher, grid, stream_of(0), *args)
        bw = gbps(_MOVED[spec.kernel] * M * N * 2, median_ms(fn))
        meta = launcher.meta
        row = dict(
            kernel=spec.kernel,
            N=N,
            block=meta.get("block"),
            prefetch=spec.kwargs.get("prefetch"),
            cluster=meta.get("cluster"),
            shared=spec.kwargs.get("shared_partials"),
            smem=meta.get("dynamic_shared_bytes", 0) + meta.get("shared_bytes", 0),
            regs=meta.get("registers"),
            spills=meta.get("spill_stores"),
            gbps=round(bw),
            of_copy=round(bw / copy, 3),
            resident_clusters=launcher.resident_clusters,
        )
        print(row, flush=True)
        rows.append(row)
    with open(sys.argv[1] if len(sys.argv) > 1 else "bench/results/tune.json", "w") as f:
        json.dump({"copy_gbps": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
