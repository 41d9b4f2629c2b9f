"""CPU value tests of kbuild.nn.RMSNorm and kbuild.nn.LayerNorm against torch.nn's modules and
fp64: forward, gradients of the input and the parameters, eps as torch reads it, checkpoints.

Every module pair shares random parameters (far from torch's 1 and 0 initialisation, so an
ignored weight or bias shows), and inputs have magnitude sqrt(eps), so the eps a module uses
changes the output by tens of percent (the witnesses assert that a wrong eps fails FWD_TOL).
kbuild is also held to fp64 tightly (tests/value_checks.py); torch, which rounds its own way,
within the GPU tests' FWD_TOL and twice GRAD_TOL.
"""

from __future__ import annotations

import pytest
import torch

import kbuild.nn

from .gpu_utils import FWD_TOL, GRAD_TOL
from .reference import assert_close_rel, layernorm_grads, rmsnorm_grads
from .value_checks import assert_forward, assert_grad, loosely_close, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
N = 64
SHAPE = (2, 3, N)
# torch.nn.RMSNorm(eps=None), torch 2.13: "the machine epsilon of the computation (opmath)
# type: fp16/bf16 and fp32 inputs use torch.finfo(torch.float32).eps".
TORCH_RMS_EPS = torch.finfo(torch.float32).eps


def _name(value) -> str:
    return str(value).replace("torch.", "")


def _pair(cls: str, dtype, seed=7, **kwargs):
    """(torch.nn.<cls>, kbuild.nn.<cls>) with the same random parameters, the kbuild one
    loaded from the torch one's state_dict (strictly: the keys must match)."""
    theirs = getattr(torch.nn, cls)(N, dtype=dtype, **kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.7 + 0.4)
    ours = getattr(kbuild.nn, cls)(N, dtype=dtype, **kwargs)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _run(module, x, dy):
    """(y, dx, {name: parameter gradient}) of module(x) with upstream gradient dy."""
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def _compare_with_torch(theirs, ours, x, dy):
    """Forward within FWD_TOL of torch's, every gradient within twice GRAD_TOL by norm: torch's
    16-bit backward rounds intermediates (its dx is not the fp64 one rounded once, kbuild's is),
    and a LayerNorm dx has elements that are small differences of large terms."""
    y_t, dx_t, grads_t = _run(theirs, x, dy)
    y, dx, grads = _run(ours, x, dy)
    assert y.dtype == y_t.dtype
    torch.testing.assert_close(y, y_t, **FWD_TOL[x.dtype])
    assert grads.keys() == grads_t.keys()
    for name, grad in [("dx", dx), *grads.items()]:
        theirs_grad = dx_t if name == "dx" else grads_t[name]
        assert grad.dtype == theirs_grad.dtype, name
        assert_close_rel(grad, theirs_grad, 2 * GRAD_TOL[x.dtype], name)
    return y, dx, grads


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no_affine"])
@pytest.mark.parametrize("eps", [None, 1e-4], ids=["eps_None", "eps_1e-4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_rmsnorm_module_matches_torch(dtype, eps, affine):
    """Catches kbuild.nn.RMSNorm reading eps=None otherwise than torch.nn.RMSNorm (the machine
    epsilon of the fp32 computation, also for 16-bit x: not finfo(bf16).eps = 7.8e-3), an
    explicit eps ignored or replaced, the weight ignored; forward and gradients."""
    effective = TORCH_RMS_EPS if eps is None else eps
    theirs, ours = _pair("RMSNorm", dtype, eps=eps, elementwise_affine=affine)
    x, dy = randn(SHAPE, dtype, 0, scale=effective**0.5), randn(SHAPE, dtype, 2)
    y, dx, grads = _compare_with_torch(theirs, ours, x, dy)
    y64, dx64, dw64, _ = rmsnorm_grads(x, ours.weight, dy, effective)
    assert_forward(y, y64, x)
    assert_grad(dx, dx64, x, "dx")
    if affine:
        assert_grad(grads["weight"], dw64, ours.weight, "dweight")
    # The other readings of eps (kbuild.rmsnorm's default, x's own machine epsilon, 10x off)
    # would fail: these inputs see eps.
    wrongs = {1e-6, torch.finfo(dtype).eps} if eps is None else {eps / 10, eps * 10}
    for wrong in wrongs - {effective}:
        assert not loosely_close(y, rmsnorm_grads(x, ours.weight, dy, wrong)[0]), wrong


@pytest.mark.parametrize(
    "affine, bias",
    [(True, True), (True, False), (False, True)],
    ids=["weight+bias", "weight_only", "no_affine"],
)
@pytest.mark.parametrize("eps", [None, 1e-3], ids=["eps_default", "eps_1e-3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_layernorm_module_matches_torch(dtype, eps, affine, bias):
    """Catches kbuild.nn.LayerNorm with a default eps other than torch's 1e-5, an explicit eps
    ignored, weight or bias ignored or swapped, bias=False mishandled; forward and the
    gradients of x, weight and bias."""
    kwargs = dict(elementwise_affine=affine, bias=bias) | ({} if eps is None else dict(eps=eps))
    theirs, ours = _pair("LayerNorm", dtype, **kwargs)
    assert ours.eps == theirs.eps
    effective = theirs.eps
    x = randn(SHAPE, dtype, 0, scale=effective**0.5, offset=3 * effective**0.5)
    dy = randn(SHAPE, dtype, 2, offset=0.5)
    y, dx, grads = _compare_with_torch(theirs, ours, x, dy)
    y64, dx64, dw64, db64 = layernorm_grads(x, ours.weight, ours.bias, dy, effective)
    assert_forward(y, y64, x)
    assert_grad(dx, dx64, x, "dx")
    assert grads.keys() == {n for n, p in (("weight", dw64), ("bias", db64)) if p is not None}
    for name, ref in (("weight", dw64), ("bias", db64)):
        if name in grads:
            assert_grad(grads[name], ref, getattr(ours, name), name)
    for wrong in (effective / 10, effective * 10):
        assert not loosely_close(y, layernorm_grads(x, ours.weight, ours.bias, dy, wrong)[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("cls", ["RMSNorm", "LayerNorm"])
def test_fp32_module_on_16bit_input(cls, dtype):
    """Catches fp32 parameters cast to x's dtype before use (a double rounding) or an output
    in the parameters' dtype: a float32 module on 16-bit x returns x's dtype, rounded once,
    and fp32 parameter gradients."""
    kwargs = dict(eps=1e-6) if cls == "RMSNorm" else {}
    _, ours = _pair(cls, torch.float32, **kwargs)
    x = randn((8, 32, N), dtype, 0, offset=0.5)
    dy = randn(x.shape, dtype, 2)
    y, dx, grads = _run(ours, x, dy)
    if cls == "RMSNorm":
        y64, dx64, dw64, _ = rmsnorm_grads(x, ours.weight, dy, ours.eps)
        refs = dict(weight=dw64)
    else:
        y64, dx64, dw64, db64 = layernorm_grads(x, ours.weight, ours.bias, dy, ours.eps)
        refs = dict(weight=dw64, bias=db64)
    assert_forward(y, y64, x)
    assert_grad(dx, dx64, x, "dx")
    for name, ref in refs.items():
        assert_grad(grads[name], ref, getattr(ours, name), name)


@pytest.mark.parametrize("cls", ["RMSNorm", "LayerNorm"])
def test_state_dict_is_interchangeable(cls):
    """Catches parameters named, shaped or initialised otherwise than torch's: a checkpoint of
    either class loads strictly into the other and computes the same norm."""
    kwargs = dict(eps=1e-6) if cls == "RMSNorm" else {}
    theirs, ours = _pair(cls, torch.float32, **kwargs)  # torch -> kbuild inside _pair
    back = getattr(torch.nn, cls)(N, **kwargs)
    back.load_state_dict(ours.state_dict())  # kbuild -> torch
    x = randn(SHAPE, torch.float32, 0, offset=0.5)
    with torch.no_grad():
        torch.testing.assert_close(back(x), theirs(x), rtol=0, atol=0)
        torch.testing.assert_close(ours(x), theirs(x), **FWD_TOL[torch.float32])
    fresh_theirs, fresh_ours = getattr(torch.nn, cls)(N), getattr(kbuild.nn, cls)(N)
    assert fresh_ours.eps == fresh_theirs.eps
    fresh_ours_state = fresh_ours.state_dict()
    assert list(fresh_ours_state) == list(fresh_theirs.state_dict())
    for name, value in fresh_theirs.state_dict().items():
        torch.testing.assert_close(fresh_ours_state[name], value, rtol=0, atol=0, msg=name)


def test_rmsnorm_offset_module():
    """Catches the offset dropped by the module, a Gemma-style module that does not start as
    the identity scale (its weight is stored as w with offset + w applied), or an offset
    accepted where there is no weight to offset."""
    m = kbuild.nn.RMSNorm(16, eps=1e-6, offset=1.0)
    assert torch.equal(m.weight, torch.zeros(16)) and "offset=1.0" in repr(m)
    meta = kbuild.nn.RMSNorm(16, offset=1.0, device="meta").to_empty(device="cpu")
    meta.reset_parameters()  # deferred initialisation keeps the identity scale too
    assert torch.equal(meta.weight, torch.zeros(16))
    x = torch.randn(3, 16)
    torch.testing.assert_close(m(x), kbuild.nn.RMSNorm(16, eps=1e-6)(x))
    with torch.no_grad():
        m.weight.copy_(torch.linspace(-0.5, 0.5, 16))
    want = kbuild.rmsnorm(x, m.weight + 1.0, 1e-6)
    torch.testing.assert_close(m(x), want)
    with pytest.raises(ValueError, match="needs elementwise_affine"):
        kbuild.nn.RMSNorm(16, offset=1.0, elementwise_affine=False)
    with pytest.raises(TypeError, match="offset must be a float"):
        kbuild.nn.RMSNorm(16, offset="1")
