"""kbuild.kernels.rope.op's kernel on the GPU: values and gradients against fp64 torch (HF's
formulas), both layouts, both unsqueeze_dims, partial rotary, GQA, q and k read in place as views of
a fused qkv projection, cos / sin per batch and shared, fp32 tables beside 16-bit q. Kernels
warmed with `kbuild warmup --arch sm_90 --module kbuild.kernels.rope.op` (its warmup_specs() lists
every case below: tests/test_rope_cpu.py checks it)."""

from __future__ import annotations

import pytest
import torch

from kbuild.cases import ROPE_GPU_CASES as GPU_CASES

pytestmark = pytest.mark.gpu

CASES = GPU_CASES
TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _fp64(q, k, cos, sin, interleaved, dim):
    B = q.shape[0]
    cos, sin = (t.double().expand(B, *t.shape[-2:]).unsqueeze(dim) for t in (cos, sin))
    rd = cos.shape[-1]
    rotate = _rotate_every_two if interleaved else _rotate_half

    def one(x):
        r, p = x[..., :rd], x[..., rd:]
        return torch.cat((r * cos + rotate(r) * sin, p), -1)

    return one(q), one(k)


def _check(q, k, cos, sin, interleaved, dim):
    from kbuild.kernels.rope.op import rope

    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    qo, ko = rope(q, k, cos, sin, interleaved=interleaved, unsqueeze_dim=dim)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == q.dtype
    qd, kd = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    rq, rk = _fp64(qd, kd, cos, sin, interleaved, dim)
    tol = TOL[q.dtype]
    for got, ref in ((qo, rq), (ko, rk)):
        scale = ref.abs().max().clamp_min(1.0)
        assert (got.double() - ref).abs().max() <= tol * scale
    rd = cos.shape[-1]
    assert torch.equal(qo[..., rd:], q.detach()[..., rd:])  # passed through exactly
    g = torch.Generator(device="cuda").manual_seed(7)
    dq_out = torch.randn(qo.shape, device="cuda", generator=g).to(q.dtype)
    dk_out = torch.randn(ko.shape, device="cuda", generator=g).to(q.dtype)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (dq_out, dk_out))
    rdq, rdk = torch.autograd.grad((rq, rk), (qd, kd), (dq_out.double(), dk_out.double()))
    for got, ref in ((dq, rdq), (dk, rdk)):
        assert got.dtype == q.dtype and got.shape == ref.shape
        scale = ref.abs().max().clamp_min(1.0)
        assert (got.double() - ref).abs().max() <= tol * scale


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_values_and_gradients_match_fp64(case):
    from kbuild.kernels.rope.op import case_tensors

    q, k, cos, sin = case_tensors(case, "cuda")
    _check(q, k, cos, sin, case[8], case[9])


def test_fused_qkv_views_are_read_in_place():
    """q and k are views of one qkv projection: the kernel reads them at their strides (no
    copy: the views' storage is the projection's), and writes dense outputs; the projection
    is left as it was."""
    from kbuild.kernels.rope.op import case_tensors, rope

    case = (2, 17, 32, 8, 128, 128, torch.bfloat16, torch.bfloat16, False, 1, True)
    q, k, cos, sin = case_tensors(case, "cuda")
    assert (
        not q.is_contiguous() and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    )
    before = q.clone(), k.clone()
    qo, ko = rope(q, k, cos, sin)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])
    assert qo.is_contiguous() and ko.is_contiguous()
    _check(q, k, cos, sin, False, 1)


@pytest.mark.parametrize("shared", [(1,), ()])
def test_cos_sin_shared_by_the_batch(shared):
    from kbuild.kernels.rope.op import case_tensors

    case = (3, 9, 4, 2, 64, 64, torch.bfloat16, torch.float32, False, 1, True)
    q, k, cos, sin = case_tensors(case, "cuda")
    cos, sin = cos[0].reshape(*shared, 9, 64), sin[0].reshape(*shared, 9, 64)
    _check(q, k, cos, sin, False, 1)


def test_a_misaligned_view_takes_scalar_accesses():
    """q one element into its storage: the launch picks vec 1 (still read in place)."""
    from kbuild.cases import ROPE_MISALIGNED as MISALIGNED
    from kbuild.kernels.rope.op import case_tensors

    case = (2, 5, 4, 2, *MISALIGNED, 1, False)
    _, k, cos, sin = case_tensors(case, "cuda")
    base = torch.randn(2 * 4 * 5 * 64 + 1, device="cuda").to(torch.bfloat16)
    q = base[1:].view(2, 4, 5, 64)
    _check(q, k, cos, sin, False, 1)
