"""LayerNorm forward and backward on the GPU against fp64 references; large-mean rows;
bitwise-deterministic dw and db; kbuild.nn modules against torch.nn on the GPU."""

from __future__ import annotations

import pytest
import torch

import kbuild
from kbuild.cases import DTYPES, MULTI_ROW_N, TEST_N

from .gpu_cases import DETERMINISTIC_N, LARGE_MEAN_N, layernorm_cases
from .gpu_utils import GRAD_TOL, TORCH_DTYPES, poison_allocator, rand
from .reference import assert_close_rel, layernorm_grads

pytestmark = pytest.mark.gpu


def _param(N, dtype, seed, offset):
    if dtype is None:
        return None
    return (offset + rand((N,), TORCH_DTYPES[dtype], seed, scale=0.5)).requires_grad_()


@pytest.mark.parametrize("N", TEST_N)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm_forward_backward(N: int, dtype: str) -> None:
    tdtype = TORCH_DTYPES[dtype]
    tol = GRAD_TOL[tdtype]
    for M, w_dtype, b_dtype in layernorm_cases(dtype):
        x = rand((M, N), tdtype, seed=N + M, scale=2.0).requires_grad_()
        w, b = _param(N, w_dtype, N, 1.0), _param(N, b_dtype, N + 1, 0.0)
        dy = rand((M, N), tdtype, seed=N + M + 1)
        poison_allocator(M * N, tdtype)
        y = kbuild.layernorm(x, w, b, 1e-5)
        inputs = [t for t in (x, w, b) if t is not None]
        grads = iter(torch.autograd.grad(y, inputs, dy))
        ref_y, ref_dx, ref_dw, ref_db = layernorm_grads(x, w, b, dy, 1e-5)
        what = f"M={M} N={N} {dtype} w={w_dtype} b={b_dtype}"
        assert_close_rel(y, ref_y.to(tdtype), tol, "y " + what)
        assert_close_rel(next(grads), ref_dx, tol, "dx " + what)
        for p, ref in ((w, ref_dw), (b, ref_db)):
            if p is not None:
                g = next(grads)
                assert g.dtype == p.dtype
                assert_close_rel(g, ref, GRAD_TOL[p.dtype] + tol, "dparam " + what)


@pytest.mark.parametrize("N", MULTI_ROW_N)
def test_rows_sharing_a_block(N: int) -> None:
    # Four rows of 128 threads a block: each row's sums stay its own, the block's dw/db
    # partials add up in shared memory before the column sum, and the last block's rows
    # past M add nothing (M = 3 and 4099 leave 3 of its 4 rows).
    for M in (3, 4099):
        x = rand((M, N), torch.bfloat16, seed=M, scale=2.0).requires_grad_()
        w, b = _param(N, "bf16", 11, 1.0), _param(N, "bf16", 12, 0.0)
        dy = rand((M, N), torch.bfloat16, seed=M + 1)
        poison_allocator(M * N, torch.bfloat16)
        dx, dw, db = torch.autograd.grad(kbuild.layernorm(x, w, b, 1e-5), [x, w, b], dy)
        _, ref_dx, ref_dw, ref_db = layernorm_grads(x, w, b, dy, 1e-5)
        tol = GRAD_TOL[torch.bfloat16]
        assert_close_rel(dx, ref_dx, tol, f"dx M={M}")
        assert_close_rel(dw, ref_dw, 2 * tol, f"dw M={M}")
        assert_close_rel(db, ref_db, 2 * tol, f"db M={M}")
        again = torch.autograd.grad(kbuild.layernorm(x, w, b, 1e-5), [w, b], dy)
        assert torch.equal(again[0], dw) and torch.equal(again[1], db)


def test_stats_match() -> None:
    from kbuild.kernels.norms.layernorm import layernorm_fwd

    x = rand((33, 4096), torch.bfloat16, seed=2, scale=3.0)
    _, mean, rstd = layernorm_fwd(x, None, None, 1e-5, store_stats=True)
    xd = x.double()
    torch.testing.assert_close(mean, xd.mean(-1).float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        rstd, torch.rsqrt(xd.var(-1, unbiased=False) + 1e-5).float(), rtol=1e-5, atol=0
    )


@pytest.mark.parametrize("N", LARGE_MEAN_N)
def test_large_mean_keeps_fp32_accuracy(N: int) -> None:
    """x = 1000 + randn: E[x^2] - mean^2 would lose every digit of the variance in fp32."""
    x = 1000.0 + rand((64, N), torch.float32, seed=3)
    y = kbuild.layernorm(x, None, None, 1e-5)
    ref = layernorm_grads(x, None, None, torch.zeros_like(x), 1e-5)[0]
    # fp32 itself limits this: x - mean carries x's rounding (1000 * 2^-24 = 6e-5 on a unit
    # std). Ours must be as good as torch's fp32 layer_norm; E[x^2] - mean^2 would be off by
    # orders of magnitude.
    torch_err = (torch.nn.functional.layer_norm(x, (N,), eps=1e-5).double() - ref).norm()
    our_err = (y.double() - ref).norm()
    assert our_err <= 2 * torch_err + 1e-6 * ref.norm(), f"ours {our_err:.3e} torch {torch_err:.3e}"
    assert_close_rel(y, ref, 2e-4, "large mean")


@pytest.mark.parametrize("N", DETERMINISTIC_N)
def test_dw_db_bitwise_deterministic(N: int) -> None:
    # N = 65536 splits each row over a cluster of blocks (Hopper), partials in shared memory.
    x = rand((256 if N == 65536 else 4096, N), torch.bfloat16, seed=4)
    w, b = _param(N, "bf16", 5, 1.0), _param(N, "bf16", 6, 0.0)
    dy = rand(x.shape, torch.bfloat16, seed=7)
    runs = [torch.autograd.grad(kbuild.layernorm(x, w, b), [w, b], dy) for _ in range(3)]
    for dw, db in runs[1:]:
        assert torch.equal(dw, runs[0][0]) and torch.equal(db, runs[0][1])


def test_nn_modules_match_torch_on_gpu() -> None:
    torch.manual_seed(0)
    for ours, theirs in (
        (kbuild.nn.LayerNorm(768), torch.nn.LayerNorm(768)),
        (kbuild.nn.RMSNorm(768, eps=1e-6), torch.nn.RMSNorm(768, eps=1e-6)),
    ):
        theirs.weight.data.uniform_(0.5, 1.5)
        ours.load_state_dict(theirs.state_dict())
        ours, theirs = ours.cuda(), theirs.cuda()
        x = rand((16, 768), torch.float32, seed=8).requires_grad_()
        dy = rand((16, 768), torch.float32, seed=9)
        a = torch.autograd.grad(ours(x), [x, *ours.parameters()], dy)
        b = torch.autograd.grad(theirs(x), [x, *theirs.parameters()], dy)
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
        for ga, gb in zip(a, b, strict=True):
            torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-4)
