"""Rows that are not a whole number of 16-byte vectors (RowConfig.peel, dsl/rows.py): which
shapes they take, that their columns cover every element of every row once at aligned
addresses whatever the row's phase, that a persistent walk keeps each block at one phase, and
that the kernels read the body of a row in 16-byte vectors. The values are the GPU suite's
(TEST_N holds peeled widths) and bench/bench_rows.py's."""

from __future__ import annotations

import math
import re

import pytest

from kbuild.compiler import build
from kbuild.plan.config import FORWARD_BUDGET, RowBudget, choose_row_config
from kbuild.plan.norms import NormBackward, plan_backward
from kbuild.registry import KERNELS
from kbuild.targets import target_for_arch
from kbuild.targets.nvidia import module_to_ptx

from .row_cover import covered

SM90 = target_for_arch("sm_90")
BACKWARD = RowBudget(64, 3.0, tuple(range(1, 17)), short_iters=1)


@pytest.mark.parametrize(
    "N, dtype, budget, max_cluster",
    [
        (4097, "bf16", FORWARD_BUDGET, 8),
        (5123, "bf16", FORWARD_BUDGET, 8),
        (2301, "bf16", FORWARD_BUDGET, 8),  # no spare threads: the cover must count the shift
        (4097, "bf16", BACKWARD, 8),
        (50257, "bf16", RowBudget(words_per_elem=1.0), 8),
        (50257, "bf16", RowBudget(words_per_elem=2.0), 8),
        (65537, "bf16", FORWARD_BUDGET, 8),
        (65537, "bf16", FORWARD_BUDGET, 1),  # chunked: no clusters (sm_80, AMD)
        (3001, "f32", FORWARD_BUDGET, 8),
        (12289, "f16", FORWARD_BUDGET, 1),
    ],
)
def test_peeled_columns_cover_each_element_once_at_every_phase(N, dtype, budget, max_cluster):
    """Catches a cover one vector short (a row's last elements never written at phase 7),
    slices that overlap or leave a gap, and accesses the shift leaves unaligned."""
    cfg = choose_row_config(N, dtype, 32, budget=budget, max_cluster=max_cluster)
    assert cfg.peel and cfg.vec * {"bf16": 2, "f16": 2, "f32": 4}[dtype] == 16
    assert cfg.rows_per_block == 1
    for hits in covered(cfg, lambda phase: phase):
        assert set(hits) == {1}


def test_peeled_rows_take_the_shape_of_the_aligned_width_below():
    """4097 and 5123 run as 4096 and 5120 do (the same vectors per thread), with a warp more
    for the vector a row's phase brings into view; not chunked, not split."""
    for N, aligned in ((4097, 4096), (5123, 5120)):
        for budget in (FORWARD_BUDGET, BACKWARD):
            a = choose_row_config(aligned, "bf16", 32, budget=budget, max_cluster=8)
            p = choose_row_config(N, "bf16", 32, budget=budget, max_cluster=8)
            assert (p.iters, p.cluster, p.chunked) == (a.iters, a.cluster, a.chunked)
            assert 0 < p.threads_per_row - a.threads_per_row <= 32 * 2


def test_a_peeled_row_its_aligned_width_would_chunk_is_held_by_a_wider_cluster():
    """50256's slices must be whole vectors, so it splits 2 ways and walks each half twice;
    50257's slices are rounded up to whole vectors, so it splits 8 ways and holds its row
    (softmax's forward at (4096, 50257) on an H100: 41.5% of copy as 50256's plan, 66.3% at
    cluster 8), for the online forwards that ask (their backwards measured better chunked).
    Catches the rule lost (the chunked plan inherited), and it taken where the wider cluster
    would chunk too, with no cluster to widen to, or for a budget that did not ask."""
    from kbuild.plan.rows import online_budget, plan_rows

    def plan(N, target=SM90, budget=None):  # as softmax's and cross-entropy's forwards
        budget = budget or online_budget("bf16")
        return plan_rows(N, "bf16", target, budget=budget, persistent=False).row

    a, p = plan(50256), plan(50257)
    assert (a.cluster, a.chunked) == (2, True)
    assert (p.cluster, p.chunked) == (8, False)
    assert (p.threads_per_row * p.iters * p.vec) * 8 >= 50257 + 7 * 8  # slices and phases
    assert (plan(151937).cluster, plan(151937).chunked) == (8, True)  # 8 ways chunks too
    no_clusters = plan(50257, target_for_arch("sm_80"))
    assert (no_clusters.cluster, no_clusters.chunked) == (1, True)
    two_arrays = plan(50257, budget=RowBudget(words_per_elem=2.0))  # a backward: not asked
    assert (two_arrays.cluster, two_arrays.chunked) == (2, True)


def test_short_and_grouped_odd_rows_take_scalar_accesses():
    """Rows sharing a block would each have their own phase (the block's partials are summed
    column by column): short odd rows stay scalar, as does a strided x whose rows and the
    dense ones start at different phases."""
    assert choose_row_config(127, "bf16", 32).vec == 1
    assert choose_row_config(1001, "bf16", 32, budget=BACKWARD).vec == 1
    strided = NormBackward(name="rmsnorm_bwd", N=4097, dtype="bf16", x_dtype="bf16")
    assert plan_backward(strided, SM90, True).row.peel
    grouped = NormBackward(name="rmsnorm_bwd", N=4097, dtype="bf16", x_dtype="bf16")
    object.__setattr__(grouped, "strided", True)
    assert plan_backward(grouped, SM90, True).row.vec == 1


def walk(block: int, blocks: int, classes: int, count: int) -> list[int]:
    """RowGroups' walk over peeled rows (dsl/row_walk.py), in Python: block b takes the groups
    of class b % classes; blocks past a whole number of classes take none."""
    per_class = max(blocks // classes, 1)
    index = block // classes
    first = block % classes + index * classes if index < per_class else count
    return list(range(first, count, per_class * classes))


@pytest.mark.parametrize("N", [4097, 4098, 4100, 5123, 65537])
@pytest.mark.parametrize("blocks", [1, 3, 8, 132, 264])
def test_a_persistent_walk_keeps_each_block_at_one_phase(N, blocks):
    """Catches a walk that gives a block rows of several phases (its dw partials would add
    columns of different rows' elements) or takes a row twice or never."""
    vec, count = 8, 1000
    classes = vec // math.gcd(N, vec)
    blocks = min(blocks, count)
    taken = []
    for b in range(blocks):
        rows = walk(b, blocks, classes, count)
        assert len({r * N % vec for r in rows}) <= 1
        taken += rows
    if blocks >= classes:
        assert sorted(taken) == list(range(count))


def _ptx(spec) -> str:
    return module_to_ptx(build(spec, SM90).module, SM90).decode()


def test_a_peeled_row_is_read_and_written_in_16_byte_vectors():
    """The body of a 4097-wide row moves as ld/st.global.v4 (its x and y); its weight, at the
    shifted columns, and the partial vectors element by element. The aligned 4096 kernel has
    no element path at all."""
    rms = KERNELS["rmsnorm_fwd"]
    odd = _ptx(rms.spec(N=4097, dtype="bf16", weight_dtype="bf16", store_rstd=True, eps=1e-6))
    even = _ptx(rms.spec(N=4096, dtype="bf16", weight_dtype="bf16", store_rstd=True, eps=1e-6))
    vector_loads = len(re.findall(r"ld\.global\.v4\.", odd))
    assert vector_loads >= 4 and len(re.findall(r"st\.global\.v4\.", odd)) >= 4
    assert re.search(r"ld\.global\.(b16|u16)", odd) and re.search(r"st\.global\.b16", odd)
    assert not re.search(r"ld\.global\.(b16|u16)", even)
