"""The kbuild::* custom ops on CPU, held to the fp64 references of tests/reference.py.

torch.library.opcheck (test_autograd_cpu.py) compares each op with itself, so it cannot see an
op that is consistently wrong. Here every op is called directly, its values and its gradients
(through the autograd registered on the forward ops) are compared with fp64 autograd, and the
backward ops are called with each need_* combination. A CPU torch.compile then traces each
public function to the custom ops (the compile route of kbuild/kernels/norms/api.py) and its
backward to the backward ops, so the registered autograd is what computes the gradients there.

The inputs make every term visible: eps is large next to the mean square of two rows, weights
are not ones, biases not zeros, LayerNorm rows have large means, and (2, 3, N) inputs make the
ops flatten rows to (M,) statistics.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kbuild
import kbuild.kernels.llmc.op  # registers the kbuild::* custom ops (llm.c's)
import kbuild.kernels.norms.api  # registers the kbuild::* custom ops (the norms')

from .gpu_utils import FWD_TOL, GRAD_TOL
from .graph_recorder import KbuildGraphs
from .reference import assert_close_rel, layernorm_grads, rmsnorm_grads

OPS = torch.ops.kbuild
F32, BF16 = torch.float32, torch.bfloat16
N = 32
# Rows scaled by 0.05 and 0.1 have a mean square far below eps: a wrong or dropped eps moves
# their rstd by 2x or more (and the other rows' by ~0.5%, still far outside fp32 tolerance).
EPS = 1e-2
ROW_SCALE = torch.tensor([[0.05, 1.0, 3.0], [0.5, 0.1, 2.0]]).unsqueeze(-1)
# LayerNorm rows far from zero mean: a variance not taken about the mean, or mean and rstd
# mixed up, is off by a lot.
ROW_MEAN = torch.tensor([[0.2, 4.0, 0.0], [-1.0, 0.0, -3.0]]).unsqueeze(-1)
SHAPE = (*ROW_SCALE.shape[:2], N)
TRUE_FALSE = (True, False)


def _randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _x(dtype: torch.dtype, seed: int, centred: bool = True) -> torch.Tensor:
    x = _randn(SHAPE, seed) * ROW_SCALE
    return (x if centred else x + ROW_MEAN).to(dtype)


def _param(dtype: torch.dtype | None, seed: int, base: float) -> torch.Tensor | None:
    return None if dtype is None else (base + 0.5 * _randn((N,), seed)).to(dtype)


def _rms_rstd(x: torch.Tensor) -> torch.Tensor:
    """fp64 rstd per row, flattened to (M,) as the forward ops store it."""
    return torch.rsqrt(x.double().square().mean(-1) + EPS).reshape(-1)


def _ln_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 (mean, rstd) per row, flattened to (M,), the variance taken about the mean."""
    xd = x.double()
    mean = xd.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xd - mean).square().mean(-1) + EPS)
    return mean.reshape(-1), rstd.reshape(-1)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """A forward output against fp64: fp32 math rounded once to `dtype`.

    For 16-bit outputs that is within half a unit in the last place (plus fp32 slack): FWD_TOL's
    1.6e-2 for bf16 would pass a second rounding, e.g. an fp32 weight cast to bf16 first.
    """
    assert out.dtype == dtype and out.shape == ref.shape, what
    if dtype == F32:
        torch.testing.assert_close(out, ref.to(dtype), **FWD_TOL[dtype], msg=what)
        return
    out, ref = out.double(), ref.double()
    # |v| in [2^(e-1), 2^e) has an ulp of finfo.eps * 2^(e-1).
    exponent = torch.frexp(torch.maximum(out.abs(), ref.abs())).exponent
    half_ulp = torch.ldexp(torch.full_like(ref, torch.finfo(dtype).eps), exponent - 2)
    excess = (out - ref).abs() - half_ulp - 1e-5 * (1 + ref.abs())
    assert excess.max() <= 0, f"{what}: {(excess > 0).sum()} elements over half an ulp"


def _stat(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.dtype == F32 and out.shape == ref.shape, what
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6, msg=what)


def _grad(out, ref, dtype: torch.dtype | None, tol_dtype: torch.dtype, what: str) -> None:
    """A gradient against fp64: absent (None or empty) where ref is None, else of `dtype`."""
    if ref is None:
        assert out is None or out.numel() == 0, f"{what}: not asked for, yet returned"
        return
    assert out is not None and out.dtype == dtype, f"{what}: {None if out is None else out.dtype}"
    assert_close_rel(out, ref, GRAD_TOL[tol_dtype], what)


def _grad_of(tensors, grads, t):
    """The gradient torch.autograd.grad returned for t, None when t was not differentiated."""
    return next((g for s, g in zip(tensors, grads, strict=True) if s is t), None)


def _ids(*parts) -> str:
    return "-".join(str(p).replace("torch.", "") for p in parts)


# (x dtype, weight dtype or None): fp32; bf16; bf16 x with fp32 weight (the weight's dtype,
# not x's, is what dw must come back in); no weight.
RMS_CASES = [(F32, F32), (BF16, BF16), (BF16, F32), (F32, None)]
# (x dtype, weight dtype, residual_out dtype): as above, plus residual_in_fp32 with bf16 x.
FUSED_CASES = [(F32, F32, F32), (BF16, BF16, BF16), (BF16, F32, F32), (F32, None, F32)]
# (x dtype, weight dtype, bias dtype): all present, fp32 params with bf16 x, weight alone, none.
LN_CASES = [(F32, F32, F32), (BF16, BF16, BF16), (BF16, F32, F32), (F32, F32, None)]
LN_CASES.append((F32, None, None))


# --- forward ops: values and the store_* flag ----------------------------------------------
# Catch: the CPU branch's eps (wrong or default), store_rstd/store_stats inverted or ignored,
# rstd not flattened to (M,), mean and rstd swapped, residual_out in the wrong dtype or summed
# wrongly, weight or bias dropped.


@pytest.mark.parametrize("store", TRUE_FALSE, ids=["store", "no_store"])
@pytest.mark.parametrize("dtype, wdtype", RMS_CASES, ids=_ids)
def test_rmsnorm_fwd_op_matches_fp64(dtype, wdtype, store):
    x, w = _x(dtype, 0), _param(wdtype, 1, 1.0)
    y, rstd = OPS.rmsnorm_fwd(x, w, EPS, store)
    _close(y, rmsnorm_grads(x, w, torch.zeros(SHAPE), EPS)[0], dtype, "y")
    if store:
        _stat(rstd, _rms_rstd(x), "rstd")
    else:
        assert rstd.numel() == 0, "rstd stored without store_rstd"


@pytest.mark.parametrize("store", TRUE_FALSE, ids=["store", "no_store"])
@pytest.mark.parametrize("dtype, wdtype, rdtype", FUSED_CASES, ids=_ids)
def test_fused_add_rmsnorm_fwd_op_matches_fp64(dtype, wdtype, rdtype, store):
    x, residual, w = _x(dtype, 0), _x(dtype, 3), _param(wdtype, 1, 1.0)
    y, residual_out, rstd = OPS.fused_add_rmsnorm_fwd(x, residual, w, EPS, rdtype, store)
    # The sum is exact in fp64, so the stored residual_out is it rounded once.
    expected_sum = (x.double() + residual.double()).to(rdtype)
    assert residual_out.dtype == rdtype
    torch.testing.assert_close(residual_out, expected_sum, rtol=0, atol=0)
    # y normalises exactly the stored sum (what the backward reads back).
    _close(y, rmsnorm_grads(expected_sum, w, torch.zeros(SHAPE), EPS)[0], dtype, "y")
    if store:
        _stat(rstd, _rms_rstd(expected_sum), "rstd")
    else:
        assert rstd.numel() == 0, "rstd stored without store_rstd"


@pytest.mark.parametrize("store", TRUE_FALSE, ids=["store", "no_store"])
@pytest.mark.parametrize("dtype, wdtype, bdtype", LN_CASES, ids=_ids)
def test_layernorm_fwd_op_matches_fp64(dtype, wdtype, bdtype, store):
    x, w, b = _x(dtype, 0, centred=False), _param(wdtype, 1, 1.0), _param(bdtype, 2, 0.0)
    y, mean, rstd = OPS.layernorm_fwd(x, w, b, EPS, store)
    _close(y, layernorm_grads(x, w, b, torch.zeros(SHAPE), EPS)[0], dtype, "y")
    if store:
        ref_mean, ref_rstd = _ln_stats(x)
        _stat(mean, ref_mean, "mean")
        _stat(rstd, ref_rstd, "rstd")
    else:
        assert mean.numel() == 0 and rstd.numel() == 0, "stats stored without store_stats"


# --- backward ops called directly, every need_* combination ----------------------------------
# Catch: need_dx / need_dw / need_db ignored or crossed, dw cast to x's dtype, the bias or
# weight term dropped from dx, dresidual_out not added, the saved rstd misread.


@pytest.mark.parametrize("need_dx, need_dw", list(itertools.product(TRUE_FALSE, TRUE_FALSE)))
@pytest.mark.parametrize("dtype, wdtype", RMS_CASES, ids=_ids)
def test_rmsnorm_bwd_op(dtype, wdtype, need_dx, need_dw):
    x, w, dy = _x(dtype, 0), _param(wdtype, 1, 1.0), _x(dtype, 2)
    rstd = _rms_rstd(x).float()
    dx, dw = OPS.rmsnorm_bwd(dy, x, w, rstd, need_dx, need_dw)
    _, ref_dx, ref_dw, _ = rmsnorm_grads(x, w, dy, EPS)
    _grad(dx, ref_dx if need_dx else None, dtype, dtype, "dx")
    _grad(dw, ref_dw if need_dw else None, wdtype, dtype, "dw")


@pytest.mark.parametrize("has_dres", TRUE_FALSE, ids=["dres", "no_dres"])
@pytest.mark.parametrize("need_dw", TRUE_FALSE, ids=["need_dw", "no_dw"])
@pytest.mark.parametrize("dtype, wdtype, rdtype", FUSED_CASES, ids=_ids)
def test_fused_add_rmsnorm_bwd_op(dtype, wdtype, rdtype, need_dw, has_dres):
    residual_out, w, dy = _x(rdtype, 0), _param(wdtype, 1, 1.0), _x(dtype, 2)
    dres = _x(rdtype, 4) if has_dres else None
    rstd = _rms_rstd(residual_out).float()
    dsum, dres_in, dw = OPS.fused_add_rmsnorm_bwd(dy, dres, residual_out, w, rstd, need_dw)
    _, ref_dsum, ref_dw, _ = rmsnorm_grads(residual_out, w, dy, EPS, dresidual_out=dres)
    _grad(dsum, ref_dsum, dtype, dtype, "d(x + residual)")
    _grad(dw, ref_dw if need_dw else None, wdtype, dtype, "dw")
    assert dres_in.numel() == 0
    if dtype != torch.float32:  # an fp32 residual stream: its gradient again, in fp32
        args = (dy, dres, residual_out, w, rstd, need_dw, 0.0, torch.float32)
        dsum2, dres32, _ = OPS.fused_add_rmsnorm_bwd(*args)
        assert torch.equal(dsum2, dsum) and dres32.dtype == torch.float32
        _grad(dres32, ref_dsum, torch.float32, dtype, "d(residual) fp32")


@pytest.mark.parametrize("needs", list(itertools.product(TRUE_FALSE, repeat=3)), ids=_ids)
@pytest.mark.parametrize("dtype, wdtype, bdtype", LN_CASES, ids=_ids)
def test_layernorm_bwd_op(dtype, wdtype, bdtype, needs):
    x, dy = _x(dtype, 0, centred=False), _x(dtype, 2)
    w, b = _param(wdtype, 1, 1.0), _param(bdtype, 2, 0.0)
    mean, rstd = (s.float() for s in _ln_stats(x))
    dx, dw, db = OPS.layernorm_bwd(dy, x, w, b, mean, rstd, *needs)
    _, ref_dx, ref_dw, ref_db = layernorm_grads(x, w, b, dy, EPS)
    _grad(dx, ref_dx if needs[0] else None, dtype, dtype, "dx")
    _grad(dw, ref_dw if needs[1] else None, wdtype, dtype, "dw")
    _grad(db, ref_db if needs[2] else None, bdtype, dtype, "db")


# --- gradients through the forward ops' registered autograd ----------------------------------
# Catch: the backward returning None (or a wrong value) for dw or db, dx routed to the wrong
# input, needs_input_grad indices crossed, setup_context saving the wrong tensor (x instead of
# residual_out, y instead of x, rstd and mean swapped), dresidual_out dropped.


def _requiring(which: str, tensors: dict[str, torch.Tensor | None]) -> list[torch.Tensor]:
    """Mark the named tensors (all present ones for "all") as requiring grad."""
    chosen = [t for k, t in tensors.items() if t is not None and which in ("all", k)]
    return [t.requires_grad_() for t in chosen]


@pytest.mark.parametrize("which", ["all", "x", "weight"])
@pytest.mark.parametrize("dtype, wdtype", RMS_CASES, ids=_ids)
def test_rmsnorm_op_autograd(dtype, wdtype, which):
    if wdtype is None and which == "weight":
        pytest.skip("no weight")
    x, w, dy = _x(dtype, 0), _param(wdtype, 1, 1.0), _x(dtype, 2)
    inputs = _requiring(which, dict(x=x, weight=w))
    y, _ = OPS.rmsnorm_fwd(x, w, EPS, True)
    grads = torch.autograd.grad(y, inputs, dy)
    _, ref_dx, ref_dw, _ = rmsnorm_grads(x, w, dy, EPS)
    if x.requires_grad:
        _grad(_grad_of(inputs, grads, x), ref_dx, dtype, dtype, "dx")
    if w is not None and w.requires_grad:
        _grad(_grad_of(inputs, grads, w), ref_dw, wdtype, dtype, "dw")


# flow: which outputs a gradient flows into ("y" alone leaves residual_out's undefined).
@pytest.mark.parametrize("flow", ["y", "both", "residual_out"])
@pytest.mark.parametrize("which", ["all", "x", "residual", "weight"])
@pytest.mark.parametrize("dtype, wdtype, rdtype", FUSED_CASES, ids=_ids)
def test_fused_add_rmsnorm_op_autograd(dtype, wdtype, rdtype, which, flow):
    if wdtype is None and which == "weight":
        pytest.skip("no weight")
    x, residual, w = _x(dtype, 0), _x(dtype, 3), _param(wdtype, 1, 1.0)
    dy, dres = _x(dtype, 2), _x(rdtype, 4)
    inputs = _requiring(which, dict(x=x, residual=residual, weight=w))
    y, residual_out, _ = OPS.fused_add_rmsnorm_fwd(x, residual, w, EPS, rdtype, True)
    outs = {"y": ([y], [dy]), "both": ([y, residual_out], [dy, dres])}
    outs["residual_out"] = ([residual_out], [dres])
    grads = torch.autograd.grad(outs[flow][0], inputs, outs[flow][1])
    ref_dy = torch.zeros_like(dy) if flow == "residual_out" else dy
    ref_dres = None if flow == "y" else dres
    _, ref_dsum, ref_dw, _ = rmsnorm_grads(
        x, w, ref_dy, EPS, residual=residual, dresidual_out=ref_dres
    )
    for name, t in (("dx", x), ("dresidual", residual)):
        if t.requires_grad:
            _grad(_grad_of(inputs, grads, t), ref_dsum, dtype, dtype, name)
    if w is not None and w.requires_grad:
        # dw is taken over residual_out as stored, the reference over the exact sum.
        _grad(_grad_of(inputs, grads, w), ref_dw, wdtype, rdtype, "dw")


@pytest.mark.parametrize("which", ["all", "x", "weight", "bias"])
@pytest.mark.parametrize("dtype, wdtype, bdtype", LN_CASES, ids=_ids)
def test_layernorm_op_autograd(dtype, wdtype, bdtype, which):
    x, dy = _x(dtype, 0, centred=False), _x(dtype, 2)
    w, b = _param(wdtype, 1, 1.0), _param(bdtype, 2, 0.0)
    if dict(weight=w, bias=b).get(which, x) is None:
        pytest.skip(f"no {which}")
    inputs = _requiring(which, dict(x=x, weight=w, bias=b))
    y, _, _ = OPS.layernorm_fwd(x, w, b, EPS, True)
    grads = torch.autograd.grad(y, inputs, dy)
    _, *refs = layernorm_grads(x, w, b, dy, EPS)
    for name, t, ref in zip(("dx", "dw", "db"), (x, w, b), refs, strict=True):
        if t is not None and t.requires_grad:
            _grad(_grad_of(inputs, grads, t), ref, t.dtype, dtype, name)


# --- fake kernels --------------------------------------------------------------------------
# Catch: a fake (meta) kernel whose shape or dtype differs from what the op returns, e.g. rstd
# of (B, T) instead of (M,), stats sized when not stored, dw shaped like x, residual_out in x's
# dtype. torch.compile plans buffers from these, so a mismatch corrupts compiled graphs.


def _fake_cases():
    x, r, dy = _x(BF16, 0), _x(BF16, 3), _x(BF16, 2)
    w, b, rstd = _param(F32, 1, 1.0), _param(F32, 2, 0.0), _rms_rstd(x).float()
    for weight, flag in itertools.product((w, None), TRUE_FALSE):
        yield OPS.rmsnorm_fwd, (x, weight, EPS, flag)
        yield OPS.layernorm_fwd, (x, weight, b, EPS, flag)
        yield OPS.fused_add_rmsnorm_bwd, (dy, dy, r, weight, rstd, flag)
        for rdtype in (BF16, F32):
            yield OPS.fused_add_rmsnorm_fwd, (x, r, weight, EPS, rdtype, flag)
        for need_dw in TRUE_FALSE:
            yield OPS.rmsnorm_bwd, (dy, x, weight, rstd, flag, need_dw)
            for need_db, bias in itertools.product(TRUE_FALSE, (b, None)):
                yield OPS.layernorm_bwd, (dy, x, weight, bias, rstd, rstd, flag, need_dw, need_db)


def test_fake_kernels_match_the_ops():
    for op, args in _fake_cases():
        real = op(*args)
        with FakeTensorMode() as mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        for i, (f, r) in enumerate(zip(fake, real, strict=True)):
            assert (f.shape, f.dtype) == (r.shape, r.dtype), f"{op} output {i}, args {args[3:]}"


# --- torch.compile on CPU: the public functions traced to the custom ops ---------------------
# On CPU the eager public functions return the reference directly; under torch.compile they
# call the custom ops (plain RMSNorm excepted: its torch math, api.py; its op is compiled by
# name below), so these graphs run the ops' forward, their registered autograd and
# their backward ops. Catch: any of the autograd bugs above as seen by compiled training (a
# dropped dw or db), api.py's compile route passing the wrong eps, weight or bias, or
# store_rstd=False while a gradient is needed.


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _public(name: str):
    """The public function as (x, residual, weight, bias) -> tuple of outputs."""
    if name == "rmsnorm":
        return lambda x, residual, w, b: (kbuild.rmsnorm(x, w, eps=EPS),)
    if name == "fused_add_rmsnorm":
        return lambda x, residual, w, b: kbuild.fused_add_rmsnorm(x, residual, w, eps=EPS)
    return lambda x, residual, w, b: (kbuild.layernorm(x, w, b, eps=EPS),)


def _fp64(name, x, residual, w, b, grad_outs):
    """fp64 (outputs, grads by input) of the public function."""
    if name == "layernorm":
        y, dx, dw, db = layernorm_grads(x, w, b, grad_outs[0], EPS)
        return (y,), (dx, dw, db)
    if name == "rmsnorm":
        y, dx, dw, _ = rmsnorm_grads(x, w, grad_outs[0], EPS)
        return (y,), (dx, dw)
    y, dsum, dw, added = rmsnorm_grads(x, w, grad_outs[0], EPS, residual, grad_outs[1])
    return (y, added), (dsum, dsum, dw)


def _compiled_matches_fp64(name, backend, dtype, pdtype):
    x, residual = _x(dtype, 0, centred=name != "layernorm"), _x(dtype, 3)
    w, b = _param(pdtype, 1, 1.0), _param(pdtype, 2, 0.0)
    inputs = {"rmsnorm": [x, w], "fused_add_rmsnorm": [x, residual, w], "layernorm": [x, w, b]}
    inputs = [t.requires_grad_() for t in inputs[name]]
    compiled = torch.compile(_public(name), backend=backend, fullgraph=True)
    outs = compiled(x, residual, w, b)
    grad_outs = [_x(o.dtype, 5 + i) for i, o in enumerate(outs)]
    grads = torch.autograd.grad(outs, inputs, grad_outs)
    ref_outs, ref_grads = _fp64(name, x, residual, w, b, grad_outs)
    for i, (out, ref) in enumerate(zip(outs, ref_outs, strict=True)):
        _close(out, ref, dtype, f"output {i}")
    for t, g, ref in zip(inputs, grads, ref_grads, strict=True):
        _grad(g, ref, t.dtype, dtype, f"grad of a {tuple(t.shape)} input")


COMPILE_CASES = [
    ("rmsnorm", F32, F32),
    ("fused_add_rmsnorm", F32, F32),
    ("layernorm", F32, F32),
    ("layernorm", BF16, F32),  # fp32 dw and db with bf16 x
]


@pytest.mark.parametrize("name, dtype, pdtype", COMPILE_CASES, ids=_ids)
def test_compiled_public_function_traces_the_ops(fresh_dynamo, name, dtype, pdtype):
    """The fused form and LayerNorm trace to their ops; plain RMSNorm to torch operations
    (inductor fuses them with their neighbours: api.py), no kbuild op in either graph."""
    recorder = KbuildGraphs()
    _compiled_matches_fp64(name, recorder.backend, dtype, pdtype)
    if name == "rmsnorm":
        assert recorder.ops == {"fw": set(), "bw": set()}, recorder.ops
        return
    assert recorder.ops["fw"] == {f"kbuild.{name}_fwd.default"}, recorder.ops
    assert recorder.ops["bw"] == {f"kbuild.{name}_bwd.default"}, recorder.ops


@pytest.mark.parametrize("backend", ["recording", "inductor"])
def test_compiled_rmsnorm_op_called_directly(fresh_dynamo, backend):
    """kbuild::rmsnorm_fwd called by name still compiles (fake, autograd, backward op),
    with the weight offset, and matches fp64; under inductor with a transposed x too (the
    ops' outputs are dense, as their fakes say, whatever x's layout)."""
    recorder = KbuildGraphs()
    x = _x(F32, 0)
    if backend == "inductor":
        x = x.transpose(0, -1).contiguous().transpose(0, -1)  # same values, reversed strides
    x, w = x.requires_grad_(), _param(F32, 1, 0.0).requires_grad_()
    fn = torch.compile(
        lambda x, w: torch.ops.kbuild.rmsnorm_fwd(x, w, EPS, True, 1.0)[0],
        backend=recorder.backend if backend == "recording" else "inductor",
        fullgraph=True,
    )
    y = fn(x, w)
    dy = _x(F32, 5)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    ref_y, ref_dx, ref_dw, _ = rmsnorm_grads(x, w, dy, EPS, offset=1.0)
    _close(y, ref_y, F32, "y")
    _grad(dx, ref_dx, F32, F32, "dx")
    _grad(dw, ref_dw, F32, F32, "dw")
    if backend == "inductor":
        return
    assert recorder.ops["fw"] == {"kbuild.rmsnorm_fwd.default"}, recorder.ops
    assert recorder.ops["bw"] == {"kbuild.rmsnorm_bwd.default"}, recorder.ops


def test_compiled_layernorm_with_inductor(fresh_dynamo):
    # inductor plans its buffers from the fake kernels and checks the ops' outputs against
    # them; fused_add_rmsnorm runs under inductor in test_autograd_cpu.py, rmsnorm's op
    # below.
    _compiled_matches_fp64("layernorm", "inductor", F32, F32)
