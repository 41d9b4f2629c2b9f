"""CPU value tests of kbuild.layernorm: forward and gradients against fp64
(tests/reference.py layernorm_grads), held tightly enough to see the bug each test names.

Two routes run on CPU: kbuild.layernorm is layernorm_reference differentiated by autograd,
while the kbuild::layernorm_fwd op differentiates through layernorm_bwd_reference (the formulas
of the GPU backward kernel, which eager CUDA training and torch.compile share); both are
checked. Inputs have a mean of their own (an uncentred variance shows) and parameters far from
1 and 0; 16-bit results are held to the fp64 value rounded once (tests/value_checks.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kbuild
import kbuild.kernels.llmc.op  # registers the kbuild::* custom ops (llm.c's)
import kbuild.kernels.norms.api  # registers the kbuild::* custom ops (the norms')
from kbuild.kernels.norms.autograd import LayerNormFunction

from .reference import layernorm_grads
from .value_checks import (
    MAX_FLIPS,
    assert_forward,
    assert_grad,
    loosely_close,
    param,
    randn,
    rounding_flips,
)

OPS = torch.ops.kbuild
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
N = 32  # short rows: a variance over N - 1 is 1.6% off
SHAPE = (2, 3, N)
EPS = 1e-5  # layernorm's default
LAYOUTS = ["contiguous", "strided"]  # "strided": the last dimension is not contiguous
AFFINE = ["weight+bias", "weight", "bias", "none"]
# (x dtype, which parameters, their dtype kind); fp32 x has no separate "f32" case.
CASES = [
    (d, a, k)
    for d in DTYPES
    for a in AFFINE
    for k in ("same", "f32")
    if not (k == "f32" and (d == torch.float32 or a == "none"))
]


def _name(value) -> str:
    return str(value).replace("torch.", "")


def _params(affine, kind, dtype, n=N):
    weight = param(kind, n, dtype, 1) if "weight" in affine else None
    bias = param(kind, n, dtype, 5) if "bias" in affine else None
    return weight, bias


def _ref(x, weight, bias, eps):
    """fp64 LayerNorm of x (unrounded)."""
    return layernorm_grads(x, weight, bias, torch.zeros(x.shape), eps)[0]


def _via_op(x, weight, bias, eps):
    return OPS.layernorm_fwd(x, weight, bias, eps, True)[0]


ROUTES = {"autograd": kbuild.layernorm, "op": _via_op}


# --- forward --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype, affine, kind", CASES, ids=_name)
def test_layernorm_forward(dtype, affine, kind, layout):
    """Catches a variance over N - 1 or of the uncentred row, the mean not subtracted, weight
    or bias ignored, swapped or applied in the wrong order, the bias dropped when there is no
    weight, a double rounding (x_hat or x_hat * w rounded before the bias, fp32 parameters
    cast to x's dtype), a wrong output dtype, and a rank-3 or strided x read wrongly."""
    x = randn(SHAPE, dtype, 0, offset=0.5, strided=layout == "strided")
    weight, bias = _params(affine, kind, dtype)
    ref = _ref(x, weight, bias, EPS)
    assert_forward(kbuild.layernorm(x, weight, bias, EPS), ref, x)
    assert_forward(_via_op(x, weight, bias, EPS), ref, x, "kbuild::layernorm_fwd")


@pytest.mark.parametrize("kind", ["same", "f32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
def test_layernorm_rounds_once(dtype, kind):
    """Catches a double rounding in y = x_hat * w + b; the witnesses (x_hat rounded, x_hat * w
    rounded, fp32 parameters cast to x's dtype) pass FWD_TOL, and this check sees them."""
    x = randn((8, 512), dtype, 0, offset=0.5)
    weight, bias = _params("weight+bias", kind, dtype, n=512)
    ref = _ref(x, weight, bias, EPS)
    assert_forward(kbuild.layernorm(x, weight, bias, EPS), ref, x)
    x_hat, w, b = _ref(x, None, None, EPS), weight.double(), bias.double()
    witnesses = [
        x_hat.to(dtype).double() * w + b,
        (x_hat * w).to(dtype).double() + b,
    ]
    if kind == "f32":
        witnesses.append(x_hat * weight.to(dtype).double() + bias.to(dtype).double())
    for wrong in witnesses:
        assert loosely_close(wrong.to(dtype), ref)  # what FWD_TOL alone would let through
        assert rounding_flips(wrong.to(dtype), ref) > MAX_FLIPS


@pytest.mark.parametrize("eps", [None, 1e-3], ids=["default", "1e-3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_layernorm_eps(dtype, eps):
    """Catches eps ignored, added outside the sqrt, scaled, or a default other than 1e-5:
    rows of standard deviation sqrt(eps) make the variance ~ eps, so even eps / 10 or
    10 * eps fails FWD_TOL."""
    value = EPS if eps is None else eps
    x = randn((4, N), dtype, 0, scale=value**0.5, offset=3 * value**0.5)
    weight, bias = _params("weight+bias", "same", dtype)
    args = (x, weight, bias) if eps is None else (x, weight, bias, eps)
    out = kbuild.layernorm(*args)
    assert_forward(out, _ref(x, weight, bias, value), x)
    for wrong in (value / 10, value * 10):
        assert not loosely_close(out, _ref(x, weight, bias, wrong)), wrong


def test_layernorm_variance_of_the_centred_row():
    """Catches var = mean(x^2) - mean^2 (the docstring promises the centred form): rows of
    mean 32 and deviation 1 lose ~3e-4 of y to cancellation in fp32, the centred form ~3e-6."""
    x = randn((8, 512), torch.float32, 0, offset=32.0)
    weight, bias = _params("weight+bias", "same", torch.float32, n=512)
    assert_forward(kbuild.layernorm(x, weight, bias), _ref(x, weight, bias, EPS), x)


# --- gradients ------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype, affine, kind", CASES, ids=_name)
def test_layernorm_gradients(dtype, affine, kind, route):
    """Catches, in layernorm_bwd_reference ("op"): the c1 = mean(w * dy) or c2 =
    mean(w * dy * x_hat) term dropped or taken without the weight, x_hat not centred, dx not
    scaled by rstd, dw with the weight in it, db missing or with the weight in it, dw or db not
    summed over every row of a rank-3 input, dw and db swapped, a gradient in the wrong dtype
    or rounded twice; through autograd ("autograd"), the same in the forward's math. dy has
    a mean of its own so that c1 is large. Rank-3 strided inputs."""
    x = randn(SHAPE, dtype, 0, offset=0.5, strided=True).requires_grad_()
    weight, bias = _params(affine, kind, dtype)
    for p in (weight, bias):
        if p is not None:
            p.requires_grad_()
    dy = randn(SHAPE, dtype, 2, offset=0.5)
    ROUTES[route](x, weight, bias, EPS).backward(dy)
    _, dx, dw, db = layernorm_grads(x, weight, bias, dy, EPS)
    assert_grad(x.grad, dx, x, "dx")
    if weight is not None:
        assert_grad(weight.grad, dw, weight, "dw")
    if bias is not None:
        assert_grad(bias.grad, db, bias, "db")


@pytest.mark.parametrize("wants", ["x", "weight", "bias"])
def test_layernorm_op_gradient_of_one_input(wants):
    """Catches the backward's need flags read from the wrong slot (_layernorm_backward,
    _layernorm_op_backward): only the input that requires a gradient gets one, in full."""
    x = randn((6, N), torch.float32, 0, offset=0.5)
    weight, bias = _params("weight+bias", "same", torch.float32)
    inputs = dict(x=x, weight=weight, bias=bias)
    inputs[wants].requires_grad_()
    dy = randn((6, N), torch.float32, 2, offset=0.5)
    _via_op(x, weight, bias, EPS).backward(dy)
    refs = dict(zip(inputs, layernorm_grads(x, weight, bias, dy, EPS)[1:], strict=True))
    for name, t in inputs.items():
        if name == wants:
            assert_grad(t.grad, refs[name], t, name)
        else:
            assert t.grad is None, name


@pytest.mark.parametrize("route", ROUTES)
def test_layernorm_gradients_with_eps_that_matters(route):
    """Catches a backward that recomputes rstd without eps, or with another eps, instead of
    using the forward's: rows of deviation sqrt(eps) make rstd depend on eps by ~40%."""
    x = randn((6, N), torch.float32, 0, scale=EPS**0.5, offset=0.1).requires_grad_()
    weight, bias = _params("weight+bias", "same", torch.float32)
    weight.requires_grad_()
    dy = randn((6, N), torch.float32, 2, offset=0.5)
    ROUTES[route](x, weight, None, EPS).backward(dy)
    _, dx, dw, _ = layernorm_grads(x, weight, None, dy, EPS)
    assert_grad(x.grad, dx, x, "dx")
    assert_grad(weight.grad, dw, weight, "dw")


# --- the backward op called directly, and the eager Function's backward --------------------


def _stats(x):
    """(mean, rstd), (M,) fp32 each, as the forward ops store them."""
    xf = x.float()
    mean = xf.mean(-1)
    rstd = torch.rsqrt((xf - mean.unsqueeze(-1)).square().mean(-1) + EPS)
    return mean.reshape(-1), rstd.reshape(-1)


@pytest.mark.parametrize("kind", ["same", "f32"])
def test_backward_op_returns_the_inputs_dtypes(kind):
    """Catches a CPU backward returning fp32 dx, dw or db for bf16 inputs (a cast dropped in
    layernorm_bwd_reference or _layernorm_backward). Autograd casts a gradient to its input's
    dtype and hides that, but torch.compile calls kbuild::layernorm_bwd directly, and its fake
    kernel promises the inputs' dtypes."""
    dtype = torch.bfloat16
    x, dy = randn(SHAPE, dtype, 0, offset=0.5), randn(SHAPE, dtype, 2, offset=0.5)
    weight, bias = _params("weight+bias", kind, dtype)
    grads = OPS.layernorm_bwd(dy, x, weight, bias, *_stats(x), True, True, True)
    refs = layernorm_grads(x, weight, bias, dy, EPS)[1:]
    for name, grad, ref, like in zip(
        "dx dw db".split(), grads, refs, (x, weight, bias), strict=True
    ):
        assert_grad(grad, ref, like, name)


@pytest.mark.parametrize(
    "needs", [(True, True, True), (True, False, False), (False, True, False), (False, False, True)]
)
def test_eager_layernorm_function_backward(needs):
    """Catches LayerNormFunction.backward (eager CUDA training) putting dx, dw or db in the
    wrong slot, ignoring a need flag, or returning fp32 gradients for bf16 inputs; its wiring
    is plain Python over _layernorm_backward, whose CPU branch runs here."""
    dtype = torch.bfloat16
    x, dy = randn(SHAPE, dtype, 0, offset=0.5), randn(SHAPE, dtype, 2, offset=0.5)
    weight, bias = _params("weight+bias", "same", dtype)
    ctx = SimpleNamespace(saved_tensors=(x, weight, bias, *_stats(x)), needs_input_grad=needs)
    *grads, deps = LayerNormFunction.backward(ctx, dy)
    assert deps is None
    refs = layernorm_grads(x, weight, bias, dy, EPS)[1:]
    for grad, ref, like, need in zip(grads, refs, (x, weight, bias), needs, strict=True):
        if need:
            assert_grad(grad, ref, like)
        else:
            assert grad is None
