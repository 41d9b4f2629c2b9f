"""On a ROCm machine (torch.version.hip set, an AMD GPU): the HIP runtime loads the HSACO
kbuild built and the ops match the fp64 reference, forward and backward. Never run here (no
AMD GPU on these machines): skipped elsewhere. Warm first:
`kbuild warmup --arch gfx942 --manifest tests --cache-dir DIR`, then
`KBUILD_CACHE_DIR=DIR KBUILD_OFFLINE=1 python -m pytest -m rocm tests`."""

from __future__ import annotations

import pytest
import torch

import kbuild

from .reference import layernorm_grads, rmsnorm_grads

pytestmark = pytest.mark.rocm


@pytest.mark.parametrize("N", [768, 4096])
def test_rmsnorm_and_layernorm_on_rocm(N):
    from kbuild import jit
    from kbuild.runtime import hip

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, N, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    w = torch.randn(N, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    b = torch.randn(N, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    dy = torch.randn(64, N, generator=g).to("cuda", torch.bfloat16)
    y = kbuild.rmsnorm(x, w, 1e-6)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    ref_y, ref_dx, ref_dw, _ = rmsnorm_grads(x, w, dy, 1e-6)
    torch.testing.assert_close(y.float(), ref_y.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dx.float(), ref_dx.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw.float(), ref_dw.float(), rtol=2e-2, atol=5e-1)
    z = kbuild.layernorm(x, w, b, 1e-5)
    grads = torch.autograd.grad(z, [x, w, b], dy)
    ref = layernorm_grads(x, w, b, dy, 1e-5)
    torch.testing.assert_close(z.float(), ref[0].float(), rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, ref[1:], strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=5e-1)
    assert all(isinstance(v, hip.Launcher) for v in jit._loaded._entries.values())
