"""kbuild.softmax / kbuild.log_softmax's kernels on the GPU: values and gradients against fp64
torch, every width class (rows sharing a block, peeled odd widths, a chunked long row), a
float32 output of 16-bit x, another dim, a misaligned view, masked rows. Kernels warmed with
`kbuild warmup --arch sm_90 --module kbuild.kernels.softmax.op` (its warmup_specs() lists every
aligned case below: tests/test_softmax_cpu.py checks it)."""

from __future__ import annotations

import pytest
import torch

from kbuild.cases import SOFTMAX_GPU_DTYPES as GPU_DTYPES
from kbuild.cases import SOFTMAX_GPU_N as GPU_N
from kbuild.cases import SOFTMAX_MISALIGNED as MISALIGNED

pytestmark = pytest.mark.gpu

NAMES = ("softmax", "log_softmax")
# (name, N, dtype, out dtype): out None is x's dtype; float32 on 16-bit x is the kernel's
# out_dtype (x read as it is)
CASES = [
    (name, N, dtype, out)
    for name in NAMES
    for N in GPU_N
    for dtype in GPU_DTYPES
    for out in ((None,) if dtype == torch.float32 else (None, torch.float32))
]
TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _fp64(name, x, dy, dim=-1):
    xd = x.detach().double().requires_grad_()
    y = getattr(torch, name)(xd, dim)
    (dx,) = torch.autograd.grad(y, xd, dy.double())
    return y, dx


def _check(name, x, dy, out, dim=-1):
    import kbuild

    x = x.detach().requires_grad_()
    y = getattr(kbuild, name)(x, dim, out)
    assert y.dtype == (out or x.dtype) and y.shape == x.shape
    (dx,) = torch.autograd.grad(y, x, dy.to(y.dtype))
    assert dx.dtype == x.dtype
    ref, dref = _fp64(name, x, dy.to(y.dtype), dim)
    tol = TOL[y.dtype]
    scale = ref.abs().amax(dim, keepdim=True).clamp_min(1.0) if name == "log_softmax" else 1.0
    assert ((y.double() - ref).abs() / scale).max() <= tol, name
    dtol = TOL[x.dtype] * 4
    assert (dx.double() - dref).abs().max() <= dtol * dref.abs().max().clamp_min(1e-30)


@pytest.mark.parametrize("name,N,dtype,out", CASES)
def test_values_and_gradients_match_fp64(name, N, dtype, out):
    g = torch.Generator(device="cuda").manual_seed(N)
    x = (torch.randn(37, N, device="cuda", generator=g) * 3).to(dtype)
    dy = torch.randn(37, N, device="cuda", generator=g)
    _check(name, x, dy, out)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dim", [0, 1])
def test_another_dim(name, dim):
    x = torch.randn(4097, 5, 3, device="cuda", dtype=torch.bfloat16) if dim == 0 else \
        torch.randn(3, 4097, 5, device="cuda", dtype=torch.bfloat16)  # fmt: skip
    _check(name, x, torch.randn(x.shape, device="cuda"), None, dim)


@pytest.mark.parametrize("name", NAMES)
def test_a_misaligned_view(name):
    """A view starting one element in: vectorize=False (scalar accesses)."""
    N, dtype = MISALIGNED
    base = torch.randn(37 * N + 1, device="cuda", dtype=dtype)
    x = base[1:].view(37, N)
    _check(name, x, torch.randn(x.shape, device="cuda"), None)


@pytest.mark.parametrize("N", [1000, 4096, 151936])
def test_masked_rows_far_below_zero(N):
    """Rows of -inf with a few values near -1000: no NaN (a thread of only -inf values)."""
    import kbuild

    x = torch.full((8, N), float("-inf"), device="cuda")
    x[:, :3] = -1000.0 + torch.arange(3.0, device="cuda")
    y = kbuild.softmax(x)
    ref = torch.softmax(x.double(), -1)
    assert not y.isnan().any() and torch.allclose(y.double(), ref, atol=1e-6)
    assert torch.equal(kbuild.log_softmax(x)[:, 3:], x[:, 3:])
