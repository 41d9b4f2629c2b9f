"""kbuild.kernels.activations.op (swiglu, geglu, gelu) on CPU: the ops' references, which are the
kernels' contract, against fp64 torch, values and gradients, in every form of (gate, up)
(dense, fused gate_up, strided views); what autograd saves; the argument errors; the
kernels' own formulas (kernels/activations/kernels.py `activation`) run on the CPU by MLIR's
ExecutionEngine against fp64; the kernels built for sm_90 (16-byte accesses in an aligned
row's body) and lowered for gfx942; the GPU cases' kernels warmable."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from kbuild import cases
from kbuild.kernels.activations import op as act

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Relative to the largest |result|: a few ulps of fp32 math, one rounding of 16-bit outputs.
TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
# (name, the public call, its fp64 activation)
GATED = [
    ("swiglu", lambda g, u: act.swiglu(g, u), F.silu),
    ("geglu_tanh", lambda g, u: act.geglu(g, u), lambda g: F.gelu(g, approximate="tanh")),
    ("geglu_erf", lambda g, u: act.geglu(g, u, "none"), F.gelu),
]
GELU = [("tanh", "tanh"), ("erf", "none")]


def _randn(shape, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _fp64_gated(f, gate, up, dy):
    g = gate.detach().double().requires_grad_()
    u = up.detach().double().requires_grad_()
    y = f(g) * u
    return (y, *torch.autograd.grad(y, (g, u), dy.double()))


def _forms(shape, dtype, seed):
    """(form, gate, up, the leaf gradients flow to): dense, fused (up None), the two halves of
    one (..., 2I) tensor passed separately, and views laid out differently (copied)."""
    cols = shape[-1]
    gate, up = _randn(shape, dtype, seed), _randn(shape, dtype, seed + 1)
    gu = torch.cat([gate, up], -1).requires_grad_()
    halves = torch.cat([gate, up], -1).requires_grad_()
    wide = torch.cat([_randn(shape, dtype, 9), up], -1).requires_grad_()
    g_dense, u_dense = gate.clone().requires_grad_(), up.clone().requires_grad_()
    gate_t = gate.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    return [
        ("dense", g_dense, u_dense, (g_dense, u_dense)),
        ("fused", gu, None, (gu,)),
        ("halves", halves[..., :cols], halves[..., cols:], (halves,)),
        ("mixed", gate_t, wide[..., cols:], (gate_t, wide)),
    ]


@pytest.mark.parametrize("name,call,f", GATED, ids=[g[0] for g in GATED])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 7, 64, 1001, 5632])  # 5632: a forward that streams
def test_gated_values_and_gradients_match_fp64(name, call, f, dtype, N):
    """Every form of (gate, up) gives the same y and gradients as fp64 torch within one
    rounding: the fused form's d(gate_up) is (dgate, dup) side by side."""
    shape = (3, 4, N)
    dy = _randn(shape, dtype, 5, 1.0)
    for form, gate, up, leaves in _forms(shape, dtype, seed=N):
        y = call(gate, up)
        g, u = gate.chunk(2, -1) if up is None else (gate, up)
        ref, dg_ref, du_ref = _fp64_gated(f, g, u, dy)
        assert y.shape == shape and y.dtype == dtype, form
        assert _err(y, ref) <= TOL[dtype], (form, _err(y, ref))
        grads = torch.autograd.grad(y, leaves, dy)
        if form == "fused":
            dg, du = grads[0].chunk(2, -1)
        elif form == "halves":
            dg, du = grads[0][..., :N], grads[0][..., N:]
        elif form == "mixed":
            dg, du = grads[0], grads[1][..., N:]
            assert not grads[1][..., :N].any()
        else:
            dg, du = grads
        assert dg.dtype == dtype and du.dtype == dtype
        assert _err(dg, dg_ref) <= 4 * TOL[dtype], (form, _err(dg, dg_ref))
        assert _err(du, du_ref) <= 4 * TOL[dtype], (form, _err(du, du_ref))


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 33, 3072, 5632])
def test_gelu_values_and_gradients_match_fp64(approximate, dtype, N):
    x = _randn((5, N), dtype, N).requires_grad_()
    dy = _randn((5, N), dtype, 1, 1.0)
    y = act.gelu(x, approximate)
    (dx,) = torch.autograd.grad(y, x, dy)
    xd = x.detach().double().requires_grad_()
    ref = F.gelu(xd, approximate=approximate)
    (dref,) = torch.autograd.grad(ref, xd, dy.double())
    assert y.dtype == dtype and dx.dtype == dtype and y.shape == x.shape
    assert _err(y, ref) <= TOL[dtype] and _err(dx, dref) <= 4 * TOL[dtype]
    other = "none" if approximate == "tanh" else "tanh"  # the other form is told apart
    if dtype == torch.float32:
        wrong = (act.gelu(x, other).double() - ref).abs().max()
        assert wrong > 10 * (y.double() - ref).abs().max()


def test_the_fused_form_equals_the_split_form():
    """Bit for bit: the same math, gate the first half."""
    gu = _randn((2, 3, 2 * 96), torch.bfloat16, 3).requires_grad_()
    g, u = (t.detach().clone().requires_grad_() for t in gu.chunk(2, -1))
    dy = _randn((2, 3, 96), torch.bfloat16, 4, 1.0)
    for f in (act.swiglu, act.geglu, lambda a, b=None: act.geglu(a, b, "none")):
        y_fused, y_split = f(gu), f(g, u)
        assert torch.equal(y_fused, y_split)
        (dgu,) = torch.autograd.grad(y_fused, gu, dy)
        assert torch.equal(dgu, torch.cat(torch.autograd.grad(y_split, (g, u), dy), -1))


@pytest.mark.parametrize("name", ["swiglu", "gelu"])
def test_rounded_once_from_fp32(name):
    """bf16 outputs are fp32 math rounded once: they equal the exact result rounded to bf16
    but for near-ties, GELU's negative tail too (g sigmoid(2u): fp64 torch's own 0.5 g
    (1 + tanh u) is 0 below g = -9); silu(gate) or tanh(u) rounded to bf16 on the way
    differs far more often."""
    gate, up = _randn((8, 512), torch.bfloat16, 1), _randn((8, 512), torch.bfloat16, 2)
    g = gate.double()
    if name == "gelu":
        y = act.gelu(gate, "tanh")
        exact = g * torch.sigmoid(2 * 0.7978845608028654 * (g + 0.044715 * g**3))
        tanh_u = torch.tanh(0.7978845608 * (g + 0.044715 * g**3)).to(torch.bfloat16)
        twice = (0.5 * g * (1 + tanh_u.double())).to(torch.bfloat16)
    else:
        y, exact = act.swiglu(gate, up), F.silu(g) * up.double()
        twice = F.silu(gate.float()).to(torch.bfloat16) * up
    exact = exact.to(torch.bfloat16)
    assert (y != exact).sum() <= 8
    assert (twice != exact).sum() > 200


def test_backward_saves_the_inputs_only():
    """Autograd keeps gate and up (or gate_up, or x), views as they are: no (..., I) tensor of
    the activation's output, no copy."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    gu = _randn((4, 2 * 64), torch.bfloat16, 0).requires_grad_()
    x = _randn((4, 64), torch.bfloat16, 1).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        act.swiglu(gu)
        fused = list(saved)
        saved.clear()
        act.geglu(gu[..., :64], gu[..., 64:])
        halves = list(saved)
        saved.clear()
        act.gelu(x, "tanh")
        gelu = list(saved)
    assert len(fused) == 1 and fused[0].data_ptr() == gu.data_ptr()
    assert [t.data_ptr() for t in halves] == [gu.data_ptr(), gu[:, 64:].data_ptr()]
    assert len(gelu) == 1 and gelu[0].data_ptr() == x.data_ptr()


def test_strided_layouts():
    """The halves of one (M, 2I) tensor are read in place (a group of one row, rows 2I
    apart); dense pairs and pairs laid out differently are not."""
    gu = torch.empty(6, 2 * 40)
    assert act.strided_layout(gu[:, :40], gu[:, 40:]) == (1, 80)
    bt = torch.empty(2, 3, 2 * 40)
    assert act.strided_layout(bt[..., :40], bt[..., 40:]) == (1, 80)
    dense = torch.empty(6, 40)
    assert act.strided_layout(dense, dense) is None
    assert act.strided_layout(gu[:, :40], dense) is None
    assert act.strided_layout(gu[:, :40].t(), gu[:, 40:].t()) is None


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: act.swiglu("x"), TypeError, "gate must be a torch.Tensor"),
        (lambda: act.swiglu(torch.ones(2, 4, dtype=torch.int64)), TypeError,
         "gate must be torch.float32"),
        (lambda: act.swiglu(torch.ones(2, 4), torch.ones(2, 5)), ValueError,
         "up must have the shape of gate"),
        (lambda: act.swiglu(torch.ones(2, 4), torch.ones(2, 4).half()), TypeError,
         "up must have the dtype of gate"),
        (lambda: act.swiglu(torch.ones(2, 4), "u"), TypeError, "up must be a torch.Tensor"),
        (lambda: act.swiglu(torch.ones(2, 5)), ValueError, "must have an even last dimension"),
        (lambda: act.geglu(torch.ones(2, 5)), ValueError, "must have an even last dimension"),
        (lambda: act.geglu(torch.ones(2, 4), approximate="erf"), ValueError,
         "approximate must be 'tanh' or 'none'"),
        (lambda: act.geglu(torch.ones(2, 4), approximate=None), TypeError,
         "approximate must be 'tanh' or 'none'"),
        (lambda: act.gelu(torch.ones(2, 4), "exact"), ValueError, "approximate must be"),
        (lambda: act.gelu(torch.ones(2, 4, dtype=torch.float64)), TypeError, "x must be"),
        (lambda: act.gelu(torch.tensor(1.0)), ValueError, "x must have at least one dim"),
    ],
)  # fmt: skip
def test_errors_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_ops_check_their_arguments():
    """The ops called directly (torch.ops.kbuild.*) check what the public functions check."""
    dense, strided, fused = act.SWIGLU
    with pytest.raises(ValueError, match="even last dimension"):
        fused(torch.ones(2, 5))
    with pytest.raises(ValueError, match="gate_up must have the shape"):
        fused.backward(torch.ones(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="up must have the shape"):
        strided(torch.ones(2, 4), torch.ones(3, 4))
    with pytest.raises(ValueError, match="dy must have the shape"):
        dense.backward(torch.ones(2, 4), torch.ones(2, 4), torch.ones(2, 3))


def test_the_dense_ops_are_declarations_only():
    """The dense forms and GELU, forward and backward, are all declarations: the C++ generic
    kernel runs them where the extension loads. The fused and strided forms launch from
    Python (the module docstring says why)."""
    for dense, strided, fused in (act.SWIGLU, act.GEGLU):
        assert dense.native_program() is not None
        assert dense.backward.native_program() is not None
        assert strided.native_program() is None and fused.native_program() is None
    assert act.GELU.native_program() is not None
    assert act.GELU.backward.native_program() is not None


def test_empty_inputs():
    for shape in ((0, 8), (3, 0)):
        gu = torch.ones(shape[0], 2 * shape[1], requires_grad=True)
        y = act.swiglu(gu)
        assert y.shape == shape
        (d,) = torch.autograd.grad(y.sum(), gu, allow_unused=True, materialize_grads=True)
        assert d.shape == gu.shape


def test_fake_gives_the_declared_outputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        gu = torch.empty(4, 7, 2 * 14336, dtype=torch.bfloat16)
        y = torch.ops.kbuild.swiglu_fused(gu)
        assert y.shape == (4, 7, 14336) and y.dtype == torch.bfloat16
        d = torch.ops.kbuild.geglu_fused_backward(y, gu, True)
        assert d.shape == gu.shape


# ----------------------------------------------------------------------------- the formulas


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh", "gelu"])
def test_the_kernels_formulas_match_fp64(kind):
    """kernels/activations/kernels.py's `activation` (what every kernel computes), compiled for the
    host and run on a grid of inputs: act and act' within a few fp32 ulps of the largest
    |value| of fp64 torch's, deep in both tails too (no NaN, no cancellation blow-up)."""
    pytest.importorskip("mlir")
    from kbuild.kernels.activations.kernels import activation

    from .test_dsl_math_prims_cpu import _compile

    g = torch.cat([torch.linspace(-12, 12, 40001), torch.tensor([-90.0, -30.0, 30.0, 90.0])])
    gd = g.double().requires_grad_()
    if kind == "silu":
        ref = F.silu(gd)
    elif kind == "gelu_tanh":  # GPT-2's function without fp64's 1 + tanh cancelling
        ref = gd * torch.sigmoid(2 * 0.7978845608028654 * (gd + 0.044715 * gd**3))
    else:
        ref = F.gelu(gd)
    (slope,) = torch.autograd.grad(ref.sum(), gd)
    for i, want in ((0, ref.detach()), (1, slope)):
        f = _compile(lambda a, i=i: activation(kind, a, grad=True)[i])
        got = torch.from_numpy(f(g.numpy())).double()
        # per element: a few ulps of the value, or of the terms that make it near a zero
        bound = 8 * 2.0**-24 * (want.abs() + g.double().abs() * 0.5 + 1e-30)
        assert ((got - want).abs() <= bound).all(), (kind, i, (got - want).abs().max())


# ----------------------------------------------------------------------------- kernels

K = act.kernels
KERNELS = {
    "swiglu": (K.build_swiglu_fwd, K.build_swiglu_bwd),
    "swiglu_fused": (K.build_swiglu_fused_fwd, K.build_swiglu_fused_bwd),
    "swiglu_strided": (K.build_swiglu_strided_fwd, K.build_swiglu_strided_bwd),
    "geglu": (K.build_geglu_fwd, K.build_geglu_bwd),
    "geglu_fused": (K.build_geglu_fused_fwd, K.build_geglu_fused_bwd),
    "geglu_strided": (K.build_geglu_strided_fwd, K.build_geglu_strided_bwd),
    "gelu": (K.build_gelu_fwd, K.build_gelu_bwd),
}


def _spec(kernel, N, dtype, tanh=True):
    extra = {"tanh": tanh} if "tanh" in [p.name for p in kernel.params] else {}
    return kernel.spec(N=N, dtype=dtype, **extra)


def _ptx(spec):
    from kbuild.compiler import build
    from kbuild.targets import target_for_arch
    from kbuild.targets.nvidia import module_to_ptx

    sm90 = target_for_arch("sm_90")
    return module_to_ptx(build(spec, sm90).module, sm90).decode()


@pytest.mark.parametrize("family", list(KERNELS))
@pytest.mark.parametrize("N,dtype", [(14336, "bf16"), (3072, "f16"), (1000, "f32"),
                                     (4097, "bf16")])  # fmt: skip
def test_kernels_build_for_sm90_with_16_byte_accesses(family, N, dtype):
    """Every kernel builds to PTX; a row of whole 16-byte vectors moves as ld/st.global.v4 in
    every layout, and so does the body of a peeled 4097-wide dense row; the fused and strided
    rows of 4097 go element by element (their rows start at other phases than y's). A wide
    forward streams one vector of each input a pass (HELD_BLOCK_MAX): GELU's then has one."""
    for kernel in KERNELS[family]:
        ptx = _ptx(_spec(kernel, N, dtype))
        loads = len(re.findall(r"ld\.global(\.\w+)*\.v4\.", ptx))
        stores = len(re.findall(r"st\.global(\.\w+)*\.v4\.", ptx))
        dense = not ("fused" in family or "strided" in family)
        if N % 8 == 0 or dense:
            inputs = 1 if family == "gelu" else 2
            assert loads >= inputs and stores >= 1, (kernel.name, loads, stores)
        if N == 4097:  # the partial vectors, element by element
            assert re.search(r"ld\.global(\.\w+)*\.(b16|u16)", ptx), kernel.name
        if N % 8 == 0:
            assert not re.search(r"ld\.global(\.\w+)*\.(b16|u16)\s", ptx), kernel.name


def test_wide_forwards_stream_in_small_blocks():
    """A forward whose held row would take a block of over HELD_BLOCK_MAX threads of several
    vectors each (one block an SM at Llama's 14336) walks it in blocks of STREAM_THREADS, one
    vector a pass; narrower rows, and the backwards, keep their plans. Catches the rule
    dropped or applied to every width."""
    from kbuild.targets import target_for_arch

    def threads(family, N, backward=False):
        ptx = _ptx(_spec(KERNELS[family][int(backward)], N, "bf16"))
        return int(re.search(r"\.maxntid (\d+)", ptx).group(1))

    assert threads("swiglu", 14336) == threads("gelu", 16384) == K.STREAM_THREADS
    assert threads("swiglu", 4096) == 128 and threads("gelu", 3072) == 96  # held, as before
    assert threads("swiglu", 14336, backward=True) == 512  # the backward's own plan
    sm90 = target_for_arch("sm_90")
    assert K.streams(14336, "bf16", sm90, True, 2) and not K.streams(8192, "bf16", sm90, True, 2)
    assert not K.streams(14336, "bf16", sm90, False, 2)  # element by element: held


@pytest.mark.parametrize("family", list(KERNELS))
def test_kernels_lower_for_amd(family):
    pytest.importorskip("llvmlite")
    from kbuild import compiler
    from kbuild.targets import target_for_arch

    gfx = target_for_arch("gfx942")
    for kernel in KERNELS[family]:
        for N, dtype in ((14336, "bf16"), (4097, "f32")):
            assert compiler.lower(_spec(kernel, N, dtype, tanh=False), gfx)


def test_warmup_covers_the_gpu_cases_and_the_models():
    """Every kernel tests/test_activations_gpu.py launches is in warmup_specs() (the GPU
    machine runs offline from a cache warmed with `kbuild warmup --module
    kbuild.kernels.activations.op`), by the values the ops' own launches compute; and each model
    width's kernels in the three dtypes."""
    from . import test_activations_gpu as gpu

    warm = set(act.warmup_specs())
    for family, N, dtype, tanh in gpu.GATED_CASES:
        for spec in act.gated_specs(family, N, dtype, tanh):
            assert spec in warm, spec
    for N, dtype, tanh in gpu.GELU_CASES:
        x = torch.empty(1, N, dtype=dtype, device="meta")
        for k, values in act.GELU.kernel_values(x, tanh) + act.GELU.backward.kernel_values(
            x, x, tanh
        ):
            assert k.spec(*values) in warm
    N, dtype = cases.ACTIVATION_MISALIGNED
    x = torch.empty(1, N, dtype=dtype, device="meta")
    dense = act.SWIGLU[0]
    both = dense.kernel_values(x, x, aligned=False) + dense.backward.kernel_values(
        x, x, x, aligned=False
    )
    assert all(k.spec(*v) in warm for k, v in both)
    names = {(s.kernel, s.kwargs["N"], s.kwargs["dtype"]) for s in warm}
    for family, N in cases.ACTIVATION_MODELS:
        for dtype in ("bf16", "f16", "f32"):
            assert (f"{family}_fwd", N, dtype) in names and (f"{family}_bwd", N, dtype) in names


def test_gelu_default_is_torchs():
    """kbuild.gelu(x) is F.gelu(x): the erf form by default, tanh on request."""
    x = _randn((4, 64), torch.float32, 3)
    assert torch.allclose(act.gelu(x), F.gelu(x), atol=1e-6)
    assert not torch.allclose(act.gelu(x), F.gelu(x, approximate="tanh"), atol=1e-6)
