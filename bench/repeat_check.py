"""Run each `tune` variant many times on the same inputs and check every output is bitwise
identical to the first: a race in a kernel's synchronisation shows as a mismatch.

    python bench/repeat_check.py [repeats]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.tune import _OPTIONS, _arguments  # noqa: E402
from kbuild.cases import BENCH_ELEMENTS  # noqa: E402
from kbuild.cli.manifest import manifest  # noqa: E402
from kbuild.jit import artifact_for, device_target  # noqa: E402
from kbuild.op.tensors import stream_of  # noqa: E402
from kbuild.runtime.cuda import Launcher  # noqa: E402


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    for spec in manifest("tune"):
        launcher = Launcher(artifact_for(spec, device_target(0)), 0)
        M = BENCH_ELEMENTS // spec["N"]
        grid, args, tensors = _arguments(launcher, M, spec["N"])
        outputs = [n for n in ("y", "dx", "rstd", "dw_partial", "db_partial") if n in tensors]
        launcher(grid, stream_of(0), *args)
        first = {n: tensors[n].clone() for n in outputs}
        bad = 0
        for _ in range(repeats):
            launcher(grid, stream_of(0), *args)
            bad += any(not torch.equal(tensors[n], first[n]) for n in outputs)
        torch.cuda.synchronize()
        options = {k: v for k, v in spec.kwargs.items() if k in _OPTIONS}
        print(f"{spec.kernel} N={spec['N']} {options}: {bad} of {repeats} runs differ")


if __name__ == "__main__":
    main()
