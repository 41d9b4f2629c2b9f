"""CPU value tests of kbuild.rmsnorm and kbuild.fused_add_rmsnorm: forward and gradients against
fp64 (tests/reference.py), held tightly enough to see the bug each test names.

Two routes run on CPU: kbuild.rmsnorm is rmsnorm_reference differentiated by autograd, while
the kbuild::rmsnorm_fwd op and the fused form differentiate through rmsnorm_bwd_reference (the
formulas of the GPU backward kernel); both are checked. 16-bit results are held to the fp64
value rounded once and rows of magnitude sqrt(eps) make eps visible (tests/value_checks.py).
LayerNorm: tests/test_layernorm_cpu.py; the nn modules: tests/test_nn_cpu.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kbuild
import kbuild.kernels.llmc.op  # registers the kbuild::* custom ops (llm.c's)
import kbuild.kernels.norms.api  # registers the kbuild::* custom ops (the norms')
from kbuild.kernels.norms.autograd import FusedAddRMSNormFunction, RMSNormFunction

from .gpu_utils import GRAD_TOL
from .reference import assert_close_rel, rmsnorm_grads
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
N = 64
SHAPE = (2, 3, N)  # rank 3: the functions see (6, N) rows
EPS = 1e-6  # rmsnorm's and fused_add_rmsnorm's default
LAYOUTS = ["contiguous", "strided"]  # "strided": the last dimension is not contiguous
# (x dtype, weight kind); an fp32 weight on fp32 x is the "same" case.
CASES = [(d, w) for d in DTYPES for w in ("same", "f32", None) if (d, w) != (torch.float32, "f32")]
FUSED_CASES = [(d, w, f) for d, w in CASES for f in (False, True) if not (f and d == torch.float32)]


def _name(value) -> str:
    return str(value).replace("torch.", "")


def _ref(x, weight, eps):
    """fp64 RMSNorm of x (unrounded)."""
    return rmsnorm_grads(x, weight, torch.zeros(x.shape), eps)[0]


def _via_op(x, weight, eps):
    return OPS.rmsnorm_fwd(x, weight, eps, True)[0]


ROUTES = {"autograd": kbuild.rmsnorm, "op": _via_op}


# --- rmsnorm forward ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype, wkind", CASES, ids=_name)
def test_rmsnorm_forward(dtype, wkind, layout):
    """Catches mean(x^2) taken as a sum or over N - 1, rstd from 16-bit squares, the weight
    ignored or cast to x's dtype, y rounded before the weight multiply, a wrong output dtype,
    and a rank-3 or strided x read wrongly."""
    x = randn(SHAPE, dtype, 0, strided=layout == "strided")
    weight = param(wkind, N, dtype, 1)
    assert_forward(kbuild.rmsnorm(x, weight, EPS), _ref(x, weight, EPS), x)
    assert_forward(_via_op(x, weight, EPS), _ref(x, weight, EPS), x, "kbuild::rmsnorm_fwd")


@pytest.mark.parametrize("wkind", ["same", "f32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
def test_rmsnorm_rounds_once(dtype, wkind):
    """Catches a double rounding: x_hat rounded to x's dtype before the weight multiply, or an
    fp32 weight cast to x's dtype first. Both stay inside FWD_TOL; the witnesses show that the
    once-rounded check sees them on these inputs."""
    x, weight = randn((8, 512), dtype, 0), param(wkind, 512, dtype, 1)
    ref = _ref(x, weight, EPS)
    assert_forward(kbuild.rmsnorm(x, weight, EPS), ref, x)
    x_hat = _ref(x, None, EPS)
    witnesses = [x_hat.to(dtype).double() * weight.double()]
    if wkind == "f32":
        witnesses.append(x_hat * weight.to(dtype).double())
    for wrong in witnesses:
        assert loosely_close(wrong.to(dtype), ref)  # what FWD_TOL alone would let through
        assert rounding_flips(wrong.to(dtype), ref) > MAX_FLIPS


@pytest.mark.parametrize("eps", [None, 1e-5], ids=["default", "1e-5"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_rmsnorm_eps(dtype, eps):
    """Catches eps ignored, added outside the sqrt, scaled, or a wrong default: rows of
    magnitude sqrt(eps) make mean(x^2) ~ eps, so even eps / 10 or 10 * eps fails FWD_TOL."""
    value = EPS if eps is None else eps
    x, weight = randn((4, N), dtype, 0, scale=value**0.5), param("same", N, dtype, 1)
    out = kbuild.rmsnorm(x, weight) if eps is None else kbuild.rmsnorm(x, weight, eps)
    assert_forward(out, _ref(x, weight, value), x)
    for wrong in (value / 10, value * 10):
        assert not loosely_close(out, _ref(x, weight, wrong)), wrong


# --- rmsnorm gradients ----------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype, wkind", CASES, ids=_name)
def test_rmsnorm_gradients(dtype, wkind, layout, route):
    """Catches, in rmsnorm_bwd_reference ("op"): the c1 = mean(x_hat * w * dy) term dropped or
    taken without the weight, dx not scaled by rstd, dw with the weight in it or not summed
    over every row of a rank-3 input, a gradient in the wrong dtype or rounded twice; through
    autograd ("autograd"), the same mistakes in the forward's differentiable math."""
    x = randn(SHAPE, dtype, 0, strided=layout == "strided").requires_grad_()
    weight = param(wkind, N, dtype, 1)
    if weight is not None:
        weight.requires_grad_()
    dy = randn(SHAPE, dtype, 2)
    ROUTES[route](x, weight, EPS).backward(dy)
    _, dx, dw, _ = rmsnorm_grads(x, weight, dy, EPS)
    assert_grad(x.grad, dx, x, "dx")
    if weight is not None:
        assert_grad(weight.grad, dw, weight, "dw")


@pytest.mark.parametrize("wants", ["x", "weight"])
def test_rmsnorm_op_gradient_of_one_input(wants):
    """Catches the backward's need flags read from the wrong slot: the input that does not
    require a gradient gets none, the other its full value."""
    x, weight = randn((6, N), torch.float32, 0), param("same", N, torch.float32, 1)
    (x if wants == "x" else weight).requires_grad_()
    dy = randn((6, N), torch.float32, 2)
    _via_op(x, weight, EPS).backward(dy)
    _, dx, dw, _ = rmsnorm_grads(x, weight, dy, EPS)
    if wants == "x":
        assert weight.grad is None
        assert_grad(x.grad, dx, x, "dx")
    else:
        assert x.grad is None
        assert_grad(weight.grad, dw, weight, "dw")


# --- fused_add_rmsnorm forward --------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype, wkind, in_fp32", FUSED_CASES, ids=_name)
def test_fused_forward(dtype, wkind, in_fp32, layout):
    """Catches residual_out in the wrong dtype (residual_in_fp32 ignored) or not the sum
    rounded once, out in residual_out's dtype or not the norm of residual_out, the weight
    ignored or rounded twice, and prenorm ignored (prenorm=False returns out alone)."""
    strided = layout == "strided"
    x, residual = randn(SHAPE, dtype, 0, strided=strided), randn(SHAPE, dtype, 3, strided=strided)
    weight = param(wkind, N, dtype, 1)
    kwargs = dict(residual_in_fp32=in_fp32)
    out, residual_out = kbuild.fused_add_rmsnorm(x, residual, weight, EPS, **kwargs)
    res_dtype = torch.float32 if in_fp32 else dtype
    assert residual_out.dtype == res_dtype and residual_out.shape == x.shape
    # x + residual is exact in fp64, so the stored sum is that rounded once, bit for bit.
    exact = x.double() + residual.double()
    torch.testing.assert_close(residual_out, exact.to(res_dtype), rtol=0, atol=0)
    assert_forward(out, _ref(residual_out, weight, EPS), x, "out")
    alone = kbuild.fused_add_rmsnorm(x, residual, weight, EPS, prenorm=False, **kwargs)
    assert isinstance(alone, torch.Tensor)
    torch.testing.assert_close(alone, out, rtol=0, atol=0)


@pytest.mark.parametrize("in_fp32", [False, True], ids=["residual_16bit", "residual_fp32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
def test_fused_normalises_the_stored_sum(dtype, in_fp32):
    """Catches out computed from the exact (fp32) sum while residual_out is stored rounded to
    16 bits, or from a 16-bit sum while residual_out is fp32. A residual 2^-7 the size of x
    makes nearly every 16-bit sum round; normalising the other sum moves a quarter of the
    outputs by an ulp (inside FWD_TOL), which the witness shows the check sees."""
    x, residual = randn((8, 512), dtype, 0), randn((8, 512), dtype, 3, scale=2**-7)
    weight = param("same", 512, dtype, 1)
    out, residual_out = kbuild.fused_add_rmsnorm(x, residual, weight, residual_in_fp32=in_fp32)
    exact = x.double() + residual.double()
    rounded = exact.to(dtype).double()
    assert (rounded != exact).double().mean() > 0.5  # the 16-bit sums do round
    stored, other = (exact.float().double(), rounded) if in_fp32 else (rounded, exact)
    torch.testing.assert_close(residual_out.double(), stored, rtol=0, atol=0)
    ref = _ref(stored, weight, EPS)
    assert_forward(out, ref, x, "out")
    assert rounding_flips(_ref(other, weight, EPS).to(dtype), ref) > MAX_FLIPS


@pytest.mark.parametrize("eps", [None, 1e-5], ids=["default", "1e-5"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_fused_eps(dtype, eps):
    """Catches the fused form's eps ignored, misplaced or defaulting to other than 1e-6
    (sums of magnitude sqrt(eps): eps / 10 or 10 * eps fails FWD_TOL)."""
    value = EPS if eps is None else eps
    x, residual = (randn((4, N), dtype, s, scale=0.7 * value**0.5) for s in (0, 3))
    weight = param("same", N, dtype, 1)
    args = (x, residual, weight) if eps is None else (x, residual, weight, eps)
    out, residual_out = kbuild.fused_add_rmsnorm(*args)
    assert_forward(out, _ref(residual_out, weight, value), x)
    for wrong in (value / 10, value * 10):
        assert not loosely_close(out, _ref(residual_out, weight, wrong)), wrong


# --- fused_add_rmsnorm gradients ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["dres", "out_only", "prenorm_false"])
@pytest.mark.parametrize("dtype, wkind, in_fp32", FUSED_CASES, ids=_name)
def test_fused_gradients(dtype, wkind, in_fp32, mode):
    """Catches, in the fused backward (_fused_backward, rmsnorm_bwd_reference): the gradient
    through residual_out dropped, or added after the cast to x's dtype (a double rounding),
    d(residual) differing from d(x), dw not taken over the stored sum, a dropped c1 term, a
    wrong gradient dtype; with prenorm=False, the single output's autograd wiring. Rank-3
    strided inputs."""
    x = randn(SHAPE, dtype, 0, strided=True).requires_grad_()
    residual = randn(SHAPE, dtype, 3, strided=True).requires_grad_()
    weight = param(wkind, N, dtype, 1)
    if weight is not None:
        weight.requires_grad_()
    res_dtype = torch.float32 if in_fp32 else dtype
    dy = randn(SHAPE, dtype, 2)
    dres = randn(SHAPE, res_dtype, 4) if mode == "dres" else None
    result = kbuild.fused_add_rmsnorm(
        x, residual, weight, EPS, prenorm=mode != "prenorm_false", residual_in_fp32=in_fp32
    )
    if mode == "dres":
        torch.autograd.backward(list(result), [dy, dres])
    else:
        (result[0] if mode == "out_only" else result).backward(dy)
    # The gradient is that of the norm of the stored (rounded) sum, plus dresidual_out.
    stored = (x.detach().double() + residual.detach().double()).to(res_dtype)
    _, dsum, dw, _ = rmsnorm_grads(stored, weight, dy, EPS, dresidual_out=dres)
    assert_grad(x.grad, dsum, x, "dx")
    torch.testing.assert_close(residual.grad, x.grad, rtol=0, atol=0)
    if weight is not None:
        assert_grad(weight.grad, dw, weight, "dw")


# --- the backward ops called directly, and the eager Functions' backward ------------------


@pytest.mark.parametrize("dtype, wkind", [(torch.bfloat16, "same"), (torch.float16, "f32")])
def test_backward_ops_return_the_inputs_dtypes(dtype, wkind):
    """Catches a CPU backward returning fp32 dx or dw (a cast dropped in rmsnorm_bwd_reference,
    _rmsnorm_backward or _fused_backward). Autograd casts a gradient to its input's dtype and
    hides that, but torch.compile calls kbuild::rmsnorm_bwd and kbuild::fused_add_rmsnorm_bwd
    directly, and their fake kernels promise x's and the weight's dtypes."""
    x, weight, dy = randn(SHAPE, dtype, 0), param(wkind, N, dtype, 1), randn(SHAPE, dtype, 2)
    rstd = torch.rsqrt(x.float().square().mean(-1) + EPS).reshape(-1)
    dx, dw = OPS.rmsnorm_bwd(dy, x, weight, rstd, True, True)
    _, dx64, dw64, _ = rmsnorm_grads(x, weight, dy, EPS)
    assert_grad(dx, dx64, x, "rmsnorm_bwd dx")
    assert_grad(dw, dw64, weight, "rmsnorm_bwd dw")
    dres = randn(SHAPE, dtype, 4)
    dsum, dres_in, dw = OPS.fused_add_rmsnorm_bwd(dy, dres, x, weight, rstd, True)
    assert dres_in.numel() == 0  # no separate residual gradient unless asked for
    _, dsum64, dw64, _ = rmsnorm_grads(x, weight, dy, EPS, dresidual_out=dres)
    assert_grad(dsum, dsum64, x, "fused_add_rmsnorm_bwd dsum")
    assert_grad(dw, dw64, weight, "fused_add_rmsnorm_bwd dw")


def _ctx(saved, needs, **extra):
    """What autograd hands a Function's backward. The eager Functions run on CUDA only, but
    their backward's wiring (need flags, output slots) is plain Python over the shared
    backward, whose CPU branch runs here."""
    return SimpleNamespace(saved_tensors=saved, needs_input_grad=needs, **extra)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)], ids=str)
def test_eager_rmsnorm_function_backward(needs, offset):
    """Catches RMSNormFunction.backward (eager CUDA training) putting dx or dw in the wrong
    slot, ignoring a need flag, returning fp32 gradients for bf16 inputs, or dropping the
    weight offset (Gemma's 1 + w: dx changes, dw does not)."""
    dtype = torch.bfloat16
    x, weight, dy = randn(SHAPE, dtype, 0), param("same", N, dtype, 1), randn(SHAPE, dtype, 2)
    rstd = torch.rsqrt(x.float().square().mean(-1) + EPS).reshape(-1)
    ctx = _ctx((x, weight, rstd), (*needs, False, False), offset=offset)
    dx, dw, deps, doffset = RMSNormFunction.backward(ctx, dy)
    _, dx64, dw64, _ = rmsnorm_grads(x, weight, dy, EPS, offset=offset)
    assert deps is None and doffset is None
    for grad, ref, like, need in ((dx, dx64, x, needs[0]), (dw, dw64, weight, needs[1])):
        if need:
            assert_grad(grad, ref, like)
        else:
            assert grad is None


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("case", ["all", "residual_only", "residual_out_only"])
def test_eager_fused_function_backward(case, offset):
    """Catches FusedAddRMSNormFunction.backward giving d(residual) other than d(x) (the same
    values), dropping the gradient through residual_out, ignoring a need flag, or mishandling
    an unused out (dy None: the gradient is dresidual_out alone)."""
    dtype = torch.bfloat16
    residual_out, weight = randn(SHAPE, dtype, 0), param("same", N, dtype, 1)
    dy, dres = randn(SHAPE, dtype, 2), randn(SHAPE, dtype, 4)
    rstd = torch.rsqrt(residual_out.float().square().mean(-1) + EPS).reshape(-1)
    needs = (case != "residual_only", True, case != "residual_only", False, False, False)
    ctx = _ctx(
        (residual_out, weight, rstd), needs, out_dtype=dtype, offset=offset, residual_dtype=None
    )
    upstream = None if case == "residual_out_only" else dy
    dx, dresidual, dw, *rest = FusedAddRMSNormFunction.backward(ctx, upstream, dres)
    assert rest == [None, None, None]
    seen_dy = torch.zeros(SHAPE, dtype=dtype) if upstream is None else upstream
    _, dsum64, dw64, _ = rmsnorm_grads(
        residual_out, weight, seen_dy, EPS, dresidual_out=dres, offset=offset
    )
    assert_grad(dresidual, dsum64, residual_out, "dresidual")
    if case == "residual_only":
        assert dx is None and dw is None
    else:
        torch.testing.assert_close(dx, dresidual, rtol=0, atol=0)
        assert_grad(dw, dw64, weight, "dw")


# --- the weight offset (Gemma: y = x_hat * (1 + w)) -----------------------------------------


def _gemma_weight(n: int, dtype, seed: int) -> torch.Tensor:
    """Small weights, as Gemma's are (initialised to 0): |w| under 2^-7, so 1 + w rounded to
    bf16 (spacing 2^-7 at 1) would lose w entirely or round it to a multiple of 2^-7."""
    g = torch.Generator().manual_seed(seed)
    return ((torch.rand(n, generator=g) - 0.5) * 2**-6).to(dtype)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32], ids=_name)
@pytest.mark.parametrize("route", ["autograd", "op", "fused"])
def test_offset_added_in_fp32(route, wdtype):
    """Catches the offset added to a 16-bit weight before widening (bf16 1 + 2^-8 is 1.0: the
    output loses w), the offset ignored, or applied to the output: forward and gradients
    against fp64 x_hat * (1 + w), with the bf16-first variant shown to fail the same check."""
    dtype = torch.bfloat16
    x = randn(SHAPE, dtype, 0).requires_grad_()
    weight = _gemma_weight(N, wdtype, 1).requires_grad_()
    dy = randn(SHAPE, dtype, 2)
    y64, dx64, dw64, _ = rmsnorm_grads(x, weight, dy, EPS, offset=1.0)
    if route == "autograd":
        y = kbuild.rmsnorm(x, weight, EPS, offset=1.0)
    elif route == "op":
        y = OPS.rmsnorm_fwd(x, weight, EPS, True, 1.0)[0]
    else:
        zero = torch.zeros(SHAPE, dtype=dtype)
        y = kbuild.fused_add_rmsnorm(x, zero, weight, EPS, prenorm=False, offset=1.0)
    assert_forward(y, y64, x, "offset forward")
    dx, dw = torch.autograd.grad(y, [x, weight], dy)
    assert_grad(dx, dx64, x, "offset dx")
    assert_grad(dw, dw64, weight, "offset dw")
    # The wrong variant: 1 + w rounded to bf16 first. Its error is visible to this check.
    rounded = (weight.detach().to(torch.bfloat16) + 1).to(torch.bfloat16)
    wrong = kbuild.rmsnorm(x.detach(), rounded, EPS)
    assert rounding_flips(wrong, y64, neighbours_only=False) > MAX_FLIPS


def test_offset_zero_is_plain_rmsnorm_and_dw_ignores_it():
    """offset=0 (and None) is RMSNorm itself, bit for bit; dw is of w alone under any offset
    (d/dw of x_hat * (c + w) is x_hat * dy whatever c is)."""
    x, w, dy = (
        randn(SHAPE, torch.float32, 0),
        param("same", N, torch.float32, 1),
        randn(SHAPE, torch.float32, 2),
    )
    plain = kbuild.rmsnorm(x, w, EPS)
    assert torch.equal(kbuild.rmsnorm(x, w, EPS, offset=0.0), plain)
    assert torch.equal(kbuild.rmsnorm(x, w, EPS, offset=None), plain)
    wa, wb = w.clone().requires_grad_(), w.clone().requires_grad_()
    (dwa,) = torch.autograd.grad(kbuild.rmsnorm(x, wa, EPS, offset=0.0), [wa], dy)
    (dwb,) = torch.autograd.grad(kbuild.rmsnorm(x, wb, EPS, offset=3.0), [wb], dy)
    torch.testing.assert_close(dwa, dwb, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(offset=1), TypeError, None),
        (dict(offset=True), TypeError, "offset must be a float"),
        (dict(offset="1"), TypeError, "offset must be a float"),
        (dict(offset=float("inf")), ValueError, "offset must be a finite number"),
        (dict(offset=float("nan")), ValueError, "offset must be a finite number"),
        (dict(offset=1.0, weight=None), ValueError, "weight is None"),
    ],
    ids=["int ok", "bool", "str", "inf", "nan", "no weight"],
)
def test_offset_errors(kwargs, error, text):
    x = randn((3, N), torch.float32, 0)
    args = dict(weight=param("same", N, torch.float32, 1), eps=EPS) | kwargs
    if text is None:  # an int is a number: accepted as a float
        torch.testing.assert_close(
            kbuild.rmsnorm(x, **args), kbuild.rmsnorm(x, args["weight"], EPS, 1.0)
        )
        return
    for fn in (kbuild.rmsnorm, lambda x, **a: kbuild.fused_add_rmsnorm(x, x, **a)):
        with pytest.raises(error, match=text):
            fn(x, **args)


# --- an fp32 residual stream through a pre-norm stack ---------------------------------------


def _stack(x, residual, weights, mats, norm):
    """A pre-norm stack: each layer adds the sublayer output h to the residual stream,
    normalises it, and its sublayer (a matmul) makes the next h. Returns (h, stream)."""
    h = x
    for w, m in zip(weights, mats, strict=True):
        out, residual = norm(h, residual, w)
        h = out @ m
    return h, residual


def _fp64_norm(h, residual, w):
    s = residual.double() + h.double()
    return s * torch.rsqrt(s.square().mean(-1, keepdim=True) + EPS) * w.double(), s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_name)
def test_fp32_residual_stream_chains(dtype):
    """Catches an fp32 residual refused by the next call (the TypeError this used to be), the
    stream rounded to x's dtype along the stack, or wrong gradients through it: 4 layers
    chained by residual_in_fp32, forward and every gradient against fp64."""
    layers = 4
    x = randn((6, N), dtype, 0).requires_grad_()
    residual0 = randn((6, N), dtype, 1).requires_grad_()
    weights = [param("f32", N, torch.float32, 10 + i).requires_grad_() for i in range(layers)]
    mats = [randn((N, N), dtype, 20 + i, scale=N**-0.5) for i in range(layers)]

    def norm(h, residual, w):
        out, stream = kbuild.fused_add_rmsnorm(h, residual, w, EPS, residual_in_fp32=True)
        assert stream.dtype == torch.float32 and out.dtype == dtype
        return out, stream

    h, stream = _stack(x, residual0, weights, mats, norm)
    ref_h, ref_stream = _stack(x, residual0, weights, [m.double() for m in mats], _fp64_norm)
    tol = GRAD_TOL[dtype]
    assert_close_rel(stream, ref_stream, 2 * tol, "stream")
    assert_close_rel(h, ref_h, 4 * tol, "h")
    inputs = [x, residual0, *weights]
    dh, ds = randn((6, N), dtype, 5), randn((6, N), torch.float32, 6)
    grads = torch.autograd.grad([h, stream], inputs, [dh, ds])
    refs = torch.autograd.grad([ref_h, ref_stream], inputs, [dh.double(), ds.double()])
    for name, g, r, t in zip(
        ["x", "residual", *(f"w{i}" for i in range(layers))], grads, refs, inputs, strict=True
    ):
        assert g.dtype == t.dtype, name
        assert_close_rel(g, r, 8 * tol, name)


def test_fp32_residual_gradient_is_not_rounded():
    """Catches the fp32 stream's gradient computed in x's dtype and widened (one bf16 rounding:
    a relative error near 2^-9, far above this fp32 tolerance): d(residual) of one fused
    call with a bf16 x and an fp32 residual, against fp64."""
    x = randn(SHAPE, torch.bfloat16, 0).requires_grad_()
    residual = randn(SHAPE, torch.float32, 1).requires_grad_()
    w = param("f32", N, torch.float32, 2)
    dy = randn(SHAPE, torch.bfloat16, 3)
    out, stream = kbuild.fused_add_rmsnorm(x, residual, w, EPS)
    assert stream.dtype == torch.float32  # an fp32 residual continues an fp32 stream
    dx, dres = torch.autograd.grad(out, [x, residual], dy)
    assert (dx.dtype, dres.dtype) == (torch.bfloat16, torch.float32)
    s = (x.detach().double() + residual.detach().double()).float()  # the stored stream
    _, ref, _, _ = rmsnorm_grads(s, w, dy, EPS)
    assert_close_rel(dres, ref, 1e-5, "d(residual)")
    assert_close_rel(dx, ref, GRAD_TOL[torch.bfloat16], "dx")
    with pytest.raises(TypeError, match=r"residual must have the dtype of x .* or float32"):
        kbuild.fused_add_rmsnorm(x, residual.half(), w, EPS)
