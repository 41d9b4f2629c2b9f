"""The kernel table (kbuild/registry.py) is the one description of each kernel: specs,
registry, launch keys and argument order all come from it. These tests pin what each rule
means, so a table edit that silently changes a cached kernel's identity fails here."""

from __future__ import annotations

import itertools

import pytest

from kbuild import compiler
from kbuild.kernels.norms.kernels import (
    FUSED_ADD_RMSNORM_BWD,
    LAYERNORM_FWD,
    RMSNORM_BWD,
    RMSNORM_FWD,
)
from kbuild.kernels.reduce import COLUMN_SUM
from kbuild.registry import KERNELS, Arg, KernelDef, Param, get_builder, kernel_def
from kbuild.spec import KernelSpec
from kbuild.targets import target_for_arch

SM90 = target_for_arch("sm_90")


def test_registry_is_the_table():
    for name in KERNELS:
        assert callable(get_builder(name))  # the builder path resolves
    with pytest.raises(ValueError, match="unknown kernel 'nope'; known: bias_grad, column_sum"):
        kernel_def("nope")


def test_positional_and_named_specs_agree_with_the_hand_written_form():
    """A spec built from the table is byte for byte the spec warmed caches were keyed on."""
    by_position = RMSNORM_FWD.spec(4096, "bf16", "f32", True, 1e-6)
    by_name = RMSNORM_FWD.spec(N=4096, dtype="bf16", weight_dtype="f32", store_rstd=True, eps=1e-6)
    by_hand = KernelSpec.make(
        "rmsnorm_fwd",
        N=4096,
        dtype="bf16",
        weight_dtype="f32",
        store_rstd=True,
        eps=1e-6,
        vectorize=True,
    )
    assert by_position == by_name == by_hand


def test_vectorize_is_alignment_for_rows_and_whole_vectors_for_columns():
    """A row kernel's vectorize says its arrays start 16-byte aligned: rows of any width take
    16-byte vectors (an odd row is peeled, dsl.rows), so it stays on at N = 4100. The column
    kernels (bias gradient, encoder) read whole vectors of C columns: odd C is their scalar
    kernel, and its two spellings are one spec (a lost rule compiles a kernel that misreads)."""
    assert RMSNORM_FWD.spec(4096, "bf16", None, False, 1e-6)["vectorize"] is True
    assert RMSNORM_FWD.spec(4100, "bf16", None, False, 1e-6)["vectorize"] is True
    assert RMSNORM_FWD.spec(4096, "bf16", None, False, 1e-6, False)["vectorize"] is False
    assert FUSED_ADD_RMSNORM_BWD.spec(4100, "bf16", "bf16", "bf16", False, True)["vectorize"]
    bias = KERNELS["bias_grad"]
    assert bias.spec(OC=1001, dtype="bf16")["vectorize"] is False
    assert bias.spec(OC=1001, dtype="bf16") == bias.spec(OC=1001, dtype="bf16", vectorize=False)
    assert bias.spec(OC=1024, dtype="bf16")["vectorize"] is True


def test_weight_gradient_needs_a_weight():
    """compute_dw of a kernel without a weight is the kernel without dw (no partial argument)."""
    spec = RMSNORM_BWD.spec(4096, "bf16", None, True)
    assert spec == RMSNORM_BWD.spec(4096, "bf16", None, False)
    assert spec["compute_dw"] is False
    assert "dw_partial" not in RMSNORM_BWD.arg_names(spec)
    assert "dw_partial" in RMSNORM_BWD.arg_names(RMSNORM_BWD.spec(4096, "bf16", "bf16", True))


def test_unkeyed_default_is_left_out():
    """Column sums of one plane were keyed before `planes` existed: still keyed without it."""
    assert COLUMN_SUM.spec(4096, "f32").params == (("N", 4096), ("out_dtype", "f32"))
    assert COLUMN_SUM.spec(4096, "f32", 2)["planes"] == 2
    assert COLUMN_SUM.arg_names(COLUMN_SUM.spec(4096, "f32", 2)) == ["partial", "out", "out1", "R"]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: RMSNORM_FWD.spec(4096, "bf17", None, False, 1e-6), "dtype must be one of"),
        (lambda: RMSNORM_FWD.spec(4096, "bf16", "i8", False, 1e-6), "weight_dtype must be None"),
        (lambda: RMSNORM_FWD.spec(4096.0, "bf16", None, False, 1e-6), "N must be int"),
        (lambda: RMSNORM_FWD.spec(True, "bf16", None, False, 1e-6), "N must be int"),
        (lambda: RMSNORM_FWD.spec(4096, "bf16", None, 1, 1e-6), "store_rstd must be bool"),
        (lambda: RMSNORM_FWD.spec(4096, "bf16", None, False), "missing parameter 'eps'"),
        (lambda: RMSNORM_FWD.spec(4096, "bf16", None, False, 1e-6, N=8), "N given twice"),
        (lambda: COLUMN_SUM.spec(4096, "f32", threads=4), "column_sum has no parameter"),
        (lambda: RMSNORM_FWD.spec(*range(9)), "at most 8 parameters"),
    ],
)
def test_bad_parameters_are_named(call, message):
    with pytest.raises(TypeError, match=message):
        call()


def test_tunable_kernels_take_plan_overrides_by_name():
    spec = RMSNORM_FWD.spec(65536, "bf16", "bf16", True, 1e-6, cluster=4)
    assert spec["cluster"] == 4


def test_eps_is_a_float_by_its_bits():
    assert RMSNORM_FWD.spec(8, "f32", None, False, 0)["eps"] == 0.0
    assert RMSNORM_FWD.spec(8, "f32", None, False, 1e-5) != RMSNORM_FWD.spec(
        8, "f32", None, False, 1.0000001e-5
    )


def test_layernorm_arguments_follow_the_flags():
    spec = LAYERNORM_FWD.spec(1024, "bf16", "bf16", None, True, 1e-5)
    assert LAYERNORM_FWD.arg_names(spec) == ["x", "weight", "y", "mean", "rstd", "M"]
    traced = LAYERNORM_FWD.spec(1024, "bf16", None, None, False, 1e-5, trace=True)
    assert LAYERNORM_FWD.arg_names(traced) == ["trace", "x", "y", "M"]


def _values_of_kind(p) -> list:
    """A parameter no table kernel shares (a user kernel's, registered by another test module):
    both values of a bool, one of anything else (its default, or a width of 128)."""
    from kbuild.registry import _REQUIRED

    if p.kind == "bool":
        return [False, True]
    if p.default is not _REQUIRED:
        return [p.default]
    return {"int": [128], "float": [1e-6], "dtype": ["bf16"], "dtype?": ["bf16", None],
            "index": ["i32", "i64"]}[p.kind]  # fmt: skip


def _flag_combinations(kdef: KernelDef):
    """Every on/off choice of the kernel's optional arguments at N = 4096 bf16."""
    choices = {
        "N": [4096],
        "C": [4096],
        "OC": [4096],
        "index_dtype": ["i32", "i64"],
        "dtype": ["bf16"],
        "weight_dtype": ["bf16", None],
        "bias_dtype": ["f32", None],
        "residual_dtype": ["f32"],
        "out_dtype": ["bf16"],
        "planes": [1, 2],
        "eps": [1e-6],
        "offset": [0.0, 1.0],
        "residual_in_dtype": ["f32", None],
        "dresidual_dtype": ["f32", None],
        "vectorize": [True],
    }
    names = [p.name for p in kdef.params]
    values = [choices.get(p.name) or _values_of_kind(p) for p in kdef.params]
    for combo in itertools.product(*values):
        yield kdef.spec(**dict(zip(names, combo, strict=True)))


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_builder_matches_its_table_entry(name):
    """compiler.build checks a built kernel's signature against the table: a builder that
    adds, drops or reorders an argument fails here, not as a GPU fault."""
    kdef = KERNELS[name]
    for spec in dict.fromkeys(_flag_combinations(kdef)):
        kernel = compiler.build(spec, SM90)
        assert [n for n, _ in kernel.signature()] == kdef.arg_names(spec)


def test_a_signature_that_disagrees_is_refused():
    toy = KernelDef(
        "toy",
        "kbuild.kernels.norms.kernels:build_rmsnorm_module",
        (Param("N", "int"),),
        (
            Arg("x"),
            Arg("y", when="N"),
            Arg("M", "i64"),
        ),
    )
    spec = toy.spec(4)
    toy.check_signature(spec, [("x", "ptr"), ("y", "ptr"), ("M", "i64")])
    with pytest.raises(ValueError, match="are not the kernel table's"):
        toy.check_signature(spec, [("y", "ptr"), ("x", "ptr"), ("M", "i64")])
