"""Launch-shape sweep: time each kernel at several `threads_per_row` against the default
choice, to check the config chooser. Shapes as the benchmarks (bf16, M*N = 64 Mi).

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
from kbuild.runtime.cuda import Launcher  # noqa: E402
from kbuild.timing import gbps, median_ms  # noqa: E402


def main() -> None:
    copy = measure_copy()
    rows = []
    for spec in manifest("tune"):
        launcher = Launcher(artifact_for(spec, device_target(0)), 0)
        N = spec["N"]
        M = BENCH_ELEMENTS // N
        x, y = (torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        stream = stream_of(0)
        if spec.kernel == "rmsnorm_fwd":
            nbytes = 2 * x.numel() * 2
            grid = -(-M // launcher.rows_per_block)
            args = (x.data_ptr(), w.data_ptr(), y.data_ptr(), M)
        else:
            dy = torch.randn_like(x)
            rstd = torch.rand(M, device="cuda") + 0.5
            grid = min(-(-M // launcher.rows_per_block), launcher.resident_blocks)
            part = torch.empty(grid * launcher.rows_per_block, N, device="cuda")
            nbytes = 3 * x.numel() * 2
            ptrs = (x, w, dy, rstd, y, part)
            args = (*(t.data_ptr() for t in ptrs), M)
        fn = functools.partial(launcher, grid, stream, *args)
        bw = gbps(nbytes, median_ms(fn))
        meta = launcher.meta
        row = dict(
            kernel=spec.kernel,
            N=N,
            tpr=spec.kwargs.get("threads_per_row"),
            block=meta["block"],
            regs=meta.get("registers"),
            gbps=round(bw),
            of_copy=round(bw / copy, 3),
            resident=launcher.resident_blocks,
        )
        print(row, flush=True)
        rows.append(row)
    with open(sys.argv[1] if len(sys.argv) > 1 else "bench/results/tune.json", "w") as f:
        json.dump({"copy_gbps": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
