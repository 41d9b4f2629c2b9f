"""CPU tests of the generic row plan (plan/rows.py, no MLIR): what a new row family
(a softmax, say) gets from `plan_rows` with its own needs, and that the norms' forward plan is
`plan_rows` with their rules around it (the norms' own picks: tests/test_plans_cpu.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kbuild.plan.config import RowBudget
from kbuild.plan.norms import NormForward, plan_forward
from kbuild.plan.rows import RowPlan, override_keywords, plan_rows
from kbuild.targets import target_for_arch

SM90, SM80, GFX942 = (target_for_arch(a) for a in ("sm_90", "sm_80", "gfx942"))


def _split(row) -> bool:  # a family's staging rule: rows split over a cluster
    return row.cluster > 1


def test_row_plan_imports_no_mlir():
    code = "import sys, kbuild.plan.rows; assert 'mlir' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_short_rows_take_one_block_a_row_group_no_persistent_grid():
    plan = plan_rows(4096, "bf16", SM90)
    assert (plan.row.threads_per_row, plan.row.iters, plan.row.vec) == (128, 4, 8)
    assert not plan.persistent and plan.stage == 0 and plan.exchange is None
    assert plan.blocks_per_sm == 8  # 1024 resident threads of exact rows


def test_long_rows_split_over_a_cluster_where_the_target_has_clusters():
    hopper = plan_rows(262144, "bf16", SM90, staged=["bf16"], stage_when=_split)
    assert hopper.row.cluster == 8 and not hopper.row.chunked
    assert hopper.persistent and hopper.stage == 1  # the family's rule, the target's copies
    assert hopper.exchange == "mbarrier"
    ampere = plan_rows(262144, "bf16", SM80, staged=["bf16"], stage_when=_split)
    assert ampere.row.cluster == 1 and ampere.row.chunked
    assert not ampere.persistent and ampere.stage == 0 and ampere.exchange is None
    amd = plan_rows(262144, "bf16", GFX942)
    assert amd.row.cluster == 1 and amd.row.threads_per_row % 64 == 0  # its wave of 64


def test_the_family_states_its_needs():
    # A row held as fp32 values (a word an element, not bf16's packed half) does not fit one
    # block of 1024 threads: it is split over a cluster.
    packed = plan_rows(65536, "bf16", SM90)
    wide = plan_rows(65536, "bf16", SM90, budget=RowBudget(words_per_elem=1.0))
    assert (packed.row.threads_per_row, packed.row.cluster) == (1024, 1)
    assert wide.row.cluster == 8 and not wide.row.chunked
    held = plan_rows(4096, "bf16", SM90, needs_persistent=True, resident_threads=512)
    assert held.persistent and held.blocks_per_sm == 4
    barrier = plan_rows(262144, "bf16", SM90, exchange="barrier")
    assert barrier.exchange == "barrier"


def test_overrides_are_honoured_or_refused():
    plan = plan_rows(
        65536, "bf16", SM90, staged=["bf16"], cluster=4, stage=2, cluster_sync="barrier"
    )
    assert (plan.row.cluster, plan.persistent, plan.stage, plan.exchange) == (4, True, 2, "barrier")
    with pytest.raises(ValueError, match="stage needs the dtypes of the arrays to stage"):
        plan_rows(65536, "bf16", SM90, stage=1)
    with pytest.raises(ValueError, match="stage needs a persistent grid"):
        plan_rows(65536, "bf16", SM90, staged=["bf16"], stage=1, persistent=False)
    with pytest.raises(ValueError, match="stage needs asynchronous copies"):
        plan_rows(65536, "bf16", GFX942, staged=["bf16"], stage=1)
    with pytest.raises(ValueError, match="cluster must be from 1 to 1 blocks on sm_80"):
        plan_rows(65536, "bf16", SM80, cluster=2)
    with pytest.raises(ValueError, match="needs rows split over a cluster"):
        plan_rows(4096, "bf16", SM90, cluster_sync="mbarrier")


def test_override_keywords_of_the_row_plan_are_keywords_of_plan_rows():
    import inspect

    keywords = set(inspect.signature(plan_rows).parameters)
    assert set(override_keywords(RowPlan)) <= keywords


@pytest.mark.parametrize("N", [1000, 4096, 16384, 65536, 262144])
def test_the_norm_forward_is_plan_rows_with_its_rules(N):
    # RMSNorm's forward stages nothing and holds nothing: its plan is plan_rows's, with the
    # forward's register budget and the target's register scale.
    p = NormForward(name="rmsnorm_fwd", N=N, dtype="bf16", weight_dtype="bf16", eps=1e-6)
    norm = plan_forward(p, SM90, True)
    rows = plan_rows(
        N,
        "bf16",
        SM90,
        budget=RowBudget(words_per_elem=0.5),
        register_scale=SM90.forward_register_scale,
        staged=["bf16"],
    )
    assert (norm.row, norm.persistent, norm.stage, norm.blocks_per_sm, norm.exchange) == (
        rows.row,
        rows.persistent,
        rows.stage,
        rows.blocks_per_sm,
        rows.exchange,
    )
