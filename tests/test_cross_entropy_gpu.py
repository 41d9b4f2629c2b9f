"""kbuild.cross_entropy's kernels on the GPU: values and gradients against fp64 torch, the
out-of-range report, and bitwise repeats. Kernels warmed with
`kbuild warmup --arch sm_90 --module kbuild.ops.loss` (its warmup_specs() lists every case
below: tests/test_cross_entropy_cpu.py checks it)."""

from __future__ import annotations

import pytest
import torch

from kbuild.ops.loss import GPU_DTYPES, GPU_OPTIONS, GPU_V

pytestmark = pytest.mark.gpu

CASES = [
    (V, dtype, index, ls, z)
    for V in GPU_V
    for dtype in GPU_DTYPES
    for index in (torch.int32, torch.int64)
    for ls, z in GPU_OPTIONS
]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _case(V, dtype, index, M=37, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(M, V, device="cuda", generator=g) * 4).to(dtype)
    t = torch.randint(0, V, (M,), device="cuda", generator=g).to(index)
    t[3] = -100
    return x, t


def _fp64(x, t, reduction, ls, z):
    from tests.test_cross_entropy_cpu import _fp64 as ref

    return ref(x, t, reduction, ls, z)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("V,dtype,index,ls,z", CASES)
def test_values_and_gradients_match_fp64(V, dtype, index, ls, z, reduction):
    import kbuild

    x, t = _case(V, dtype, index)
    x.requires_grad_()
    y = kbuild.cross_entropy(x, t, reduction=reduction, label_smoothing=ls, lse_square_scale=z)
    ref, xd = _fp64(x, t, reduction, ls, z)
    w = torch.rand(y.shape, device="cuda", dtype=torch.float64) if reduction == "none" else 1.0
    (y.double() * w).sum().backward()
    (ref * w).sum().backward()
    tol = TOL[dtype]
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol)
    assert (x.grad.double() - xd.grad).abs().max() <= tol * xd.grad.abs().max()
    assert x.grad[3].abs().max() == 0


def test_inference_matches_training_loss():
    import kbuild

    x, t = _case(50257, torch.bfloat16, torch.int64)
    with torch.no_grad():
        a = kbuild.cross_entropy(x, t)
    b = kbuild.cross_entropy(x.requires_grad_(), t)
    assert torch.equal(a, b.detach())


def test_a_bad_target_raises():
    import kbuild

    x, t = _case(4096, torch.bfloat16, torch.int32)
    t[5] = 4096
    with pytest.raises(ValueError, match="target must hold class ids"):
        kbuild.cross_entropy(x, t)


@pytest.mark.parametrize("V", [4096, 50257, 151936])
def test_bitwise_repeats(V):
    import kbuild

    x, t = _case(V, torch.bfloat16, torch.int64, M=256)
    outs = []
    for _ in range(3):
        xr = x.detach().clone().requires_grad_()
        y = kbuild.cross_entropy(xr, t, label_smoothing=0.1, lse_square_scale=1e-4)
        y.backward()
        outs.append((y.detach(), xr.grad))
    for y, g in outs[1:]:
        assert torch.equal(y, outs[0][0]) and torch.equal(g, outs[0][1])
