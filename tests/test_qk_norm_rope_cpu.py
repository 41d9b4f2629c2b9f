"""kbuild.kernels.rope.qk_norm on CPU (the op's reference, which is the kernels' contract) against
an fp64 reference written here from HF's formulas (Qwen3RMSNorm / Gemma3RMSNorm, then
rotate_half or GPT-J's rotate_every_two): values and the four gradients for both layouts,
GQA, transposed and fused-qkv views, Gemma's offset; the checks' errors; a model of the
kernels' thread cover and of the weight gradients' fixed-order reduction, run on the strides
the launches pass; the kernels built for sm_90 (no atomics in the backward) and gfx942; the
GPU cases' kernels warmable."""

from __future__ import annotations

import re

import pytest
import torch

from kbuild import cases
from kbuild.kernels.rope import qk_norm as ops
from kbuild.kernels.rope.qk_norm import qk_norm_rope

from .graph_recorder import KbuildGraphs

# HF's rotate_half and GPT-J's rotate_every_two, and HF-style cos / sin of per-batch positions
from .test_rope_cpu import _hf_trig as _trig
from .test_rope_cpu import _rotate_every_two, _rotate_half

# ----------------------------------------------------------------------------- fp64 reference


def _hf_norm(x, w, eps, offset):
    """Qwen3RMSNorm (offset 0: w * x_hat) and Gemma3RMSNorm (offset 1: x_hat * (1 + w))."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(variance + eps) * (offset + w)


def _fp64(q, k, qw, kw, cos, sin, eps=1e-6, offset=0.0, interleaved=False, dim=1):
    """q_norm / k_norm then apply_rotary_pos_emb, in fp64 (cos / sin expanded over B)."""
    B = q.shape[0]
    cos, sin = (t.double().expand(B, *t.shape[-2:]).unsqueeze(dim) for t in (cos, sin))
    rotate = _rotate_every_two if interleaved else _rotate_half

    def one(x, w):
        n = _hf_norm(x.double(), w.double(), eps, offset)
        return n * cos + rotate(n) * sin

    return one(q, qw), one(k, kw)


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _qk(B, T, Hq, Hk, D, dtype, dim, view, seed=0):
    """q, k in the layout of unsqueeze_dim `dim`: dense, transposed views of (B, T, H, D), or
    views of one fused (B, T, (Hq + 2 Hk) D) qkv projection; with a mean per head so the norm
    matters."""
    g = torch.Generator().manual_seed(seed)
    if view == "fused":
        qkv = (torch.randn(B, T, (Hq + 2 * Hk) * D, generator=g) * 3 + 0.5).to(dtype)
        q, k, _ = qkv.split([Hq * D, Hk * D, Hk * D], -1)
        q, k = q.view(B, T, Hq, D), k.view(B, T, Hk, D)
    else:
        q = (torch.randn(B, T, Hq, D, generator=g) * 3 + 0.5).to(dtype)
        k = (torch.randn(B, T, Hk, D, generator=g) * 3 + 0.5).to(dtype)
    if dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if view == "dense":
            q, k = q.contiguous(), k.contiguous()
    return q, k


def _weights(D, dtype, offset, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [(1.0 - offset + 0.2 * torch.randn(D, generator=g)).to(dtype) for _ in range(2)]


def _close(got, ref, dtype, scale=None):
    tol = TOL[dtype]
    scale = ref.abs().max().clamp_min(1.0) if scale is None else scale
    err = (got.double() - ref).abs().max()
    assert err <= tol * scale, (err, tol * scale)


# ----------------------------------------------------------------------------- values, grads

CASES = [(2, 5, 4, 2, 16), (1, 3, 2, 1, 64), (1, 2, 3, 1, 256), (1, 3, 2, 2, 10)]  # B T Hq Hk D


def _check_all(q, k, qw, kw, cos, sin, offset, interleaved, dim, dtype, w_tol=None):
    q, k, qw, kw = (t.detach().requires_grad_() for t in (q, k, qw, kw))
    qo, ko = qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6, offset, interleaved, dim)
    assert qo.shape == q.shape and ko.shape == k.shape
    assert qo.dtype == ko.dtype == dtype and qo.is_contiguous() and ko.is_contiguous()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, qw, kw)]
    rq, rk = _fp64(*leaves, cos, sin, 1e-6, offset, interleaved, dim)
    _close(qo, rq, dtype)
    _close(ko, rk, dtype)
    g = torch.Generator().manual_seed(1)
    dq_out, dk_out = (torch.randn(t.shape, generator=g).to(dtype) for t in (qo, ko))
    grads = torch.autograd.grad((qo, ko), (q, k, qw, kw), (dq_out, dk_out))
    refs = torch.autograd.grad((rq, rk), leaves, (dq_out.double(), dk_out.double()))
    for got, ref, leaf in zip(grads, refs, (q, k, qw, kw), strict=True):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        # a weight's gradient is a sum over B * H * T heads: its scale is the sum's
        _close(got, ref, w_tol or dtype)


@pytest.mark.parametrize("B,T,Hq,Hk,D", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("view", ["dense", "transposed", "fused"])
def test_values_and_gradients_match_fp64(B, T, Hq, Hk, D, dtype, interleaved, dim, view):
    q, k = _qk(B, T, Hq, Hk, D, dtype, dim, view)
    cos, sin = _trig(B, T, D, interleaved, dtype)
    qw, kw = _weights(D, dtype, 0.0)
    _check_all(q, k, qw, kw, cos, sin, 0.0, interleaved, dim, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", [None, torch.float32])
@pytest.mark.parametrize("shared", [None, "T", "1T"])
def test_gemma_offset_fp32_weights_and_tables_shared_by_the_batch(dtype, w_dtype, shared):
    """offset=1.0 (Gemma 3's x_hat * (1 + w), the weight stored around 0), weights of fp32
    beside 16-bit q, cos / sin in fp32 and shared by the batch."""
    q, k = _qk(3, 4, 8, 4, 32, dtype, 1, "fused")
    cos, sin = _trig(3, 4, 32, False, torch.float32, shared)
    qw, kw = _weights(32, w_dtype or dtype, 1.0)
    _check_all(q, k, qw, kw, cos, sin, 1.0, False, 1, dtype)


def test_fp32_math_rounded_once_not_hf_rounding():
    """kbuild's contract: fp32 math, one rounding. HF's Qwen3RMSNorm rounds x_hat to bf16
    before the weight and apply_rotary_pos_emb rounds again: both agree with fp64 to bf16's
    tolerance; the reference is the nearer of the two (over many values)."""
    q, k = _qk(2, 16, 8, 2, 128, torch.bfloat16, 1, "transposed")
    cos, sin = _trig(2, 16, 128, False, torch.bfloat16)
    qw, kw = _weights(128, torch.bfloat16, 0.0)
    qo, _ = qk_norm_rope(q, k, qw, kw, cos, sin)
    x = q.float()
    x_hat = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    n = qw * x_hat  # bf16, as HF
    hf = n * cos.unsqueeze(1) + _rotate_half(n) * sin.unsqueeze(1)
    ref, _ = _fp64(q, k, qw, kw, cos, sin)
    ours_err = (qo.double() - ref).abs().mean()
    hf_err = (hf.double() - ref).abs().mean()
    assert ours_err < hf_err
    _close(hf, ref, torch.bfloat16)


def test_the_reference_is_rmsnorm_then_rope():
    """The op is kbuild.rmsnorm's math then kbuild.kernels.rope.op's, composed in fp32."""
    from kbuild.kernels.norms.rmsnorm import rmsnorm_reference
    from kbuild.kernels.rope.op import rope

    q, k = _qk(2, 5, 4, 2, 32, torch.float32, 1, "dense")
    cos, sin = _trig(2, 5, 32, True, torch.float32)
    qw, kw = _weights(32, torch.float32, 0.0)
    qo, ko = qk_norm_rope(q, k, qw, kw, cos, sin, interleaved=True)
    rq, rk = rope(rmsnorm_reference(q, qw, 1e-6)[0], rmsnorm_reference(k, kw, 1e-6)[0], cos,
                  sin, interleaved=True)  # fmt: skip
    assert torch.allclose(qo, rq, atol=1e-6) and torch.allclose(ko, rk, atol=1e-6)


def test_rstd_saved_only_for_a_gradient_and_only_gradients_wanted():
    q, k = _qk(2, 5, 2, 1, 16, torch.float32, 1, "dense")
    cos, sin = _trig(2, 5, 16, False, torch.float32)
    qw, kw = _weights(16, torch.float32, 0.0)
    out = ops.QK_NORM_ROPE(q, k, qw, kw, cos, sin, 1e-6, 0.0, False, 1, False)
    assert out[2].numel() == 0 and out[3].numel() == 0
    out = ops.QK_NORM_ROPE(q, k, qw, kw, cos, sin, 1e-6, 0.0, False, 1, True)
    assert out[2].shape == (2 * 2 * 5,) and out[3].shape == (2 * 5,)
    assert out[2].dtype == torch.float32
    rstd = torch.rsqrt(q.pow(2).mean(-1) + 1e-6).reshape(-1)
    assert torch.allclose(out[2], rstd)
    kw.requires_grad_()
    qo, ko = qk_norm_rope(q, k, qw, kw, cos, sin)
    (qo.sum() + ko.square().sum()).backward()
    assert kw.grad is not None and kw.grad.shape == (16,)
    grads = torch.ops.kbuild.qk_norm_rope_backward(qo, ko, q, k, qw, kw, cos, sin, out[2],
                                                   out[3], False, True, False, True)  # fmt: skip
    assert grads[0].numel() == 0 and grads[2].numel() == 0
    assert grads[1].shape == k.shape and grads[3].shape == (16,)


def test_cos_and_sin_get_no_gradient_and_inputs_are_left_alone():
    q, k = _qk(2, 4, 3, 1, 16, torch.bfloat16, 1, "fused")
    before = (q.clone(), k.clone())
    cos, sin = _trig(2, 4, 16, False, torch.float32)
    qw, kw = _weights(16, torch.bfloat16, 0.0)
    cos.requires_grad_()
    q.requires_grad_()
    qo, ko = qk_norm_rope(q, k, qw, kw, cos, sin)
    (qo.float().sum() + ko.float().sum()).backward()
    assert q.grad is not None and cos.grad is None
    assert torch.equal(q.detach(), before[0]) and torch.equal(k, before[1])
    taken = {t.untyped_storage().data_ptr() for t in (q, k, cos, sin)}
    assert qo.untyped_storage().data_ptr() not in taken


def test_empty_batch():
    q, k = torch.empty(0, 2, 3, 8), torch.empty(0, 1, 3, 8)
    cos, sin = torch.empty(0, 3, 8), torch.empty(0, 3, 8)
    qw, kw = torch.ones(8), torch.ones(8)
    qo, ko = qk_norm_rope(q, k, qw, kw, cos, sin)
    assert qo.shape == q.shape and ko.shape == k.shape


def test_compiled_with_the_op_in_the_graph():
    torch._dynamo.reset()
    graphs = KbuildGraphs()
    backend = graphs.backend
    q, k = _qk(2, 5, 2, 1, 16, torch.float32, 1, "transposed")
    cos, sin = _trig(2, 5, 16, False, torch.float32)
    qw, kw = _weights(16, torch.float32, 0.0)
    q.requires_grad_()
    qw.requires_grad_()
    f = torch.compile(lambda q, k, qw: qk_norm_rope(q, k, qw, kw, cos, sin), backend=backend,
                      fullgraph=True)  # fmt: skip
    qo, ko = f(q, k, qw)
    (qo.sum() + ko.square().sum()).backward()
    rq, rk = qk_norm_rope(q.detach(), k, qw.detach(), kw, cos, sin)
    assert torch.allclose(qo, rq) and torch.allclose(ko, rk)
    assert any("qk_norm_rope" in n and "backward" not in n for n in graphs.all), graphs.all
    assert any("qk_norm_rope_backward" in n for n in graphs.all), graphs.all
    assert q.grad is not None and qw.grad is not None
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- errors


def _call(**changes):
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    args = dict(q=q, k=k, q_weight=torch.ones(8), k_weight=torch.ones(8), cos=cos, sin=sin)
    args.update(changes)
    return qk_norm_rope(**args)


@pytest.mark.parametrize(
    "changes,error,message",
    [
        (dict(q="q"), TypeError, "q must be a torch.Tensor"),
        (dict(k=None), TypeError, "k must be a torch.Tensor"),
        (dict(q_weight=[1.0]), TypeError, "q_weight must be a torch.Tensor"),
        (dict(k_weight=None), TypeError, "k_weight must be a torch.Tensor"),
        (dict(q=torch.ones(2, 4, 5, 8, dtype=torch.int64)), TypeError, "q must be torch.float32"),
        (dict(k=torch.randn(2, 2, 5, 8).half()), TypeError, r"k must have q's dtype"),
        (dict(q_weight=torch.ones(8).half()), TypeError, r"q_weight must be of q's dtype"),
        (dict(k_weight=torch.ones(8, dtype=torch.float64)), TypeError, "k_weight must be of"),
        (dict(q=torch.randn(2, 4, 5, 8).bfloat16(), k=torch.randn(2, 2, 5, 8).bfloat16(),
              k_weight=torch.ones(8).bfloat16()), TypeError, "k_weight must have q_weight's"),
        (dict(q_weight=torch.ones(7)), ValueError, r"q_weight must be \(D,\) = \(8,\)"),
        (dict(k_weight=torch.ones(1, 8)), ValueError, r"k_weight must be \(D,\)"),
        (dict(q=torch.randn(2, 4, 5)), ValueError, r"q must be 4-D \(B, H, T, D\)"),
        (dict(k=torch.randn(2, 2, 6, 8)), ValueError, "k must be .* with q's B = 2, T = 5"),
        (dict(cos=torch.randn(2, 6, 8), sin=torch.randn(2, 6, 8)), ValueError,
         r"cos must be \(B, T, rd\)"),
        (dict(sin=torch.randn(2, 5, 6)), ValueError, "sin must have cos's shape"),
        (dict(cos=torch.randn(2, 5, 4), sin=torch.randn(2, 5, 4)), ValueError,
         r"rd = 4\) must be q's head dim D = 8: .*full rotary"),
        (dict(eps=-1.0), ValueError, "eps"),
        (dict(eps="1e-6"), TypeError, "eps"),
        (dict(offset=float("nan")), ValueError, "offset"),
        (dict(unsqueeze_dim=3), ValueError, "unsqueeze_dim must be 1"),
        (dict(interleaved=1), TypeError, "interleaved must be a bool"),
    ],
)  # fmt: skip
def test_checks_name_the_argument(changes, error, message):
    with pytest.raises(error, match=message):
        _call(**changes)


def test_a_head_too_wide_for_a_thread_is_refused_by_name():
    q, k = torch.randn(1, 1, 2, 4094), torch.randn(1, 1, 2, 4094)  # 2047 units: one lane each
    cos, sin = torch.randn(2, 4094), torch.randn(2, 4094)
    with pytest.raises(ValueError, match="q's head dim D = 4094 is not supported"):
        qk_norm_rope(q, k, torch.ones(4094), torch.ones(4094), cos, sin)


# ----------------------------------------------------------------------------- the kernels' cover


def _flat(t):
    """t's whole storage as a 1-D tensor, and t's offset into it: how the kernel sees t."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.new_empty(0).set_(t.untyped_storage(), 0, (n,), (1,)), t.storage_offset()


def _model_forward(q, k, qw, kw, cos, sin, eps, offset, interleaved, dim):
    """kernels/rope/qk_norm_kernels.py's forward loops in Python (fp64), on the strides and vector
    width the launch passes: per position, thread tid = slot * lanes + lane holds its columns
    (HeadCover.columns) of heads slot + i * heads_per_pass, ceil(H / heads_per_pass) passes,
    a head past H computed on H - 1 and not stored. Every output element and every rstd must
    be written exactly once."""
    from kbuild.kernels.rope.qk_norm_kernels import THREADS, head_cover

    outs = [torch.full(x.shape, float("nan"), dtype=torch.float64) for x in (q, k)]
    rstds = [torch.full((x.numel() // x.shape[-1],), float("nan"), dtype=torch.float64)
             for x in (q, k)]  # fmt: skip
    values, strides = ops.forward_values(q, k, qw, cos, sin, eps, offset, interleaved, dim, True,
                                         outs)  # fmt: skip
    D, vec = values[0], values[-1]
    cover = head_cover(D, ops.DTYPE_NAMES[q.dtype], interleaved, vec)
    rs = [ops._rstd_strides(r, x, dim) for r, x in zip(rstds, (q, k), strict=True)]
    (B, T, Hq), Hk = ops._geometry(q, dim), ops._geometry(k, dim)[2]
    w_, half, per = cover.width, D // 2, cover.heads_per_pass
    cs = [_flat(t) for t in (cos, sin)]
    writes = [torch.zeros(o.numel()) for o in outs] + [torch.zeros(r.numel()) for r in rstds]
    for position in range(B * T):
        b, t = divmod(position, T)
        for side, (x, w, H) in enumerate(((q, qw, Hq), (k, kw, Hk))):
            xf, x0 = _flat(x)
            sx = strides[3 * side : 3 * side + 3]
            so = strides[6 + 3 * side : 9 + 3 * side]
            for slot in range(THREADS // cover.lanes):
                for i in range(-(-H // per)):
                    h = slot + i * per
                    valid, h = h < H, min(h, H - 1)
                    at = x0 + b * sx[0] + h * sx[1] + t * sx[2]
                    cols = [cover.columns(lane) for lane in range(cover.lanes)]
                    v = {c + e: xf[at + c + e].double() for cl in cols for c in cl
                         for e in range(w_)}  # fmt: skip
                    assert sorted(v) == list(range(D)), "a head's lanes hold each column once"
                    rstd = 1.0 / (sum(a * a for a in v.values()) / D + eps) ** 0.5
                    n = {j: v[j] * rstd * (offset + w[j].double()) for j in v}
                    if not valid:
                        continue
                    o = b * so[0] + h * so[1] + t * so[2]
                    for j in range(D):
                        ct = [
                            f[f0 + b * st[0] + t * st[1] + j].double()
                            for (f, f0), st in zip(cs, (strides[12:14], strides[14:]), strict=True)
                        ]
                        c_, s_ = ct
                        if interleaved:
                            partner = -n[j + 1] if j % 2 == 0 else n[j - 1]
                        else:
                            partner = -n[j + half] if j < half else n[j - half]
                        outs[side].view(-1)[o + j] = c_ * n[j] + s_ * partner
                        writes[side][o + j] += 1
                    r = b * rs[side][0] + h * rs[side][1] + t * rs[side][2]
                    rstds[side][r] = rstd
                    writes[2 + side][r] += 1
    for n in writes:
        assert torch.equal(n, torch.ones_like(n)), "every output written exactly once"
    return outs, rstds


def _model_backward(q, k, qw, kw, cos, sin, q_rstd, k_rstd, dq_out, dk_out, offset, interleaved,
                    dim, blocks):  # fmt: skip
    """The backward's loops in Python (fp64): a grid of G = min(B * T, blocks) blocks, block
    g walking positions g, g + G, ...; each thread's dw terms added over its heads; then per
    block the slots added in slot order into row g of the (2, G, D) workspace; the column sum
    adds the rows in order."""
    from kbuild.kernels.rope.qk_norm_kernels import THREADS, head_cover

    outs = [torch.empty(x.shape, dtype=torch.float64) for x in (q, k)]
    values, strides, trig = ops.backward_values(q, k, dq_out, dk_out, qw, cos, sin, offset,
                                                interleaved, dim, True, outs)  # fmt: skip
    D, vec = values[0], values[-1]
    cover = head_cover(D, ops.DTYPE_NAMES[q.dtype], interleaved, vec)
    (B, T, Hq), Hk = ops._geometry(q, dim), ops._geometry(k, dim)[2]
    P, per, half = B * T, cover.heads_per_pass, D // 2
    G = min(P, blocks)
    slots = THREADS // cover.lanes
    acc = torch.zeros(G, 2, slots, D, dtype=torch.float64)  # per block, side, slot: its columns
    rstds = (q_rstd, k_rstd)
    for g in range(G):
        for position in range(g, P, G):
            b, t = divmod(position, T)
            c = cos.double().expand(B, T, D)[b, t]
            s = sin.double().expand(B, T, D)[b, t]
            for side, (x, w, H, dy) in enumerate(((q, qw, Hq, dq_out), (k, kw, Hk, dk_out))):
                xf, x0 = _flat(x)
                dyf, dy0 = _flat(dy)
                sx, sd = strides[3 * side : 3 * side + 3], strides[6 + 3 * side : 9 + 3 * side]
                so = strides[12 + 3 * side : 15 + 3 * side]
                rs = ops._rstd_strides(rstds[side], x, dim)
                for slot in range(slots):
                    for i in range(-(-H // per)):
                        h = slot + i * per
                        valid, h = h < H, min(h, H - 1)
                        at = x0 + b * sx[0] + h * sx[1] + t * sx[2]
                        da = dy0 + b * sd[0] + h * sd[1] + t * sd[2]
                        xv = xf[at : at + D].double()
                        dyv = dyf[da : da + D].double()
                        rstd = rstds[side][b * rs[0] + h * rs[1] + t * rs[2]].double()
                        rstd = rstd if valid else 0.0
                        if interleaved:
                            pairs = (dyv * s).view(-1, 2)
                            turned = torch.stack((pairs[:, 1], -pairs[:, 0]), -1).view(-1)
                        else:
                            turned = torch.cat((dyv[half:] * s[half:], -dyv[:half] * s[:half]))
                        dn = dyv * c + turned  # c dy - R(s dy)
                        x_hat = xv * rstd
                        gw = dn * (offset + w.double())
                        dx = (gw - x_hat * (gw * x_hat).sum() / D) * rstd
                        if valid:
                            o = b * so[0] + h * so[1] + t * so[2]
                            outs[side].view(-1)[o : o + D] = dx
                        acc[g, side, slot] += dn * x_hat
    workspace = acc.sum(2)  # slot order, per block: (G, 2, D)
    dw = workspace.sum(0)  # the column sum, row order
    return outs, dw[0], dw[1]


MODEL_CASES = [
    # (B, T, Hq, Hk, D, dtype, interleaved, dim, view): vec, lanes and passes that differ
    (1, 2, 5, 3, 64, torch.bfloat16, False, 1, "fused"),  # vec 8, 4 lanes, 32 heads a pass
    (1, 2, 3, 1, 256, torch.float32, False, 2, "dense"),  # vec 4, 32 lanes: 4 heads a pass
    (2, 2, 6, 2, 256, torch.bfloat16, True, 1, "transposed"),  # pairs, 32 lanes, 2 passes
    (1, 3, 2, 1, 10, torch.float32, True, 1, "dense"),  # vec 2 (pairs), 5 units: 1 lane
    (1, 3, 2, 1, 10, torch.float32, False, 1, "dense"),  # vec 1, 5 units: one lane a head
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_model_covers_every_element_once_and_matches(case):
    B, T, Hq, Hk, D, dtype, interleaved, dim, view = case
    q, k = _qk(B, T, Hq, Hk, D, dtype, dim, view)
    cos, sin = _trig(B, T, D, interleaved, torch.float32)
    sin = sin + 0.01 * torch.randn(sin.shape)  # halves that differ: the transpose shows
    qw, kw = _weights(D, torch.float32, 1.0)
    (mq, mk), (rq, rk) = _model_forward(q, k, qw, kw, cos, sin, 1e-6, 1.0, interleaved, dim)
    want = ops.qk_norm_rope_reference(q, k, qw, kw, cos, sin, 1e-6, 1.0, interleaved, dim)
    for got, ref in zip((mq, mk, rq, rk), want, strict=True):
        assert torch.allclose(got.to(ref.dtype).float(), ref.float().reshape(got.shape),
                              atol=TOL[dtype] * 4, rtol=TOL[dtype])  # fmt: skip
    g = torch.Generator().manual_seed(3)
    dq_out = torch.randn(q.shape, generator=g).to(dtype).transpose(1, 2).contiguous()
    dq_out = dq_out.transpose(1, 2)  # a strided gradient, read in place
    dk_out = torch.randn(k.shape, generator=g).to(dtype)
    q_rstd, k_rstd = (r.float().reshape(-1) for r in want[2:])
    want = ops.qk_norm_rope_backward_reference(dq_out, dk_out, q, k, qw, kw, cos, sin, q_rstd,
                                               k_rstd, True, True, True, True, 1.0,
                                               interleaved, dim)  # fmt: skip
    for blocks in (1, 2, 1024):  # a block of several positions, and one a position
        got = _model_backward(q, k, qw, kw, cos, sin, q_rstd, k_rstd, dq_out, dk_out, 1.0,
                              interleaved, dim, blocks)  # fmt: skip
        (gq, gk), gqw, gkw = got
        for a, ref in zip((gq, gk, gqw, gkw), want, strict=True):
            scale = ref.abs().max().clamp_min(1.0).double()
            assert (a - ref.double()).abs().max() <= TOL[dtype] * scale


@pytest.mark.parametrize(
    "D,dtype,interleaved,vec,lanes,per_lane",
    [
        (128, "bf16", False, 8, 8, 1),  # Qwen3: 8 lanes a head, 16 heads a block
        (256, "bf16", False, 8, 16, 1),  # Gemma 3
        (64, "f32", False, 4, 8, 1),
        (256, "f32", False, 1, 32, 4),  # a misaligned view: vec 1, 4 units a lane
        (128, "bf16", True, 8, 16, 1),
        (96, "bf16", False, 4, 4, 3),  # 12 units: 4 lanes of 3 (vec 8: 48 elements a thread)
    ],
)
def test_head_cover(D, dtype, interleaved, vec, lanes, per_lane):
    from kbuild.kernels.rope.qk_norm_kernels import MAX_ELEMENTS, head_cover

    cover = head_cover(D, dtype, interleaved, vec)
    assert (cover.lanes, cover.per_lane) == (lanes, per_lane)
    assert cover.heads_per_pass * cover.lanes == 128 and cover.elements <= MAX_ELEMENTS
    columns = sorted(c + e for lane in range(lanes) for c in cover.columns(lane)
                     for e in range(cover.width))  # fmt: skip
    assert columns == list(range(D))


def test_head_cover_refuses_what_does_not_fit():
    from kbuild.kernels.rope.qk_norm_kernels import head_cover

    with pytest.raises(ValueError, match="48 elements a thread at vec 8"):
        head_cover(96, "bf16", False, 8)
    q = torch.empty(2, 4, 5, 96, dtype=torch.bfloat16, device="meta")
    assert ops.launch_vec(torch.bfloat16, 96, False, [96 * 4], [q]) == 4  # the launch narrows

    with pytest.raises(ValueError, match="D must be even"):
        head_cover(9, "f32", False, 1)
    with pytest.raises(ValueError, match="vec must be a power of two <= 4"):
        head_cover(8, "f32", False, 8)
    with pytest.raises(ValueError, match="vec 4 must divide 3"):
        head_cover(6, "bf16", False, 4)
    with pytest.raises(ValueError, match="at most 32"):
        head_cover(2 * 35, "f32", False, 1)  # 35 units: one lane of 70 elements


def test_fused_qkv_views_are_read_in_place_at_full_width():
    """q and k as views of a fused qkv projection: no copy, 16 bytes at a time, forward and
    backward; a head too wide for vec 8 at 32 elements a thread narrows (D = 96: 3 units)."""
    case = (2, 17, 32, 8, 128, torch.bfloat16, torch.bfloat16, torch.bfloat16, 0.0, False, 1,
            True)  # fmt: skip
    assert case in cases.QK_ROPE_GPU_CASES
    q, k, qw, kw, cos, sin = ops.case_tensors(case, "meta")
    assert not q.is_contiguous() and ops.readable(q) is q
    fwd, bwd, column_sum = ops.specs_for(q, k, qw, kw, cos, sin)
    assert fwd.kwargs["vec"] == 8 and bwd.kwargs["weight_grad"]
    assert bwd.kwargs["vec"] == 4  # narrowed to BWD_ELEMENTS (8) a thread: its registers
    assert column_sum.kwargs["N"] == 128
    odd = torch.empty(2 * 4 * 5 * 64 + 1, dtype=torch.bfloat16, device="meta")[1:]
    q = odd.view(2, 4, 5, 64)
    cos, sin = (torch.empty(2, 5, 64, dtype=torch.bfloat16, device="meta") for _ in range(2))
    weights = [torch.empty(64, dtype=torch.bfloat16, device="meta")] * 2
    fwd, _, _ = ops.specs_for(q, q[:, :2], *weights, cos, sin)
    assert fwd.kwargs["vec"] == 1


# ----------------------------------------------------------------------------- kernels


def _ptx(spec):
    from kbuild.compiler import build
    from kbuild.targets import target_for_arch
    from kbuild.targets.nvidia import module_to_ptx

    sm90 = target_for_arch("sm_90")
    return module_to_ptx(build(spec, sm90).module, sm90).decode()


def _fwd(**kw):
    from kbuild.kernels.rope.qk_norm_kernels import build_qk_norm_rope

    base = dict(D=128, dtype="bf16", w_dtype="bf16", cs_dtype="bf16", eps=1e-6, vec=8)
    return build_qk_norm_rope.spec(**{**base, **kw})


def _bwd(**kw):
    from kbuild.kernels.rope.qk_norm_kernels import build_qk_norm_rope_bwd

    base = dict(D=128, dtype="bf16", w_dtype="bf16", cs_dtype="bf16", vec=8)
    return build_qk_norm_rope_bwd.spec(**{**base, **kw})


@pytest.mark.parametrize("interleaved", [False, True])
def test_kernel_ptx_wide_accesses_shuffles_and_no_atomics(interleaved):
    """At the widths the launches pick for aligned bf16 heads of 128 (the forward 16 bytes an
    access; the backward 16 for pairs, 8 for rotate-half, BWD_ELEMENTS a thread), both
    kernels sum a head in warp shuffles, and the backward's weight gradient takes no atomics
    (its partials go to a workspace row, summed in order)."""
    wide, half = r"v4\.b32", r"(v4\.b16|v2\.b32)"  # 16 bytes, 8 bytes
    specs = ((_fwd(interleaved=interleaved), wide),
             (_bwd(interleaved=interleaved, offset=1.0, vec=8 if interleaved else 4),
              wide if interleaved else half))  # fmt: skip
    for spec, access in specs:
        ptx = _ptx(spec)
        assert re.search(rf"ld\.global(\.\w+)*\.{access}\s", ptx)
        assert re.search(rf"st\.global(\.\w+)*\.{access}\s", ptx)
        assert "shfl.sync.bfly" in ptx
        assert not re.search(r"\b(atom|red)\.", ptx)
        assert ".maxntid 128, 1, 1" in ptx


def test_kernel_ptx_without_weight_gradient_or_rstd():
    ptx = _ptx(_bwd(weight_grad=False))
    assert "bar.sync" not in ptx and "st.shared" not in ptx  # no partials
    stores = len(re.findall(r"st\.global", _ptx(_fwd(store_rstd=False))))
    assert stores == len(re.findall(r"st\.global", _ptx(_fwd()))) - 2  # no rstd of q, of k


def test_kernel_ptx_of_odd_spans_is_scalar():
    ptx = _ptx(_fwd(D=10, dtype="f32", w_dtype="f32", cs_dtype="f32", vec=1))
    assert not re.search(r"\.v[24]\.", ptx) and "shfl" not in ptx  # one lane a head


def test_kernels_lower_for_amd():
    from kbuild import compiler
    from kbuild.targets import target_for_arch

    gfx = target_for_arch("gfx942")
    for spec in (_fwd(), _fwd(D=256, dtype="f16", w_dtype="f32", cs_dtype="f32", offset=1.0),
                 _bwd(), _bwd(D=64, dtype="f32", w_dtype="f32", cs_dtype="f32", vec=4,
                              interleaved=True), _bwd(D=10, vec=1)):  # fmt: skip
        assert compiler.lower(spec, gfx)


def test_warm_kernels_build_for_sm_90():
    """Every kernel warmup_specs() lists builds and verifies: the GPU tests' and the models'
    (Qwen3-8B 32 / 8 heads of 128, Gemma-3-4B 8 / 4 of 256, in bf16, fp16 and fp32)."""
    from kbuild.compiler import build
    from kbuild.targets import target_for_arch

    sm90 = target_for_arch("sm_90")
    specs = ops.warmup_specs()
    for D in (64, 128, 256):
        for dtype in ("bf16", "f16", "f32"):
            for name in ("qk_norm_rope", "qk_norm_rope_bwd"):
                assert any(s.kernel == name and s.kwargs["D"] == D and s.kwargs["dtype"] == dtype
                           for s in specs), (name, D, dtype)  # fmt: skip
    for spec in specs:
        build(spec, sm90)


def test_gpu_cases_are_warmable():
    """Every kernel tests/test_qk_norm_rope_gpu.py launches is in warmup_specs() (the GPU
    machine runs offline from a cache warmed with `kbuild warmup --module
    kbuild.kernels.rope.qk_norm`)."""
    from . import test_qk_norm_rope_gpu as gpu

    warm = set(ops.warmup_specs())
    for case in gpu.CASES:
        tensors = ops.case_tensors(case, "meta")
        specs = ops.specs_for(*tensors, offset=case[8], interleaved=case[9],
                              unsqueeze_dim=case[10])  # fmt: skip
        assert set(specs) <= warm, [s.short() for s in specs if s not in warm]


def test_modules_import_and_list_their_kernels_without_mlir():
    """The GPU machine runs from a warmed cache with no MLIR: the op, its kernels' module
    and both test modules import there, and warmup_specs() lists its kernels."""
    import subprocess
    import sys
    from pathlib import Path

    from .no_mlir import HIDE_MLIR

    code = HIDE_MLIR + (
        "import tests.test_qk_norm_rope_cpu, tests.test_qk_norm_rope_gpu\n"
        "import kbuild.kernels.rope.qk_norm as o\n"
        "assert o.warmup_specs() and 'mlir' not in sys.modules\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_misaligned_weight_is_copied_to_an_aligned_one():
    """The vector width comes from q, k, cos, sin and the outputs: a weight view starting 2
    bytes into its storage would be read in misaligned vectors (a GPU fault), so the launch
    reads an aligned copy of it."""
    import torch

    from kbuild.kernels.rope import qk_norm as ops

    buf = torch.ones(129, dtype=torch.bfloat16)
    w = buf[1:]
    assert w.data_ptr() % 16 != 0
    a = ops.aligned_weight(w)
    assert a.data_ptr() % 16 == 0 and torch.equal(a, w)
    assert ops.aligned_weight(buf[:128]) is not None
