"""Kernel parameters declare the values their kernels take (`Param(bounds=(low, high))`), and
`KernelDef.spec` refuses any other with a ValueError naming the kernel, the parameter, the
value and the range. Before, a row width of -8 reached the builder and ended in
`IndexError: list index out of range` naming nothing, eps=-1.0 compiled a kernel that
normalises by a negative eps, and a float that is not finite was refused by KernelSpec
without the kernel or parameter named."""

from __future__ import annotations

import math
import re

import pytest

from kbuild.cli.manifest import MANIFESTS, manifest
from kbuild.kernels.norms.kernels import RMSNORM_FWD
from kbuild.kernels.reduce import COLUMN_SUM
from kbuild.registry import BUILTIN, KERNELS, KernelDef, Param

WIDTHS = ("N", "C", "OC", "D")  # a row's, a column block's or a head's width: every kernel has one


def valid_values(definition: KernelDef) -> dict:
    """A value for each required parameter that the kernel takes."""
    sample = {"int": 64, "float": 1e-6, "bool": True, "dtype": "bf16", "dtype?": "bf16",
              "index": "i64"}  # fmt: skip
    return {p.name: sample[p.kind] for p in definition.params if p.required}


def refused(definition: KernelDef, name: str, value, expected: str) -> None:
    """spec() with `name` = `value` raises the one message, naming all four."""
    values = {**valid_values(definition), name: value}
    message = f"{definition.name}: {name} must be {expected}, got {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        definition.spec(**values)


def own_kernels() -> list[KernelDef]:
    return [KERNELS[name] for name in sorted(BUILTIN)]


@pytest.mark.parametrize("definition", own_kernels(), ids=lambda d: d.name)
def test_every_width_is_at_least_one(definition):
    """Catches a kernel whose width is declared without bounds (-8 once reached the plan
    chooser: IndexError), or one whose bound is off by one (0 or 1 let through wrongly)."""
    widths = [p for p in definition.params if p.name in WIDTHS]
    assert len(widths) == 1, widths
    width = widths[0]
    assert width.bounds is not None and width.bounds[0] >= 1, width  # declared, and >= 1
    low = width.bounds[0]  # 1: a row of one element; 2 where the math needs a pair (RoPE)
    for value in (low - 1, -8):
        refused(definition, width.name, value, f">= {low}")
    definition.spec(**{**valid_values(definition), width.name: low})


@pytest.mark.parametrize(
    "definition", [d for d in own_kernels() if "eps" in {p.name for p in d.params}],
    ids=lambda d: d.name,
)  # fmt: skip
def test_every_eps_is_finite_and_not_negative(definition):
    """Catches an eps without bounds (-1.0 compiled and ran), and one bounded to > 0, which
    would refuse at launch the eps=0 that kbuild.rmsnorm accepts (op/tensors.py check_eps,
    tests/test_api_cpu.py)."""
    refused(definition, "eps", -1.0, ">= 0.0")
    refused(definition, "eps", -1e-30, ">= 0.0")
    for value in (math.nan, math.inf, -math.inf):
        refused(definition, "eps", value, "finite and >= 0.0")
    assert definition.spec(**{**valid_values(definition), "eps": 0})["eps"] == 0.0


def test_floats_are_finite_bounded_or_not():
    """Catches a non-finite offset let through to KernelSpec (which named neither kernel nor
    parameter) or to the builder; an int too large for a float is not finite either."""
    values = valid_values(RMSNORM_FWD)
    for value in (math.nan, math.inf):
        refused(RMSNORM_FWD, "offset", value, "finite")
    refused(RMSNORM_FWD, "eps", 10**400, "finite and >= 0.0")
    assert RMSNORM_FWD.spec(**values, offset=-1.5)["offset"] == -1.5


def test_ints_are_64_bit():
    """Catches a width past int64 compiled into a kernel no launch can key (the C++ key and
    torch's sizes are 64-bit)."""
    refused(RMSNORM_FWD, "N", 1 << 63, "a 64-bit int and >= 1")
    assert RMSNORM_FWD.spec(**{**valid_values(RMSNORM_FWD), "N": (1 << 63) - 1})["N"] > 0


def test_column_sum_takes_one_or_two_planes():
    """Catches planes unbounded in the table (the builder's own check said it without the
    kernel's name, and only on compile)."""
    for planes in (0, 3):
        refused(COLUMN_SUM, "planes", planes, "in [1, 2]")
    assert COLUMN_SUM.spec(64, "f32", planes=2)["planes"] == 2


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_no_manifest_lists_a_spec_the_table_refuses(name):
    """Catches bounds tighter than what the tests, benchmarks and sweeps launch (the tune and
    trace manifests make specs with KernelSpec.make, past the table's check)."""
    for spec in manifest(name):
        KERNELS[spec.kernel].spec(**spec.kwargs)


@pytest.mark.parametrize(
    "declare, error, message",
    [
        (lambda: Param("f", "bool", bounds=(0, 1)), ValueError,
         "parameter 'f': bounds are for int and float parameters, not bool"),
        (lambda: Param("N", "int", bounds=(4, 2)), ValueError,
         "parameter 'N': bounds (4, 2) hold no value (low > high)"),
        (lambda: Param("N", "int", 0, bounds=(1, None)), ValueError,
         "parameter 'N': its default 0 is not >= 1"),
        (lambda: Param("N", "int", bounds=[1, None]), TypeError,
         "parameter 'N': bounds must be (low, high), numbers or None, not [1, None]"),
        (lambda: Param("N", "int", bounds=(1, "8")), TypeError,
         "parameter 'N': bounds must be (low, high), numbers or None, not (1, '8')"),
    ],
    ids=["bool", "empty", "default-outside", "list", "text"],
)  # fmt: skip
def test_bounds_are_checked_when_declared(declare, error, message):
    """Catches a declaration whose bounds refuse every value or its own default (its first
    spec would fail far from the mistake), or bounds that cannot be compared."""
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        declare()


def test_a_users_kernel_declares_bounds_too():
    """A kernel declared outside the table takes the same bounds (kbuild.kernel's Param)."""
    mine = KernelDef("ranges_test_k", "tests.nowhere:build",
                     (Param("D", "int", bounds=(1, 256)), Param("dtype", "dtype")), ())  # fmt: skip
    refused(mine, "D", 512, "in [1, 256]")
    assert mine.spec(256, "f32")["D"] == 256
