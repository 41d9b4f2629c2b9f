"""kbuild.kernels.rope.op on CPU (the op's reference, which is the kernel's contract) against an
fp64 reference written here from HF's formulas (rotate_half, GPT-J's rotate_every_two): values and
gradients for both layouts, partial rotary, GQA, transposed and fused-qkv views, per-batch
and shared cos / sin; the checks' errors; a model of the kernel's thread cover; the vector
width the launch picks for views read in place; the kernels built for sm_90 and gfx942; the
GPU cases' kernels warmable."""

from __future__ import annotations

import re

import pytest
import torch

from kbuild import cases
from kbuild.kernels.rope import op as rope_ops
from kbuild.kernels.rope.op import rope

from .graph_recorder import KbuildGraphs

# ----------------------------------------------------------------------------- fp64 reference


def _rotate_half(x):  # HF's
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_every_two(x):  # HF's GPT-J
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _fp64(q, k, cos, sin, interleaved=False, unsqueeze_dim=1):
    """HF's apply_rotary_pos_emb in fp64 with partial rotary (Phi's split), cos / sin of
    (T, rd) or (1, T, rd) expanded over the batch first."""
    B = q.shape[0]
    cos, sin = (t.double().expand(B, *t.shape[-2:]) for t in (cos, sin))
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rd = cos.shape[-1]
    rotate = _rotate_every_two if interleaved else _rotate_half

    def one(x):
        x = x.double()
        r, p = x[..., :rd], x[..., rd:]
        return torch.cat((r * cos + rotate(r) * sin, p), -1)

    return one(q), one(k)


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _hf_trig(B, T, rd, interleaved, dtype, shared=None, seed=0):
    """HF-style cos / sin: angles of positions (offset per batch) times frequencies."""
    g = torch.Generator().manual_seed(seed)
    freqs = 1.0 / (10000.0 ** (torch.arange(0, rd, 2).double() / rd))
    pos = torch.arange(T).double() + torch.randint(0, 50, (B, 1), generator=g).double()
    angles = pos[..., None] * freqs
    emb = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    if shared == "T":
        return cos[0], sin[0]
    if shared == "1T":
        return cos[:1], sin[:1]
    return cos, sin


def _qk(B, T, Hq, Hk, D, dtype, dim, view, seed=0):
    """q, k in the layout of unsqueeze_dim `dim`: dense, transposed views of (B, T, H, D), or
    views of one fused (B, T, (Hq + 2 Hk) D) qkv projection."""
    g = torch.Generator().manual_seed(seed)
    if view == "fused":
        qkv = (torch.randn(B, T, (Hq + 2 * Hk) * D, generator=g) * 2).to(dtype)
        q, k, _ = qkv.split([Hq * D, Hk * D, Hk * D], -1)
        q, k = q.view(B, T, Hq, D), k.view(B, T, Hk, D)
    else:
        q = (torch.randn(B, T, Hq, D, generator=g) * 2).to(dtype)
        k = (torch.randn(B, T, Hk, D, generator=g) * 2).to(dtype)
    if dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if view == "dense":
            q, k = q.contiguous(), k.contiguous()
    return q, k


def _close(got, ref, dtype, scale=None):
    tol = TOL[dtype]
    scale = ref.abs().max().clamp_min(1.0) if scale is None else scale
    assert (got.double() - ref).abs().max() <= tol * scale, (got.double() - ref).abs().max()


# ----------------------------------------------------------------------------- values, grads

CASES = [
    # (B, T, Hq, Hk, D, rd)
    (2, 5, 4, 2, 16, 16),  # GQA, full rotary
    (2, 5, 3, 3, 24, 8),  # partial rotary (NeoX-style)
    (1, 7, 2, 1, 10, 6),  # odd halves (rd / 2 = 3), D - rd = 4
]


@pytest.mark.parametrize("B,T,Hq,Hk,D,rd", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("view", ["dense", "transposed", "fused"])
def test_values_and_gradients_match_fp64(B, T, Hq, Hk, D, rd, dtype, interleaved, dim, view):
    q, k = _qk(B, T, Hq, Hk, D, dtype, dim, view)
    cos, sin = _hf_trig(B, T, rd, interleaved, dtype)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    qo, ko = rope(q, k, cos, sin, interleaved=interleaved, unsqueeze_dim=dim)
    rq, rk = _fp64(q.detach(), k.detach(), cos, sin, interleaved, dim)
    assert qo.shape == q.shape and ko.shape == k.shape
    assert qo.dtype == ko.dtype == dtype and qo.is_contiguous() and ko.is_contiguous()
    _close(qo, rq, dtype)
    _close(ko, rk, dtype)
    # the pass-through features are copied exactly
    assert torch.equal(qo[..., rd:], q.detach()[..., rd:])
    g = torch.Generator().manual_seed(1)
    dq_out, dk_out = (torch.randn(t.shape, generator=g).to(dtype) for t in (qo, ko))
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (dq_out, dk_out))
    qd, kd = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    rq, rk = _fp64(qd, kd, cos, sin, interleaved, dim)
    rdq, rdk = torch.autograd.grad((rq, rk), (qd, kd), (dq_out.double(), dk_out.double()))
    assert dq.dtype == dk.dtype == dtype
    _close(dq, rdq, dtype)
    _close(dk, rdk, dtype)


@pytest.mark.parametrize("shared", ["T", "1T"])
@pytest.mark.parametrize("cs_dtype", [torch.float32, torch.bfloat16])
def test_cos_sin_shared_by_the_batch_and_of_another_dtype(shared, cs_dtype):
    q, k = _qk(3, 6, 4, 2, 32, torch.bfloat16, 1, "transposed")
    cos, sin = _hf_trig(3, 6, 32, False, cs_dtype, shared=shared)
    qo, ko = rope(q, k, cos, sin)
    rq, rk = _fp64(q, k, cos, sin)
    _close(qo, rq, torch.bfloat16)
    _close(ko, rk, torch.bfloat16)


def test_backward_is_the_rotation_by_minus_theta():
    """For HF's cos / sin the backward is the inverse rotation: rope of dy by (cos, -sin)."""
    q, k = _qk(2, 5, 2, 2, 16, torch.float32, 1, "dense")
    cos, sin = _hf_trig(2, 5, 16, False, torch.float32)
    dq_out, dk_out = torch.randn(q.shape), torch.randn(k.shape)
    dq, dk = torch.ops.kbuild.rope_backward(dq_out, dk_out, cos, sin, True, True, False, 1)
    back_q, back_k = rope(dq_out, dk_out, cos, -sin)
    assert torch.allclose(dq, back_q, atol=1e-6) and torch.allclose(dk, back_k, atol=1e-6)
    q2, k2 = rope(*rope(q, k, cos, sin), cos, -sin)  # and it undoes the forward
    assert torch.allclose(q2, q, atol=1e-5) and torch.allclose(k2, k, atol=1e-5)


def test_only_the_gradients_wanted_are_computed():
    q, k = _qk(2, 5, 2, 1, 8, torch.float32, 1, "dense")
    cos, sin = _hf_trig(2, 5, 8, False, torch.float32)
    q.requires_grad_()
    qo, ko = rope(q, k, cos, sin)
    (qo.sum() + ko.sum()).backward()
    assert q.grad is not None and k.grad is None
    dq, dk = torch.ops.kbuild.rope_backward(qo, ko, cos, sin, True, False, False, 1)
    assert dq.shape == q.shape and dk.numel() == 0
    # k_out unused: its gradient is zeros, and q's is still right
    q2 = q.detach().requires_grad_()
    qo, _ = rope(q2, k, cos, sin)
    qo.square().sum().backward()
    qd = q.detach().double().requires_grad_()
    _fp64(qd, k, cos, sin)[0].square().sum().backward()
    assert torch.allclose(q2.grad.double(), qd.grad, atol=1e-5)


def test_cos_and_sin_get_no_gradient():
    q, k = _qk(1, 4, 2, 2, 8, torch.float32, 1, "dense")
    cos, sin = _hf_trig(1, 4, 8, False, torch.float32)
    cos.requires_grad_()
    sin.requires_grad_()
    q.requires_grad_()
    qo, ko = rope(q, k, cos, sin)
    (qo.sum() + ko.sum()).backward()
    assert q.grad is not None and cos.grad is None and sin.grad is None


def test_inputs_are_left_alone_and_outputs_are_new():
    q, k = _qk(2, 4, 3, 1, 16, torch.bfloat16, 1, "fused")
    before = (q.clone(), k.clone())
    cos, sin = _hf_trig(2, 4, 16, False, torch.bfloat16)
    qo, ko = rope(q, k, cos, sin)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])
    taken = {t.untyped_storage().data_ptr() for t in (q, k, cos, sin)}
    assert qo.untyped_storage().data_ptr() not in taken
    assert ko.untyped_storage().data_ptr() not in taken


def test_empty_batch():
    q, k = torch.empty(0, 2, 3, 8), torch.empty(0, 1, 3, 8)
    cos, sin = torch.empty(0, 3, 8), torch.empty(0, 3, 8)
    qo, ko = rope(q, k, cos, sin)
    assert qo.shape == q.shape and ko.shape == k.shape


def test_compiled_with_the_op_in_the_graph():
    torch._dynamo.reset()
    graphs = KbuildGraphs()
    backend = graphs.backend
    q, k = _qk(2, 5, 2, 1, 16, torch.float32, 1, "transposed")
    cos, sin = _hf_trig(2, 5, 16, False, torch.float32)
    q.requires_grad_()
    f = torch.compile(lambda q, k: rope(q, k, cos, sin), backend=backend, fullgraph=True)
    qo, ko = f(q, k)
    (qo.sum() + ko.square().sum()).backward()
    rq, rk = rope(q.detach(), k, cos, sin)
    assert torch.allclose(qo, rq) and torch.allclose(ko, rk)
    assert any("rope" in n and "backward" not in n for n in graphs.all), graphs.all
    assert any("rope_backward" in n for n in graphs.all), graphs.all
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- errors


def _call(**changes):
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    args = dict(q=q, k=k, cos=cos, sin=sin)
    args.update(changes)
    return rope(**args)


@pytest.mark.parametrize(
    "changes,error,message",
    [
        (dict(q="q"), TypeError, "q must be a torch.Tensor"),
        (dict(k=None), TypeError, "k must be a torch.Tensor"),
        (dict(cos=[1.0]), TypeError, "cos must be a torch.Tensor"),
        (dict(q=torch.ones(2, 4, 5, 8, dtype=torch.int64)), TypeError, "q must be torch.float32"),
        (dict(k=torch.randn(2, 2, 5, 8).half()), TypeError, r"k must have q's dtype"),
        (dict(sin=torch.randn(2, 5, 8).half()), TypeError, r"sin must have cos's dtype"),
        (dict(q=torch.randn(2, 4, 5)), ValueError, r"q must be 4-D \(B, H, T, D\)"),
        (dict(k=torch.randn(2, 2, 5, 8, 1)), ValueError, "k must be 4-D"),
        (dict(k=torch.randn(2, 2, 6, 8)), ValueError, "k must be .* with q's B = 2, T = 5"),
        (dict(k=torch.randn(3, 2, 5, 8)), ValueError, "k must be"),
        (dict(k=torch.randn(2, 2, 5, 4)), ValueError, "D = 8"),
        (dict(cos=torch.randn(2, 6, 8), sin=torch.randn(2, 6, 8)), ValueError,
         r"cos must be \(B, T, rd\)"),
        (dict(cos=torch.randn(3, 5, 8), sin=torch.randn(3, 5, 8)), ValueError, "cos must be"),
        (dict(cos=torch.randn(8), sin=torch.randn(8)), ValueError, "cos must be"),
        (dict(sin=torch.randn(2, 5, 6)), ValueError, "sin must have cos's shape"),
        (dict(cos=torch.randn(2, 5, 7), sin=torch.randn(2, 5, 7)), ValueError,
         r"rotary dim rd\) must be even"),
        (dict(cos=torch.randn(2, 5, 10), sin=torch.randn(2, 5, 10)), ValueError,
         r"rd = 10\) must be at most q's head dim D = 8"),
        (dict(unsqueeze_dim=3), ValueError, "unsqueeze_dim must be 1"),
        (dict(unsqueeze_dim=-1), ValueError, "unsqueeze_dim must be 1"),
        (dict(unsqueeze_dim=True), TypeError, "unsqueeze_dim must be an int"),
        (dict(interleaved=1), TypeError, "interleaved must be a bool"),
    ],
)  # fmt: skip
def test_checks_name_the_argument(changes, error, message):
    with pytest.raises(error, match=message):
        _call(**changes)


def test_unsqueeze_dim_two_reads_b_t_h_d():
    with pytest.raises(ValueError, match=r"4-D \(B, T, H, D\)"):
        _call(q=torch.randn(2, 5, 4), unsqueeze_dim=2)
    q, k = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    qo, ko = _call(q=q, k=k, unsqueeze_dim=2)
    assert qo.shape == q.shape and ko.shape == k.shape


# ----------------------------------------------------------------------------- the kernel's cover


def _model(q, k, cos, sin, interleaved, dim, inverse, vec):
    """The kernel's loops in Python (kernels/rope/kernels.py, HeadLayout): per position, thread tid
    takes unit tid % U of heads tid // U + i * heads_per_pass; each output element must be
    written exactly once."""
    from kbuild.kernels.rope.kernels import head_layout

    D, rd = q.shape[-1], cos.shape[-1]
    lay = head_layout(D, rd, "bf16", "f32", interleaved, vec)
    w, half = lay.width, rd // 2
    xs = [x if dim == 1 else x.transpose(1, 2) for x in (q, k)]  # (B, H, T, D)
    outs = [torch.full_like(x, float("nan"), dtype=torch.float64) for x in xs]
    writes = [torch.zeros_like(o) for o in outs]
    B, Hq, T, _ = xs[0].shape
    heads = Hq + xs[1].shape[1]
    c, s = (t.double().expand(B, T, rd) for t in (cos, sin))
    for b in range(B):
        for t in range(T):
            for tid in range(lay.block(32)):
                unit, slot = tid % lay.units, tid // lay.units
                h = slot if tid < lay.used else heads
                while h < heads:
                    side, j = (0, h) if h < Hq else (1, h - Hq)
                    x, o, n = xs[side][b, j, t].double(), outs[side][b, j, t], writes[side][b, j, t]
                    if unit < lay.rotating:
                        col = unit * w
                        if interleaved:
                            for e in range(col, col + w, 2):
                                ce, co, se, so = (
                                    c[b, t, e],
                                    c[b, t, e + 1],
                                    s[b, t, e],
                                    s[b, t, e + 1],
                                )
                                me, mo = (so, -se) if inverse else (-se, so)
                                o[e], o[e + 1] = (
                                    ce * x[e] + me * x[e + 1],
                                    co * x[e + 1] + mo * x[e],
                                )
                                n[e : e + 2] += 1
                        else:
                            for a in range(col, col + w):
                                bb = a + half
                                ma = s[b, t, bb] if inverse else -s[b, t, a]
                                mb = -s[b, t, a] if inverse else s[b, t, bb]
                                o[a] = c[b, t, a] * x[a] + ma * x[bb]
                                o[bb] = c[b, t, bb] * x[bb] + mb * x[a]
                                n[a] += 1
                                n[bb] += 1
                    else:
                        col = rd + (unit - lay.rotating) * vec
                        o[col : col + vec] = x[col : col + vec]
                        n[col : col + vec] += 1
                    h += lay.heads_per_pass
    for n in writes:
        assert torch.equal(n, torch.ones_like(n)), "every element written exactly once"
    return [o if dim == 1 else o.transpose(1, 2) for o in outs]


@pytest.mark.parametrize(
    "B,T,Hq,Hk,D,rd,interleaved,vec",
    [
        (1, 2, 32, 8, 128, 128, False, 8),  # Llama: 8 units, 16 heads a pass
        (1, 2, 3, 1, 128, 32, False, 4),  # partial: passing units beside rotating ones
        (1, 2, 3, 2, 96, 96, True, 8),  # Phi-3's D, pairs
        (2, 3, 2, 1, 10, 6, True, 1),  # pairs read two elements at a time from vec 1
        (2, 3, 2, 1, 10, 6, False, 1),
        (1, 1, 1, 1, 1024, 512, False, 1),  # a head wider than the block's aim
    ],
)
@pytest.mark.parametrize("inverse", [False, True])
def test_kernel_model_covers_every_element_once_and_matches(
    B, T, Hq, Hk, D, rd, interleaved, vec, inverse
):
    q, k = _qk(B, T, Hq, Hk, D, torch.float32, 1, "dense")
    cos, sin = _hf_trig(B, T, rd, interleaved, torch.float32)
    sin = sin + 0.01 * torch.randn(sin.shape)  # halves that differ: the transpose shows
    got = _model(q, k, cos, sin, interleaved, 1, inverse, vec)
    if inverse:
        want = rope_ops.rope_backward_reference(q, k, cos, sin, True, True, interleaved, 1)
    else:
        want = rope_ops.rope_reference(q, k, cos, sin, interleaved, 1)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w.double(), atol=1e-5)


def test_head_layout_refuses_what_does_not_fit():
    from kbuild.kernels.rope.kernels import head_layout

    with pytest.raises(ValueError, match="rd must be even"):
        head_layout(8, 5, "f32", "f32", False, 1)
    with pytest.raises(ValueError, match="vec must be a power of two <= 4"):
        head_layout(8, 8, "f32", "f32", False, 8)
    with pytest.raises(ValueError, match="vec 4 must divide 3"):
        head_layout(8, 6, "bf16", "bf16", False, 4)
    with pytest.raises(ValueError, match="at most 1024"):
        head_layout(4096, 2048, "f32", "f32", False, 1)


# ----------------------------------------------------------------------------- views in place


def test_fused_qkv_views_are_read_in_place_at_full_width():
    """q and k as views of a fused qkv projection (strides (T S, D, S, 1)): no copy, and the
    launch reads them 16 bytes at a time."""
    from kbuild.cases import ROPE_GPU_CASES as GPU_CASES
    from kbuild.kernels.rope.op import case_tensors, specs_for

    case = (2, 17, 32, 8, 128, 128, torch.bfloat16, torch.bfloat16, False, 1, True)
    assert case in GPU_CASES
    q, k, cos, sin = case_tensors(case, "meta")
    assert not q.is_contiguous() and q.stride() == (17 * 48 * 128, 128, 48 * 128, 1)
    assert rope_ops.readable(q) is q and rope_ops.readable(k) is k
    fwd, bwd = specs_for(q, k, cos, sin)
    assert fwd.kwargs["vec"] == 8 and bwd.kwargs["vec"] == 8 and bwd.kwargs["inverse"]


def test_vector_width_follows_strides_and_addresses():
    q = torch.empty(2, 4, 5, 128, dtype=torch.bfloat16, device="meta")
    spans = dict(dtype=torch.bfloat16, D=128, rd=128, interleaved=False)
    assert rope_ops.vector_width(**spans, strides=[2560, 640, 128], tensors=[q]) == 8
    odd = torch.empty(1000, dtype=torch.bfloat16, device="meta")[1:]  # one element in
    assert rope_ops.vector_width(**spans, strides=[2560], tensors=[odd]) == 1
    assert rope_ops.vector_width(**spans, strides=[2560, 132], tensors=[q]) == 4
    partial = dict(dtype=torch.float32, D=10, rd=6, interleaved=False)  # rd / 2 = 3
    assert rope_ops.vector_width(**partial, strides=[8], tensors=[q]) == 1
    pairs = dict(dtype=torch.float32, D=10, rd=6, interleaved=True)
    assert rope_ops.vector_width(**pairs, strides=[10], tensors=[q]) == 2
    # a last dimension that is not dense is copied; a dense one is not
    x = torch.randn(2, 3, 4, 8)
    view = x.transpose(1, 2)
    assert rope_ops.readable(view) is view
    assert rope_ops.readable(x.transpose(2, 3)).is_contiguous()


# ----------------------------------------------------------------------------- kernels


def _ptx(spec):
    from kbuild.compiler import build
    from kbuild.targets import target_for_arch
    from kbuild.targets.nvidia import module_to_ptx

    sm90 = target_for_arch("sm_90")
    return module_to_ptx(build(spec, sm90).module, sm90).decode()


def _spec(**kw):
    from kbuild.kernels.rope.kernels import build_rope

    return build_rope.spec(**kw)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
def test_kernel_ptx_reads_and_writes_16_bytes(interleaved, inverse):
    spec = _spec(D=128, rd=128, dtype="bf16", cs_dtype="f32", interleaved=interleaved,
                 inverse=inverse, vec=8)  # fmt: skip
    ptx = _ptx(spec)
    assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx)
    assert re.search(r"st\.global(\.\w+)*\.v4\.b32", ptx)
    assert not re.search(r"(atom|red)\.global", ptx)
    assert ".maxntid 128, 1, 1" in ptx


def test_kernel_ptx_of_odd_spans_is_scalar():
    ptx = _ptx(_spec(D=10, rd=6, dtype="f32", cs_dtype="f32", interleaved=True, vec=1))
    assert not re.search(r"\.v[24]\.", ptx)
    assert re.search(r"ld\.global\.b32", ptx)


def test_kernels_lower_for_amd():
    from kbuild import compiler
    from kbuild.targets import target_for_arch

    gfx = target_for_arch("gfx942")
    for kw in (dict(D=128, rd=128, dtype="bf16", cs_dtype="bf16", vec=8),
               dict(D=128, rd=32, dtype="f16", cs_dtype="f32", interleaved=True, inverse=True,
                    vec=8),
               dict(D=10, rd=6, dtype="f32", cs_dtype="f32", vec=1)):  # fmt: skip
        assert compiler.lower(_spec(**kw), gfx)


def test_warm_kernels_build_for_sm_90():
    """Every kernel warmup_specs() lists builds and verifies (the models' and the GPU
    tests'): Llama-3-8B, Qwen3-8B, Gemma-2-2B, Phi-3-mini, Phi-2, a NeoX-style partial."""
    from kbuild.compiler import build
    from kbuild.targets import target_for_arch

    sm90 = target_for_arch("sm_90")
    specs = rope_ops.warmup_specs()
    for _, _, _, D, rd in cases.ROPE_MODELS:
        for dtype in ("bf16", "f16", "f32"):
            assert any(s.kwargs["D"] == D and s.kwargs["rd"] == rd and s.kwargs["dtype"] == dtype
                       for s in specs), (D, rd, dtype)  # fmt: skip
    for spec in specs:
        build(spec, sm90)


def test_gpu_cases_are_warmable():
    """Every kernel tests/test_rope_gpu.py launches is in warmup_specs() (the GPU machine runs
    offline from a cache warmed with `kbuild warmup --module kbuild.kernels.rope.op`)."""
    from . import test_rope_gpu as gpu

    warm = set(rope_ops.warmup_specs())
    for case in gpu.CASES:
        for spec in rope_ops.specs_for(*rope_ops.case_tensors(case, "meta"), case[8], case[9]):
            assert spec in warm, spec.short()
    # the misaligned q (one element into its storage) and the tables shared by the batch
    case = (2, 5, 4, 2, *cases.ROPE_MISALIGNED, 1, False)
    _, k, cos, sin = rope_ops.case_tensors(case, "meta")
    base = torch.empty(2 * 4 * 5 * 64 + 1, dtype=torch.bfloat16, device="meta")
    q = base[1:].view(2, 4, 5, 64)
    specs = rope_ops.specs_for(q, k, cos, sin)
    assert specs[0].kwargs["vec"] == 1 and set(specs) <= warm
    case = (3, 9, 4, 2, 64, 64, torch.bfloat16, torch.float32, False, 1, True)
    q, k, cos, sin = rope_ops.case_tensors(case, "meta")
    for shared in ((1,), ()):
        tables = (t[0].reshape(*shared, 9, 64) for t in (cos, sin))
        assert set(rope_ops.specs_for(q, k, *tables)) <= warm
