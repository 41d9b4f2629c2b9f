"""The row API a loss kernel needs, used as a user writes it: a per-row integer load (the
target id, i32 or i64), a gather at that column, per-element columns compared with it, and a
device-side report of a bad id. Built for sm_90 and gfx942 and read back in the PTX; the
values are the GPU's (cross-entropy's tests)."""

from __future__ import annotations

import re

import pytest

import kbuild
from kbuild import Arg, Param
from kbuild.compiler import build
from kbuild.plan.rows import plan_rows
from kbuild.targets import target_for_arch
from kbuild.targets.nvidia import module_to_ptx

SM90 = target_for_arch("sm_90")


NLL = dict(
    params=(Param("N", "int"), Param("dtype", "dtype"), Param("index", "index"),
            Param("trap_bad", "bool", False)),
    args=(Arg("logits"), Arg("targets"), Arg("loss"), Arg("hit"), Arg("flag"), Arg("M", "i64")),
)  # fmt: skip


def build_nll(N, dtype, index, target, trap_bad=False):
    """loss[r] = -logits[r, target[r]]; hit[r, c] = 1 where c == target[r]; a target outside
    [0, N) raises flag to 3 (or traps) and reads column 0 instead."""
    from kbuild.dsl import (
        Kernel,
        RowTile,
        const,
        eq,
        i64,
        report,
        select,
        to_f32,
        trap,
    )  # fmt: skip

    plan = plan_rows(N, dtype, target, persistent=False)
    with Kernel("test_row_api_nll", target, plan.row.block, cluster=plan.row.cluster,
                exchange=plan.exchange or "barrier") as k:  # fmt: skip
        logits, targets, loss, hit, flag = (k.ptr(n) for n in ("logits", "targets", "loss",
                                                               "hit", "flag"))  # fmt: skip
        t = RowTile(k, plan.row, k.i64("M"))
        tid = i64(t.load_row_scalar(targets, index))
        bad = (tid < 0) | (tid >= N)
        if trap_bad:
            trap(bad)
        else:
            report(flag, bad, 3)
        safe = select(bad, const(0, tid.type), tid)
        picked = to_f32(t.load_at(logits, safe, dtype))
        t.store_row_scalar(loss, -picked)
        ones = [select(eq(cols, safe), const(1.0), 0.0) for cols in t.element_columns()]
        t.store(hit, ones, dtype)
    k.meta.update(rows_per_block=plan.row.rows_per_block, cluster=plan.row.cluster)
    return k


@pytest.fixture(scope="module")
def nll():
    """The kernel, declared for this module only: declared at import, it would sit in the
    registry when later modules collect theirs (test_table_cpu builds every entry)."""
    from kbuild.registry import KERNELS

    definition = kbuild.kernel("test_row_api_nll", **NLL)(build_nll)
    yield definition
    KERNELS.pop(definition.name, None)


@pytest.mark.parametrize("N", [4096, 50257])
@pytest.mark.parametrize("index", ["i32", "i64"])
def test_a_loss_kernel_builds_from_the_row_api(nll, N, index):
    """Catches an integer per-row load read at the wrong width (an i32 id read as i64 reads
    two ids), a gather that lands on a float load of the wrong type, and a missing report."""
    spec = nll.spec(N=N, dtype="bf16", index=index)
    ptx = module_to_ptx(build(spec, SM90).module, SM90).decode()
    width = {"i32": "32", "i64": "64"}[index]
    assert re.search(rf"ld\.global\.[bsu]{width}\b", ptx), "the id is read at its own width"
    assert re.search(r"atom\.global\.max\.[su]32", ptx)  # the report, an int32 max
    assert re.search(r"st\.global\.v4", ptx)  # the hits, a row, in 16-byte vectors


def test_trap_stops_the_kernel(nll):
    spec = nll.spec(N=4096, dtype="bf16", index="i64", trap_bad=True)
    ptx = module_to_ptx(build(spec, SM90).module, SM90).decode()
    assert "trap;" in ptx and "atom.global.max" not in ptx


def test_the_row_api_lowers_for_amd(nll):
    from kbuild import compiler

    spec = nll.spec(N=50257, dtype="bf16", index="i32")
    text = compiler.lower(spec, target_for_arch("gfx942"))
    assert text  # ROCDL lowering of the gather, the per-element columns and the atomic max


def test_row_scalars_refuse_an_unknown_dtype():
    from mlir import ir  # noqa: F401  (the DSL needs it; the check comes before any op)

    from kbuild.dsl import Kernel, RowTile

    plan = plan_rows(4096, "bf16", SM90, persistent=False)
    with Kernel("test_row_api_bad", SM90, plan.row.block) as k:
        t = RowTile(k, plan.row, k.i64("M"))
        with pytest.raises(
            ValueError, match="RowTile.load_row_scalar: unknown dtype 'int64'; one of"
        ):
            t.load_row_scalar(k.ptr("x"), "int64")


def test_the_row_layer_names_its_misuse():
    """Each misuse raises naming the RowTile method or DSL function, before MLIR sees it
    (a store given too few values once failed inside zip(), a vector element in from_lanes
    inside the bindings)."""
    from kbuild.dsl import Kernel, RowTile, const, from_lanes, lanes, report, trap

    plan = plan_rows(4096, "bf16", SM90, persistent=False)
    with Kernel("test_row_api_misuse", SM90, plan.row.block) as k:
        x, M = k.ptr("x"), k.i64("M")
        with pytest.raises(TypeError, match=r"RowTile: rows \(M\) must be an i64 value"):
            RowTile(k, plan.row, 4096)
        t = RowTile(k, plan.row, M)
        with pytest.raises(
            ValueError, match=r"RowTile.store: values must be one per vector .*got 1"
        ):
            t.store(x, [const(1.0)], "bf16")
        with pytest.raises(TypeError, match="dsl.from_lanes: elements must be scalars of one"):
            from_lanes([const(1.0), const(1, "i32")])
        assert len(lanes(from_lanes([const(1.0)] * 4))) == 4
        with pytest.raises(TypeError, match="dsl.report: flag must be a pointer"):
            report(M, M < 0)
        with pytest.raises(TypeError, match="dsl.trap: bad must be an i1 flag"):
            trap(M)
