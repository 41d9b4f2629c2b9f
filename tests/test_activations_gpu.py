"""kbuild.kernels.activations.op' kernels on the GPU (swiglu, geglu, gelu): values and gradients
against fp64 torch in every form of (gate, up) (dense, fused gate_up, the halves of one
tensor passed as views, views laid out differently, which are copied), widths not a
multiple of 8 (peeled rows), rows sharing a block, a misaligned view; the CUDA kernels equal
the CPU reference within one rounding. Kernels warmed with `kbuild warmup --arch sm_90
--module kbuild.kernels.activations.op` (its warmup_specs() lists every case below:
tests/test_activations_cpu.py checks it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kbuild.cases import ACTIVATION_GPU_DTYPES as GPU_DTYPES
from kbuild.cases import ACTIVATION_GPU_N as GPU_N
from kbuild.cases import ACTIVATION_MISALIGNED as MISALIGNED
from kbuild.cases import ACTIVATION_MODELS as MODELS

pytestmark = pytest.mark.gpu

# (family, I, dtype, tanh): tanh None for swiglu
GATED_CASES = [
    (family, N, dtype, tanh)
    for N in GPU_N
    for dtype in GPU_DTYPES
    for family, tanh in (("swiglu", None), ("geglu", True), ("geglu", False))
]
GELU_CASES = [(N, dtype, tanh) for N in GPU_N for dtype in GPU_DTYPES for tanh in (True, False)]
TOL = {torch.float32: 4e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
FORMS = ("dense", "fused", "halves", "mixed")


def _randn(shape, dtype, seed, scale=3.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, device="cuda", generator=g) * scale).to(dtype)


def _err(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _call(family, tanh):
    from kbuild.kernels.activations import op as act

    if family == "swiglu":
        return act.swiglu, F.silu
    approximate = "tanh" if tanh else "none"
    return (lambda g, u=None: act.geglu(g, u, approximate)), (
        lambda g: F.gelu(g, approximate=approximate)
    )


def _inputs(form, shape, dtype, seed):
    """(gate, up, leaves): as tests/test_activations_cpu.py's forms."""
    cols = shape[-1]
    gate, up = _randn(shape, dtype, seed), _randn(shape, dtype, seed + 1)
    if form == "dense":
        g, u = gate.requires_grad_(), up.requires_grad_()
        return g, u, (g, u)
    both = torch.cat([gate, up], -1).requires_grad_()
    if form == "fused":
        return both, None, (both,)
    if form == "halves":
        return both[..., :cols], both[..., cols:], (both,)
    g = gate.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    return g, both[..., cols:], (g, both)


def _split_grads(form, grads, cols):
    if form in ("fused", "halves"):
        return grads[0][..., :cols], grads[0][..., cols:]
    if form == "mixed":
        return grads[0], grads[1][..., cols:]
    return grads


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family,N,dtype,tanh", GATED_CASES)
def test_gated_match_fp64(family, N, dtype, tanh, form):
    call, f = _call(family, tanh)
    shape = (5, 7, N)
    gate, up, leaves = _inputs(form, shape, dtype, N)
    dy = _randn(shape, dtype, 3, 1.0)
    y = call(gate, up)
    g, u = gate.chunk(2, -1) if up is None else (gate, up)
    gd, ud = (t.detach().double().requires_grad_() for t in (g, u))
    ref = f(gd) * ud
    dg_ref, du_ref = torch.autograd.grad(ref, (gd, ud), dy.double())
    assert y.shape == shape and y.dtype == dtype
    assert _err(y, ref) <= TOL[dtype]
    dg, du = _split_grads(form, torch.autograd.grad(y, leaves, dy), N)
    assert _err(dg, dg_ref) <= 4 * TOL[dtype] and _err(du, du_ref) <= 4 * TOL[dtype]
    # the CPU reference (the op's contract): within one rounding of the output
    cpu = call(g.detach().cpu(), u.detach().cpu())
    assert _err(y.cpu(), cpu.double()) <= TOL[dtype]


@pytest.mark.parametrize("N,dtype,tanh", GELU_CASES)
def test_gelu_matches_fp64(N, dtype, tanh):
    from kbuild.kernels.activations.op import gelu

    approximate = "tanh" if tanh else "none"
    x = _randn((37, N), dtype, N).requires_grad_()
    dy = _randn((37, N), dtype, 1, 1.0)
    y = gelu(x, approximate)
    (dx,) = torch.autograd.grad(y, x, dy)
    xd = x.detach().double().requires_grad_()
    ref = F.gelu(xd, approximate=approximate)
    (dref,) = torch.autograd.grad(ref, xd, dy.double())
    assert _err(y, ref) <= TOL[dtype] and _err(dx, dref) <= 4 * TOL[dtype]


def test_misaligned_views():
    """Tensors starting 2 bytes past a 16-byte boundary take the vectorize=False kernels."""
    from kbuild.kernels.activations.op import gelu, swiglu

    N, dtype = MISALIGNED
    buf = _randn((3 * N * 5 + 1,), dtype, 0)
    gate, up = buf[1 : 1 + 5 * N].view(5, N), buf[1 + 5 * N : 1 + 10 * N].view(5, N)
    gate.requires_grad_()
    up.requires_grad_()
    dy = _randn((5, N), dtype, 1, 1.0)
    y = swiglu(gate, up)
    gd, ud = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    ref = F.silu(gd) * ud
    assert _err(y, ref) <= TOL[dtype]
    dg, du = torch.autograd.grad(y, (gate, up), dy)
    dg_ref, du_ref = torch.autograd.grad(ref, (gd, ud), dy.double())
    assert _err(dg, dg_ref) <= 4 * TOL[dtype] and _err(du, du_ref) <= 4 * TOL[dtype]
    x = gate.detach()
    assert _err(gelu(x, "tanh"), F.gelu(x.double(), approximate="tanh")) <= TOL[dtype]


@pytest.mark.parametrize("family,N", MODELS)
def test_model_widths(family, N):
    """Llama-3-8B / Phi-3-mini (SwiGLU), Gemma-2-2B (GeGLU tanh), GPT-2 (GELU tanh) in bf16,
    fused where the model fuses its projection."""
    from kbuild.kernels.activations import op as act

    dtype = torch.bfloat16
    if family == "gelu":
        x = _randn((64, N), dtype, 0)
        assert _err(act.gelu(x, "tanh"), F.gelu(x.double(), approximate="tanh")) <= TOL[dtype]
        return
    gu = _randn((64, 2 * N), dtype, 0).requires_grad_()
    y = getattr(act, family)(gu)
    f = F.silu if family == "swiglu" else (lambda g: F.gelu(g, approximate="tanh"))
    gd = gu.detach().double().requires_grad_()
    a, b = gd.chunk(2, -1)
    ref = f(a) * b
    dy = _randn((64, N), dtype, 1, 1.0)
    (d,) = torch.autograd.grad(y, gu, dy)
    (dref,) = torch.autograd.grad(ref, gd, dy.double())
    assert _err(y, ref) <= TOL[dtype] and _err(d, dref) <= 4 * TOL[dtype]
