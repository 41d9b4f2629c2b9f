"""CPU tests of the launch plans (plan/norms.py), without MLIR: the chooser's pick for a
table of shapes and targets, how overrides combine with the fields left to the chooser, and
the errors for overrides a shape or target cannot honour.

A plan reads as `describe(plan)`: threads per row, vectors x elements per thread, then
only what applies: rows per block (r), blocks per row (c), chunked rows, a persistent grid
(the backward's always is), staged row groups, prefetch, shared dw/db partials, parameters
held in registers, the .minnctapersm cap (min) and the cluster exchange. Every kernel of
the tests, bench, tune and trace manifests builds the PTX it built when these choices were
made inside the builders (bench/ptx_hashes.py against bench/results/archive/ptx_hashes_before.json).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import subprocess
import sys

import pytest

from kbuild.plan.norms import (
    BackwardPlan,
    ForwardPlan,
    NormBackward,
    NormForward,
    plan_backward,
    plan_forward,
)
from kbuild.plan.rows import override_keywords
from kbuild.targets import target_for_arch


def describe(plan: ForwardPlan | BackwardPlan) -> str:
    r = plan.row
    out = [f"{r.threads_per_row}t", f"{r.iters}x{r.vec}"]
    out += [f"r{r.rows_per_block}"] if r.rows_per_block > 1 else []
    out += [f"c{r.cluster}"] if r.cluster > 1 else []
    out += ["chunked"] if r.chunked else []
    out += ["persistent"] if isinstance(plan, ForwardPlan) and plan.persistent else []
    out += [f"stage{plan.stage}"] if plan.stage else []
    if isinstance(plan, BackwardPlan):
        out += ["prefetch"] if plan.prefetch else []
        out += ["prefetch_l2"] if plan.prefetch_l2 else []
        out += ["shared"] if plan.shared_partials else []
    out += ["held"] if plan.resident_params else []
    out += ["words"] if isinstance(plan, ForwardPlan) and plan.word_widening else []
    out += [f"min{plan.blocks_per_sm}"] if plan.blocks_per_sm else []
    return " ".join(out + ([plan.exchange] if plan.exchange else []))


def problem(kernel: str, N: int, dtype: str = "bf16", **changes) -> NormForward | NormBackward:
    """The kernel with weights (and LayerNorm's bias) of its own dtype, stats stored."""
    d = dtype
    f = dict(name=kernel, N=N, dtype=d)
    b = dict(name=kernel, N=N, dtype=d, x_dtype=d)
    p = {
        "rmsnorm_fwd": NormForward(**f, weight_dtype=d, store_stats=True, eps=1e-6),
        "fused_fwd": NormForward(**f, weight_dtype=d, residual_dtype=d, store_stats=True, eps=1e-6),
        "layernorm_fwd": NormForward(
            **f, weight_dtype=d, bias_dtype=d, center=True, store_stats=True, eps=1e-5
        ),
        "rmsnorm_bwd": NormBackward(**b, weight_dtype=d, compute_dw=True),
        "fused_bwd": NormBackward(**b, weight_dtype=d, has_dres=True, compute_dw=True),
        "layernorm_bwd": NormBackward(
            **b, weight_dtype=d, center=True, compute_dw=True, compute_db=True
        ),
    }[kernel]
    return dataclasses.replace(p, **changes)


def plan(kernel: str, N: int, arch: str = "sm_90", dtype: str = "bf16", vectorize=True, **kw):
    p = problem(kernel, N, dtype)
    choose = plan_forward if isinstance(p, NormForward) else plan_backward
    return choose(p, target_for_arch(arch), vectorize, **kw)


def test_plans_import_no_mlir():
    code = "import sys, kbuild.plan.norms; assert 'mlir' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# kernel, N, dtype, target: the chooser's plan
CHOSEN = """
rmsnorm_fwd        1  bf16  sm_90   1t 1x1 r128 min8
rmsnorm_fwd     1000  bf16  sm_90   32t 4x8 r4
rmsnorm_fwd     1000  f32   sm_90   64t 4x4 r2
rmsnorm_fwd     4096  bf16  sm_90   128t 4x8 min8
rmsnorm_fwd     4096  f32   sm_90   256t 4x4 min4
rmsnorm_fwd    16384  bf16  sm_90   512t 4x8 words min2
rmsnorm_fwd    16384  f32   sm_90   1024t 4x4 min1
rmsnorm_fwd    65536  bf16  sm_90   1024t 8x8 words min1
rmsnorm_fwd    65536  f32   sm_90   512t 4x4 c8 min2 mbarrier
fused_fwd          1  bf16  sm_90   1t 1x1 r128 min8
fused_fwd       1000  bf16  sm_90   32t 4x8 r4
fused_fwd       1000  f32   sm_90   64t 4x4 r2
fused_fwd       4096  bf16  sm_90   128t 4x8 min8
fused_fwd       4096  f32   sm_90   256t 4x4 min4
fused_fwd      16384  bf16  sm_90   512t 4x8 min2
fused_fwd      16384  f32   sm_90   1024t 4x4 min1
fused_fwd      65536  bf16  sm_90   256t 4x8 c8 min4 mbarrier
fused_fwd      65536  f32   sm_90   512t 4x4 c8 min2 mbarrier
layernorm_fwd      1  bf16  sm_90   1t 1x1 r128 min8
layernorm_fwd   1000  bf16  sm_90   32t 4x8 r4
layernorm_fwd   1000  f32   sm_90   64t 4x4 r2
layernorm_fwd   4096  bf16  sm_90   128t 4x8 min8
layernorm_fwd   4096  f32   sm_90   256t 4x4 min4
layernorm_fwd  16384  bf16  sm_90   512t 4x8 persistent stage1 min2
layernorm_fwd  16384  f32   sm_90   1024t 4x4 persistent stage1 min1
layernorm_fwd  65536  bf16  sm_90   256t 4x8 c8 persistent stage1 held min3 mbarrier
layernorm_fwd  65536  f32   sm_90   512t 4x4 c8 persistent stage1 min2 mbarrier
rmsnorm_bwd        1  bf16  sm_90   1t 1x1 r128 prefetch min8
rmsnorm_bwd       64  bf16  sm_90   8t 1x8 r16 prefetch min8
rmsnorm_bwd      128  bf16  sm_90   16t 1x8 r8 prefetch min8
fused_bwd        128  bf16  sm_90   16t 1x8 r8 prefetch shared min8
layernorm_bwd    128  bf16  sm_90   16t 1x8 r8 prefetch
rmsnorm_fwd      128  bf16  sm_90   4t 4x8 r32 min8
rmsnorm_bwd     1000  bf16  sm_90   32t 4x8 r4 prefetch
rmsnorm_bwd     1000  f32   sm_90   64t 4x4 r2 prefetch
rmsnorm_bwd     4096  bf16  sm_90   512t 1x8 prefetch min2
rmsnorm_bwd     4096  f32   sm_90   512t 2x4 min2
rmsnorm_bwd    16384  bf16  sm_90   1024t 2x8 prefetch prefetch_l2 shared min1
rmsnorm_bwd    16384  f32   sm_90   512t 1x4 c8 prefetch shared min2 mbarrier
rmsnorm_bwd    65536  bf16  sm_90   512t 2x8 c8 stage2 prefetch_l2 held min1 lagged
rmsnorm_bwd    65536  f32   sm_90   1024t 2x4 c8 shared min1 mbarrier
fused_bwd          1  bf16  sm_90   1t 1x1 r128 prefetch shared min8
fused_bwd       1000  bf16  sm_90   32t 4x8 r4 prefetch shared
fused_bwd       1000  f32   sm_90   64t 4x4 r2 prefetch shared
fused_bwd       4096  bf16  sm_90   256t 2x8 shared min4
fused_bwd       4096  f32   sm_90   512t 2x4 shared min2
fused_bwd      16384  bf16  sm_90   1024t 2x8 stage1 shared min1
fused_bwd      16384  f32   sm_90   256t 2x4 c8 stage1 shared min4 barrier
fused_bwd      65536  bf16  sm_90   512t 2x8 c8 stage1 shared min2 barrier
fused_bwd      65536  f32   sm_90   1024t 2x4 c8 stage1 shared min1 barrier
layernorm_bwd      1  bf16  sm_90   1t 1x1 r128 prefetch
layernorm_bwd   1000  bf16  sm_90   32t 4x8 r4 prefetch
layernorm_bwd   1000  f32   sm_90   64t 4x4 r2 prefetch
layernorm_bwd   4096  bf16  sm_90   256t 2x8 prefetch
layernorm_bwd   4096  f32   sm_90   512t 2x4 prefetch
layernorm_bwd   2048  bf16  sm_90   128t 2x8 r4 prefetch
layernorm_bwd  16384  bf16  sm_90   512t 2x8 c2 stage1 shared held min2 mbarrier
layernorm_bwd  16384  f32   sm_90   256t 2x4 c8 shared min4 mbarrier
layernorm_bwd  65536  bf16  sm_90   512t 2x8 c8 stage1 shared held min2 mbarrier
layernorm_bwd  65536  f32   sm_90   1024t 2x4 c8 stage1 shared min1 mbarrier
rmsnorm_fwd        1  bf16  sm_80   1t 1x1 r128 min8
rmsnorm_fwd     1000  bf16  sm_80   32t 4x8 r4
rmsnorm_fwd     4096  bf16  sm_80   128t 4x8 min8
rmsnorm_fwd    16384  bf16  sm_80   512t 4x8 words min2
rmsnorm_fwd    65536  bf16  sm_80   1024t 8x8 words min1
fused_fwd          1  bf16  sm_80   1t 1x1 r128 min8
fused_fwd       1000  bf16  sm_80   32t 4x8 r4
fused_fwd       4096  bf16  sm_80   128t 4x8 min8
fused_fwd      16384  bf16  sm_80   512t 4x8 min2
fused_fwd      65536  bf16  sm_80   512t 4x8 chunked
layernorm_fwd      1  bf16  sm_80   1t 1x1 r128 min8
layernorm_fwd   1000  bf16  sm_80   32t 4x8 r4
layernorm_fwd   4096  bf16  sm_80   128t 4x8 min8
layernorm_fwd  16384  bf16  sm_80   512t 4x8 persistent stage1 min2
layernorm_fwd  65536  bf16  sm_80   512t 4x8 chunked
rmsnorm_bwd        1  bf16  sm_80   1t 1x1 r128 prefetch min8
rmsnorm_bwd     1000  bf16  sm_80   32t 4x8 r4 prefetch
rmsnorm_bwd     4096  bf16  sm_80   512t 1x8 prefetch min2
rmsnorm_bwd    16384  bf16  sm_80   1024t 2x8 prefetch shared min1
rmsnorm_bwd    65536  bf16  sm_80   512t 4x8 chunked
fused_bwd          1  bf16  sm_80   1t 1x1 r128 prefetch shared min8
fused_bwd       1000  bf16  sm_80   32t 4x8 r4 prefetch shared
fused_bwd       4096  bf16  sm_80   256t 2x8 shared min4
fused_bwd      16384  bf16  sm_80   1024t 2x8 stage1 shared min1
fused_bwd      65536  bf16  sm_80   512t 4x8 chunked
layernorm_bwd      1  bf16  sm_80   1t 1x1 r128 prefetch
layernorm_bwd   1000  bf16  sm_80   32t 4x8 r4 prefetch
layernorm_bwd   4096  bf16  sm_80   256t 2x8 prefetch
layernorm_bwd  16384  bf16  sm_80   512t 4x8 chunked
layernorm_bwd  65536  bf16  sm_80   512t 4x8 chunked
rmsnorm_fwd        1  bf16  gfx942  1t 1x1 r128 min8
rmsnorm_fwd     1000  bf16  gfx942  32t 4x8 r4
rmsnorm_fwd     4096  bf16  gfx942  128t 4x8 min8
rmsnorm_fwd    16384  bf16  gfx942  512t 4x8 min2
rmsnorm_fwd    65536  bf16  gfx942  512t 4x8 chunked
fused_fwd          1  bf16  gfx942  1t 1x1 r128 min8
fused_fwd       1000  bf16  gfx942  32t 4x8 r4
fused_fwd       4096  bf16  gfx942  128t 4x8 min8
fused_fwd      16384  bf16  gfx942  512t 4x8 min2
fused_fwd      65536  bf16  gfx942  512t 4x8 chunked
layernorm_fwd      1  bf16  gfx942  1t 1x1 r128 min8
layernorm_fwd   1000  bf16  gfx942  32t 4x8 r4
layernorm_fwd   4096  bf16  gfx942  128t 4x8 min8
layernorm_fwd  16384  bf16  gfx942  512t 4x8 min2
layernorm_fwd  65536  bf16  gfx942  512t 4x8 chunked
rmsnorm_bwd        1  bf16  gfx942  1t 1x1 r128 prefetch min8
rmsnorm_bwd     1000  bf16  gfx942  32t 4x8 r4 prefetch
rmsnorm_bwd     4096  bf16  gfx942  512t 1x8 prefetch min2
rmsnorm_bwd    16384  bf16  gfx942  1024t 2x8 min1
rmsnorm_bwd    65536  bf16  gfx942  512t 4x8 chunked
fused_bwd          1  bf16  gfx942  1t 1x1 r128 prefetch shared min8
fused_bwd       1000  bf16  gfx942  32t 4x8 r4 prefetch shared
fused_bwd       4096  bf16  gfx942  256t 2x8 shared min4
fused_bwd      16384  bf16  gfx942  1024t 2x8 min1
fused_bwd      65536  bf16  gfx942  512t 4x8 chunked
layernorm_bwd      1  bf16  gfx942  1t 1x1 r128 prefetch
layernorm_bwd   1000  bf16  gfx942  32t 4x8 r4 prefetch
layernorm_bwd   2048  bf16  gfx942  128t 2x8 prefetch
layernorm_bwd   4096  bf16  gfx942  256t 2x8 prefetch
layernorm_bwd  16384  bf16  gfx942  512t 4x8 chunked
layernorm_bwd  65536  bf16  gfx942  512t 4x8 chunked
"""


def _rows(table: str) -> list[tuple]:
    rows = []
    for line in table.strip().splitlines():
        kernel, N, dtype, arch, *expected = line.split()
        rows.append((kernel, int(N), dtype, arch, " ".join(expected)))
    return rows


@pytest.mark.parametrize("kernel, N, dtype, arch, expected", _rows(CHOSEN))
def test_the_chooser_picks(kernel, N, dtype, arch, expected):
    assert describe(plan(kernel, N, arch, dtype)) == expected


# Parameters decide what is held in registers (N = 65536, bf16 rows, sm_90): 16-bit ones of
# rows split over a cluster; in the backward only w of packed bf16 rows, not the fused form
# with a residual gradient.
PARAMETERS = [
    (
        "layernorm_fwd",
        {"weight_dtype": "f32", "bias_dtype": "f32"},
        "256t 4x8 c8 persistent stage1 min4 mbarrier",
    ),
    ("layernorm_fwd", {"bias_dtype": None}, "256t 4x8 c8 persistent stage1 held min3 mbarrier"),
    (
        "layernorm_fwd",
        {"weight_dtype": None, "bias_dtype": None},
        "256t 4x8 c8 persistent stage1 min4 mbarrier",
    ),
    (
        "layernorm_fwd",
        {"dtype": "f16", "weight_dtype": "f16", "bias_dtype": "f16"},
        "256t 4x8 c8 persistent stage1 held min3 mbarrier",
    ),
    ("layernorm_bwd", {"weight_dtype": "f32"}, "512t 2x8 c8 stage1 shared min2 mbarrier"),
    (
        "layernorm_bwd",
        {"dtype": "f16", "x_dtype": "f16", "weight_dtype": "f16"},
        "512t 2x8 c8 stage1 shared min2 mbarrier",
    ),
    (
        "layernorm_bwd",
        {"weight_dtype": None, "compute_dw": False},
        "512t 2x8 c8 stage1 shared min2 mbarrier",
    ),
    ("fused_bwd", {"has_dres": False}, "512t 2x8 c8 stage2 prefetch_l2 held min1 lagged"),
    (
        "fused_bwd",
        {"has_dres": False, "dtype": "f16", "x_dtype": "f16", "weight_dtype": "f16"},
        "512t 2x8 c8 prefetch_l2 shared min2 mbarrier",  # bf16 rows only, as measured
    ),
    ("fused_bwd", {"x_dtype": "f32"}, "1024t 2x4 c8 shared min1 mbarrier"),
]


@pytest.mark.parametrize("kernel, changes, expected", PARAMETERS)
def test_parameters_the_chooser_holds(kernel, changes, expected):
    p = problem(kernel, 65536, **changes)
    choose = plan_forward if isinstance(p, NormForward) else plan_backward
    assert describe(choose(p, target_for_arch("sm_90"), True)) == expected


def _forced(table: str) -> list[tuple]:
    """Rows of `kernel N target key=value ... | expected`, comments (#) skipped."""
    rows = []
    for line in table.strip().splitlines():
        if line.startswith("#"):
            continue
        left, expected = line.split(" | ")
        kernel, N, arch, *pairs = left.split()
        overrides = {k: ast.literal_eval(v) for k, v in (pair.split("=") for pair in pairs)}
        rows.append((kernel, int(N), arch, overrides, expected.strip()))
    return rows


# The fields not given stay the chooser's, in agreement with those given.
OVERRIDDEN = """
# persistent=True no longer cancels the staging and held parameters that go with it.
layernorm_fwd 65536 sm_90 persistent=True | 256t 4x8 c8 persistent stage1 held min3 mbarrier
layernorm_fwd 65536 sm_90 persistent=True stage=1 resident_params=False | \
256t 4x8 c8 persistent stage1 min4 mbarrier
layernorm_fwd 65536 sm_90 persistent=False | 256t 4x8 c8 min4 mbarrier
layernorm_fwd 65536 sm_90 blocks_per_sm=4 | 256t 4x8 c8 persistent stage1 held min4 mbarrier
layernorm_fwd 65536 sm_90 cluster_sync='barrier' | 256t 4x8 c8 persistent stage1 held min3 barrier
layernorm_fwd 65536 sm_90 cluster=4 | 512t 4x8 c4 persistent stage1 min2 mbarrier
layernorm_fwd 4096 sm_90 persistent=True | 128t 4x8 persistent min8
# Staged rows and held parameters need a persistent grid: the chooser gives them one.
layernorm_fwd 4096 sm_90 stage=1 | 128t 4x8 persistent stage1 min8
layernorm_fwd 16384 sm_90 resident_params='registers' | 512t 4x8 persistent stage1 held min1
layernorm_fwd 16384 sm_80 stage=2 | 512t 4x8 persistent stage2 min2
# Rows of one warp per block keep the cluster barrier.
layernorm_fwd 4096 sm_90 cluster=8 | 32t 2x8 c8 persistent stage1 held min24 barrier
rmsnorm_fwd 65536 sm_90 threads_per_row=512 | 512t 16x8 words min2
# The second widening from packed words: RMSNorm's bf16 rows of one block of >= 512 threads
# (measured there); forced elsewhere, on bf16 rows only (refused below for f16).
rmsnorm_fwd 65536 sm_90 word_widening=False | 1024t 8x8 min1
rmsnorm_fwd 4096 sm_90 word_widening=True | 128t 4x8 words min8
layernorm_fwd 16384 sm_90 word_widening=True | 512t 4x8 persistent stage1 words min2
# Rows a forced block leaves too long for registers are split over a cluster, or chunked.
rmsnorm_fwd 65536 sm_90 threads_per_row=256 | 256t 4x8 c8 min4 mbarrier
rmsnorm_fwd 65536 sm_80 threads_per_row=256 | 256t 4x8 chunked
# An explicit prefetch keeps the rows out of shared memory, explicit staging the prefetch.
layernorm_bwd 65536 sm_90 prefetch=True | 512t 2x8 c8 prefetch shared held min2 mbarrier
layernorm_bwd 4096 sm_90 stage=1 | 256t 2x8 stage1
# A cap on the registers takes the prefetch of two vectors per thread away.
layernorm_bwd 4096 sm_90 blocks_per_sm=4 | 256t 2x8 min4
layernorm_bwd 65536 sm_90 shared_partials=False | 512t 2x8 c8 stage1 held mbarrier
layernorm_bwd 65536 sm_90 resident_params=False | 512t 2x8 c8 stage1 shared min2 mbarrier
fused_bwd 16384 sm_90 prefetch_l2=True | 1024t 2x8 stage1 prefetch_l2 shared min1
fused_bwd 65536 sm_90 stage=0 | 512t 2x8 c8 shared min2 mbarrier
fused_bwd 65536 sm_90 cluster_sync='mbarrier' | 512t 2x8 c8 stage1 shared min2 mbarrier
# RMSNorm's lagged rows at 65536 (one block an SM, staged) give way to a forced field that
# rules them out: the two-block plan they replaced (with 2 blocks an SM they spilled 216 B).
rmsnorm_bwd 65536 sm_90 stage=0 | 512t 2x8 c8 prefetch_l2 shared held min2 mbarrier
rmsnorm_bwd 65536 sm_90 prefetch=True | 512t 2x8 c8 prefetch shared held min2 mbarrier
rmsnorm_bwd 65536 sm_90 blocks_per_sm=2 | 512t 2x8 c8 prefetch_l2 shared held min2 mbarrier
rmsnorm_bwd 65536 sm_90 stage=1 | 512t 2x8 c8 stage1 prefetch_l2 held min1 lagged
# Several rows per block: the register cap follows the bigger block.
rmsnorm_bwd 1024 sm_90 rows_per_block=4 | 128t 1x8 r4 prefetch min2
layernorm_bwd 2048 sm_90 rows_per_block=4 | 128t 2x8 r4 prefetch
# Chunked rows add into their workspace row as they go: one row a block, never shared.
layernorm_bwd 65536 sm_80 threads_per_row=32 | 32t 4x8 chunked
# A forced thread count keeps its cluster (no fewer, fuller blocks: they spill).
layernorm_bwd 16384 sm_90 threads_per_row=128 | 128t 2x8 c8 shared held min8 mbarrier
"""


@pytest.mark.parametrize("kernel, N, arch, overrides, expected", _forced(OVERRIDDEN))
def test_overrides_and_the_fields_left_to_the_chooser(kernel, N, arch, overrides, expected):
    assert describe(plan(kernel, N, arch, **overrides)) == expected


REFUSED = """
layernorm_fwd 65536 sm_90 persistent=False stage=1 | stage needs a persistent grid (persistent=F
layernorm_fwd 16384 gfx942 stage=1 | stage needs asynchronous copies (cp.async), which gfx942 lacks
layernorm_bwd 16384 gfx942 stage=1 | stage needs asynchronous copies
layernorm_fwd 1000 sm_90 stage=1 | stage needs rows held in registers, exactly, in 16-byte vectors
layernorm_bwd 65536 sm_80 stage=1 | stage needs rows held in registers, exactly
layernorm_fwd 16384 sm_90 stage=-1 | stage must be a number of row groups (0 = none), not -1
layernorm_fwd 65536 sm_90 resident_params='shared' | None, False or 'registers', not 'shared'
layernorm_fwd 65536 sm_90 resident_params=True | must be None, False or 'registers', not True
layernorm_bwd 65536 sm_90 resident_params='shared' | None, False or 'registers', not 'shared'
layernorm_fwd 65536 sm_90 persistent=False resident_params='registers' | needs a persistent grid
layernorm_fwd 65536 sm_80 resident_params='registers' | chunked rows: True
layernorm_bwd 65536 sm_80 resident_params='registers' | needs rows held in registers (this row is
layernorm_bwd 65536 sm_90 prefetch=True stage=1 | prefetch loads the next row into registers: not
layernorm_bwd 65536 sm_80 prefetch=True | nor chunked ones (chunked rows: True)
layernorm_bwd 16384 sm_80 prefetch_l2=True | prefetch_l2 needs 16-byte vectors on Hopper or later
layernorm_bwd 65536 sm_80 shared_partials=True | shared_partials needs rows held in registers
layernorm_bwd 16384 sm_90 blocks_per_sm=0 | blocks_per_sm must be a positive number of blocks
layernorm_bwd 4096 gfx942 blocks_per_sm=2 | blocks_per_sm needs a target with an occupancy hint
layernorm_fwd 65536 sm_90 cluster=16 | cluster must be from 1 to 8 blocks on sm_90, not 16
layernorm_bwd 65536 sm_80 cluster=2 | cluster must be from 1 to 1 blocks on sm_80, not 2
layernorm_fwd 4104 sm_90 cluster=8 | a cluster of 8 cannot split rows of 4104 into vectors
layernorm_fwd 65536 sm_90 cluster_sync='fast' | one of ('barrier', 'mbarrier', 'lagged'), not 'fast'
layernorm_fwd 65536 sm_90 cluster_sync='lagged' | cluster_sync='lagged' is the backward's
layernorm_bwd 65536 sm_90 cluster_sync='lagged' stage=0 | needs staged rows (stage >= 1), not stage=
layernorm_bwd 4096 sm_90 cluster_sync='lagged' | cluster_sync='lagged' needs rows split over a
layernorm_bwd 4096 sm_90 cluster_sync='barrier' | cluster_sync='barrier' needs rows split over a
layernorm_bwd 65536 sm_80 cluster_sync='mbarrier' | cluster_sync='mbarrier' needs rows split over
layernorm_fwd 4096 sm_90 cluster=8 cluster_sync='mbarrier' | needs rows of more than 32 threads
rmsnorm_fwd 4096 sm_90 threads_per_row=48 | threads_per_row must be a multiple of 32
layernorm_bwd 65536 sm_90 threads_per_row=8192 cluster=8 | must be at most 1024 (a block's
layernorm_bwd 65536 sm_90 rows_per_block=2 | rows_per_block needs rows held by one block in
layernorm_bwd 65536 sm_80 rows_per_block=2 | (these take a cluster of 1, chunked: True)
layernorm_bwd 1024 sm_90 rows_per_block=16 | makes blocks of 2048 threads; they must be whole warps
layernorm_bwd 1024 sm_90 rows_per_block=0 | rows_per_block must be a positive number of rows, not 0
rmsnorm_bwd 64 sm_90 rows_per_block=1 | blocks of 8 threads; they must be whole warps of 32
"""


@pytest.mark.parametrize("kernel, N, arch, overrides, message", _forced(REFUSED))
def test_overrides_a_shape_or_target_cannot_honour_raise(kernel, N, arch, overrides, message):
    with pytest.raises(ValueError) as info:
        plan(kernel, N, arch, **overrides)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "kernel, changes, overrides, message",
    [
        # dy of bf16 next to an fp32 residual stream: 8-byte vectors of it.
        ("fused_bwd", dict(x_dtype="f32"), dict(prefetch_l2=True), "prefetch_l2 needs 16-byte"),
        ("fused_bwd", dict(x_dtype="f32"), dict(stage=1), "stage needs rows held in registers"),
        (
            "layernorm_bwd",
            dict(compute_dw=False, compute_db=False),
            dict(shared_partials=True),
            "shared_partials needs dw or db partials",
        ),
        (
            "layernorm_bwd",
            dict(weight_dtype=None, compute_dw=False),
            dict(resident_params="registers"),
            "needs a weight to hold",
        ),
        (
            "layernorm_fwd",
            dict(weight_dtype=None, bias_dtype=None),
            dict(resident_params="registers"),
            "needs a weight or bias to hold",
        ),
        (
            "rmsnorm_fwd",
            dict(dtype="f16", weight_dtype="f16"),
            dict(word_widening=True),
            "word_widening widens bf16 rows held packed; these are f16",
        ),
    ],
)
def test_overrides_the_parameters_cannot_honour_raise(kernel, changes, overrides, message):
    p = problem(kernel, 65536, **changes)
    choose = plan_forward if isinstance(p, NormForward) else plan_backward
    with pytest.raises(ValueError, match=message):
        choose(p, target_for_arch("sm_90"), True, **overrides)


@pytest.mark.parametrize(
    "kernel, removed",
    [
        # Each lost every sweep it was in, and no plan chose it (bench/results/README.md):
        ("layernorm_fwd", "stream_x"),  # h200_tune_forward_stage.json
        ("layernorm_fwd", "prefetch_l2"),  # h200_tune_reload.json, h200_tune_final.json
        ("layernorm_fwd", "reload"),  # h200_tune_reload.json, h200_tune_resident.json
        ("layernorm_bwd", "reload"),
    ],
)
def test_removed_options_are_no_keywords(kernel, removed):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{removed}'"):
        plan(kernel, 65536, **{removed: True})


@pytest.mark.parametrize(
    "plan_type, choose", [(ForwardPlan, plan_forward), (BackwardPlan, plan_backward)]
)
def test_each_override_keyword_is_a_keyword_of_the_chooser(plan_type, choose):
    keywords = [
        name
        for name, param in inspect.signature(choose).parameters.items()
        if param.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert override_keywords(plan_type) == tuple(keywords)
    # The fields are all the plan holds: each is chosen or forced, none is left unset.
    assert {f.name for f in dataclasses.fields(plan_type)} >= {"row", "stage", "exchange"}
