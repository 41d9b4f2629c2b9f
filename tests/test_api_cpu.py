"""CPU tests of the public API: kbuild.rmsnorm's math on CPU tensors and every argument check."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import kbuild

from .gpu_utils import FWD_TOL, GRAD_TOL
from .reference import assert_close_rel, rmsnorm_grads, rmsnorm_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _weight(kind: str | None, n: int, dtype: torch.dtype) -> torch.Tensor | None:
    if kind is None:
        return None
    return torch.randn(n, generator=torch.Generator().manual_seed(1)).to(
        dtype if kind == "same" else torch.float32
    )


def _input(shape: tuple[int, ...], dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if transposed:  # a (rows, N) view of an (N, rows) tensor: last dim not contiguous
        return torch.randn(shape[::-1], generator=g).to(dtype).t()
    return torch.randn(shape, generator=g).to(dtype)


# --- math ---------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_kind", ["same", "f32", None], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape, transposed",
    [((3, 5, 16), False), ((1, 7), False), ((0, 8), False), ((6, 16), True), ((2, 4096), False)],
    ids=["3x5x16", "1x7", "0x8", "transposed-6x16", "2x4096"],
)
def test_matches_fp64_reference(shape, transposed, dtype, weight_kind):
    x = _input(shape, dtype, transposed)
    assert x.is_contiguous() != transposed
    weight = _weight(weight_kind, shape[-1], dtype)
    y = kbuild.rmsnorm(x, weight, eps=1e-6)
    assert y.shape == x.shape
    assert y.dtype == x.dtype
    assert y.device == x.device
    torch.testing.assert_close(y, rmsnorm_ref(x, weight, 1e-6), **FWD_TOL[dtype])


def test_default_eps_is_1e_6():
    # Rows of magnitude 1e-3: mean(x^2) ~ 1e-6, so 1e-5 (or no eps) moves y by far more than
    # FWD_TOL; comparing with the fp64 reference, not with kbuild itself, also catches an eps
    # the reference drops or misplaces.
    x = _input((4, 32), torch.float32, False) * 1e-3
    y = kbuild.rmsnorm(x)
    torch.testing.assert_close(y, rmsnorm_ref(x, None, 1e-6), **FWD_TOL[torch.float32])
    assert not torch.allclose(y, rmsnorm_ref(x, None, 1e-5), **FWD_TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eps_is_honoured(dtype):
    # 1e-6 and 1e-5 are within fp32 tolerance of each other on randn rows; on rows with
    # mean(x^2) ~ 3e-6 they are not. Each result matches its own eps's reference and not the
    # other's (checked against the references, so the test is known to see the difference).
    x = _input((4, 64), dtype, False) * 1.7e-3
    weight = _weight("same", 64, dtype)
    for eps, other in ((1e-6, 1e-5), (1e-5, 1e-6)):
        y = kbuild.rmsnorm(x, weight, eps=eps)
        torch.testing.assert_close(y, rmsnorm_ref(x, weight, eps), **FWD_TOL[dtype])
        assert not torch.allclose(
            y.double(), rmsnorm_ref(x, weight, other).double(), **FWD_TOL[dtype]
        )


def test_eps_zero_and_int_are_accepted():
    x = _input((2, 8), torch.float32, False)
    torch.testing.assert_close(kbuild.rmsnorm(x, eps=0), rmsnorm_ref(x, None, 0.0))


# --- argument checks ----------------------------------------------------------------------

X = torch.randn(3, 16)


@pytest.mark.parametrize(
    "x, error, name",
    [
        ([[1.0, 2.0]], TypeError, "x"),
        (torch.ones(3, 16, dtype=torch.int32), TypeError, "x"),
        (torch.ones(3, 16, dtype=torch.float64), TypeError, "x"),
        (torch.tensor(1.0), ValueError, "x"),
    ],
    ids=["not-a-tensor", "int32", "float64", "0-dim"],
)
def test_bad_x(x, error, name):
    with pytest.raises(error, match=rf"\b{name}\b"):
        kbuild.rmsnorm(x)


@pytest.mark.parametrize(
    "weight, error",
    [
        (torch.ones(15), ValueError),
        (torch.ones(1, 16), ValueError),
        (torch.ones(16, dtype=torch.float16), TypeError),
        (torch.ones(16, dtype=torch.int64), TypeError),
        (torch.empty(16, device="meta"), ValueError),
        ([1.0] * 16, TypeError),
    ],
    ids=["wrong-length", "2-d", "f16-with-f32-x", "int64", "other-device", "list"],
)
def test_bad_weight(weight, error):
    with pytest.raises(error, match=r"\bweight\b"):
        kbuild.rmsnorm(X, weight)


def test_weight_device_message_names_both_devices():
    with pytest.raises(ValueError, match=r"weight.*cpu.*meta"):
        kbuild.rmsnorm(X, torch.empty(16, device="meta"))


@pytest.mark.parametrize(
    "eps, error",
    [
        (-1e-6, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (-math.inf, ValueError),
        ("1e-6", TypeError),
        (True, TypeError),
        (None, TypeError),
        (torch.tensor(1e-6), TypeError),
    ],
    ids=["negative", "nan", "inf", "-inf", "str", "bool", "None", "tensor"],
)
def test_bad_eps(eps, error):
    with pytest.raises(error, match=r"\beps\b"):
        kbuild.rmsnorm(X, eps=eps)


# Backward landed (commit 1bffe63): on CPU the torch reference is differentiated by autograd.
@pytest.mark.parametrize("weight_kind", ["same", "f32", None], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_gradients_match_fp64_reference(dtype, weight_kind):
    x = _input((3, 5, 16), dtype, False).requires_grad_()
    weight = _weight(weight_kind, 16, dtype)
    if weight is not None:
        weight.requires_grad_()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    kbuild.rmsnorm(x, weight, eps=1e-6).backward(dy)
    _, dx, dw, _ = rmsnorm_grads(x, weight, dy, 1e-6)
    assert x.grad.dtype == dtype
    assert_close_rel(x.grad, dx, GRAD_TOL[dtype], "dx")
    if weight is not None:
        assert weight.grad.dtype == weight.dtype
        assert_close_rel(weight.grad, dw, GRAD_TOL[weight.dtype], "dweight")


def test_cpu_gradient_of_weight_alone():
    x, weight = _input((4, 16), torch.float32, False), _weight("f32", 16, torch.float32)
    weight.requires_grad_()
    dy = torch.ones(4, 16)
    kbuild.rmsnorm(x, weight).backward(dy)
    assert x.grad is None
    assert_close_rel(weight.grad, rmsnorm_grads(x, weight, dy, 1e-6)[2], 1e-5, "dweight")


def test_requires_grad_is_fine_under_no_grad():
    x, weight = torch.randn(3, 16).requires_grad_(), torch.randn(16).requires_grad_()
    with torch.no_grad():
        y = kbuild.rmsnorm(x, weight)
    torch.testing.assert_close(y, rmsnorm_ref(x.detach(), weight.detach(), 1e-6))


# --- imports ------------------------------------------------------------------------------


@pytest.mark.not_interpreted
def test_cpu_rmsnorm_does_not_import_mlir(subprocess_env):
    code = (
        "import kbuild, torch, sys; y = kbuild.rmsnorm(torch.randn(2, 8)); "
        "assert y.shape == (2, 8); assert 'mlir' not in sys.modules, 'mlir was imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env
    )
    assert result.returncode == 0, result.stderr
