"""kbuild.kernels.rope.qk_norm's kernels on the GPU: values and the four gradients against fp64
torch (HF's Qwen3RMSNorm / Gemma3RMSNorm then apply_rotary_pos_emb), both layouts, both
unsqueeze_dims, D of 64, 128 and 256, GQA, Gemma's offset, fp32 weights and tables beside
16-bit q; q and k read in place as views of a fused qkv projection (no copy: the peak memory
is the outputs'); weight gradients bitwise the same run after run. Kernels warmed with
`kbuild warmup --arch sm_90 --module kbuild.kernels.rope.qk_norm` (its warmup_specs() lists
every case below: tests/test_qk_norm_rope_cpu.py checks it)."""

from __future__ import annotations

import pytest
import torch

from kbuild.cases import QK_ROPE_GPU_CASES as GPU_CASES

from .test_rope_gpu import _rotate_every_two, _rotate_half  # HF's

pytestmark = pytest.mark.gpu

CASES = GPU_CASES
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _fp64(q, k, qw, kw, cos, sin, offset, interleaved, dim, eps=1e-6):
    B = q.shape[0]
    cos, sin = (t.double().expand(B, *t.shape[-2:]).unsqueeze(dim) for t in (cos, sin))
    rotate = _rotate_every_two if interleaved else _rotate_half

    def one(x, w):
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w)
        return n * cos + rotate(n) * sin

    return one(q, qw), one(k, kw)


def _close(got, ref, dtype):
    scale = ref.abs().max().clamp_min(1.0)
    err = (got.double() - ref).abs().max()
    assert err <= TOL[dtype] * scale, (err, TOL[dtype] * scale)


def _check(q, k, qw, kw, cos, sin, offset, interleaved, dim):
    from kbuild.kernels.rope.qk_norm import qk_norm_rope

    leaves = [t.detach().requires_grad_() for t in (q, k, qw, kw)]
    qo, ko = qk_norm_rope(*leaves, cos, sin, 1e-6, offset, interleaved, dim)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == q.dtype
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, qw, kw)]
    rq, rk = _fp64(*ref_leaves, cos, sin, offset, interleaved, dim)
    _close(qo, rq, q.dtype)
    _close(ko, rk, q.dtype)
    g = torch.Generator(device="cuda").manual_seed(7)
    dq_out = torch.randn(qo.shape, device="cuda", generator=g).to(q.dtype)
    dk_out = torch.randn(ko.shape, device="cuda", generator=g).to(q.dtype)
    grads = torch.autograd.grad((qo, ko), leaves, (dq_out, dk_out))
    refs = torch.autograd.grad((rq, rk), ref_leaves, (dq_out.double(), dk_out.double()))
    for got, ref, leaf in zip(grads, refs, leaves, strict=True):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        _close(got, ref, q.dtype)
    return grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_values_and_gradients_match_fp64(case):
    from kbuild.kernels.rope.qk_norm import case_tensors

    _check(*case_tensors(case, "cuda"), case[8], case[9], case[10])


def test_weight_gradients_are_bitwise_repeatable():
    """No atomics: the same dq_weight and dk_weight bits on every run (and dq, dk)."""
    from kbuild.kernels.rope.qk_norm import case_tensors, qk_norm_rope

    # 1200 positions: blocks of several positions each
    case = (4, 300, 32, 8, 128, torch.bfloat16, torch.bfloat16, torch.bfloat16, 0.0, False, 1,
            True)  # fmt: skip
    q, k, qw, kw, cos, sin = case_tensors(case, "cuda")
    dq_out = torch.randn(q.shape, device="cuda").to(q.dtype)
    dk_out = torch.randn(k.shape, device="cuda").to(q.dtype)
    runs = []
    for _ in range(3):
        leaves = [t.detach().requires_grad_() for t in (q, k, qw, kw)]
        qo, ko = qk_norm_rope(*leaves, cos, sin)
        runs.append(torch.autograd.grad((qo, ko), leaves, (dq_out, dk_out)))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0], strict=True))


def test_fused_qkv_views_are_read_in_place():
    """q and k are views of one qkv projection: the kernel reads them at their strides (no
    copy: the peak memory of the forward is its outputs and rstds), writes dense outputs, and
    leaves the projection as it was."""
    from kbuild.kernels.rope.qk_norm import case_tensors, qk_norm_rope

    case = (2, 17, 32, 8, 128, torch.bfloat16, torch.bfloat16, torch.bfloat16, 0.0, False, 1,
            True)  # fmt: skip
    q, k, qw, kw, cos, sin = case_tensors(case, "cuda")
    assert not q.is_contiguous()
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    before = q.clone(), k.clone()
    qk_norm_rope(q, k, qw, kw, cos, sin)  # loaded and warm
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    qo, ko = qk_norm_rope(q.requires_grad_(), k, qw, kw, cos, sin)
    grown = torch.cuda.max_memory_allocated() - start
    rstds = 4 * (q.numel() + k.numel()) // 128
    assert grown <= 2 * (qo.numel() + ko.numel()) + rstds + 4096, grown
    q.requires_grad_(False)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])
    assert qo.is_contiguous() and ko.is_contiguous()
    _check(q, k, qw, kw, cos, sin, 0.0, False, 1)


@pytest.mark.parametrize("shared", [(1,), ()])
def test_cos_sin_shared_by_the_batch(shared):
    from kbuild.kernels.rope.qk_norm import case_tensors

    case = (2, 33, 4, 2, 64, torch.bfloat16, torch.bfloat16, torch.float32, 0.0, False, 1, True)
    q, k, qw, kw, cos, sin = case_tensors(case, "cuda")
    cos, sin = cos[0].reshape(*shared, 33, 64), sin[0].reshape(*shared, 33, 64)
    _check(q, k, qw, kw, cos, sin, 0.0, False, 1)


def test_a_misaligned_view_takes_scalar_accesses():
    """q one element into its storage: the launches pick vec 1 (still read in place)."""
    from kbuild.kernels.rope.qk_norm import misaligned_tensors

    _check(*misaligned_tensors("cuda"), 0.0, False, 1)


def test_matches_the_cpu_reference():
    """The kernels against the op's own CPU path (the same contract) within a rounding."""
    from kbuild.kernels.rope.qk_norm import case_tensors, qk_norm_rope

    case = (1, 9, 8, 4, 256, torch.bfloat16, torch.float32, torch.float32, 1.0, False, 1, True)
    tensors = case_tensors(case, "cuda")
    got = qk_norm_rope(*tensors, offset=1.0)
    want = qk_norm_rope(*(t.cpu() for t in tensors), offset=1.0)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a.cpu().float(), b.float(), atol=1e-2, rtol=1e-2)
