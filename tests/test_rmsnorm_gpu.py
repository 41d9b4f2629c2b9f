"""RMSNorm forward on the GPU against the fp32 torch reference (tests/reference.py).

Shapes come from kbuild.cli.manifest so that `kbuild warmup --manifest tests` compiles exactly the
kernels these tests launch (the GPU machine runs them offline from that cache).
"""

from __future__ import annotations

import pytest
import torch

import kbuild
from kbuild.cases import DTYPES, TEST_N
from kbuild.kernels.norms.rmsnorm import rmsnorm_fwd

from .gpu_cases import RSTD_N, rmsnorm_cases
from .gpu_utils import FWD_TOL, TORCH_DTYPES, poison_allocator, rand
from .reference import rmsnorm_ref

pytestmark = pytest.mark.gpu


def _weight(N: int, w_dtype: str | None, seed: int) -> torch.Tensor | None:
    if w_dtype is None:
        return None
    return 1.0 + rand((N,), TORCH_DTYPES[w_dtype], seed, scale=0.5)


@pytest.mark.parametrize("N", TEST_N)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_reference(N: int, dtype: str) -> None:
    tdtype = TORCH_DTYPES[dtype]
    for M, w_dtype in rmsnorm_cases(dtype):
        x = rand((M, N), tdtype, seed=N + M)
        w = _weight(N, w_dtype, seed=N)
        poison_allocator(M * N, tdtype)
        y = kbuild.rmsnorm(x, w, eps=1e-6)
        assert y.shape == x.shape and y.dtype == x.dtype
        ref = rmsnorm_ref(x, w, 1e-6)
        torch.testing.assert_close(y, ref, **FWD_TOL[tdtype], msg=f"M={M} w={w_dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", RSTD_N)
def test_rstd_matches(N: int, dtype: str) -> None:
    tdtype = TORCH_DTYPES[dtype]
    x = rand((37, N), tdtype, seed=3)
    w = _weight(N, dtype, seed=4)
    poison_allocator(37, torch.float32)
    y, rstd = rmsnorm_fwd(x, w, 1e-6, store_rstd=True)
    ref_rstd = torch.rsqrt(x.double().square().mean(-1) + 1e-6).float()
    torch.testing.assert_close(rstd, ref_rstd, rtol=1e-5, atol=0)
    torch.testing.assert_close(y, rmsnorm_ref(x, w, 1e-6), **FWD_TOL[tdtype])


def test_eps_is_honoured() -> None:
    x = rand((64, 4096), torch.float32, seed=5, scale=0.05)  # small rms: eps matters
    w = _weight(4096, "f32", seed=6)
    small, large = kbuild.rmsnorm(x, w, eps=1e-6), kbuild.rmsnorm(x, w, eps=1e-2)
    torch.testing.assert_close(small, rmsnorm_ref(x, w, 1e-6), **FWD_TOL[torch.float32])
    torch.testing.assert_close(large, rmsnorm_ref(x, w, 1e-2), **FWD_TOL[torch.float32])
    assert (small - large).abs().max() > 0.1


def test_unaligned_and_strided_inputs() -> None:
    N = 4096
    base = rand((9 * N + 1,), torch.bfloat16, seed=7)
    x = base[1:].view(9, N)  # 2 bytes past a 16-byte boundary: the scalar kernel
    assert x.data_ptr() % 16 != 0
    w = _weight(N, "bf16", seed=8)
    torch.testing.assert_close(
        kbuild.rmsnorm(x, w), rmsnorm_ref(x, w, 1e-6), **FWD_TOL[torch.bfloat16]
    )
    xt = rand((N, 6), torch.bfloat16, seed=9).t()  # non-contiguous (6, N)
    torch.testing.assert_close(
        kbuild.rmsnorm(xt, w), rmsnorm_ref(xt, w, 1e-6), **FWD_TOL[torch.bfloat16]
    )
    x3 = rand((2, 3, N), torch.bfloat16, seed=10)
    assert kbuild.rmsnorm(x3, w).shape == (2, 3, N)


def test_beyond_2_31_elements() -> None:
    """64-bit offsets: rows past element 2^31 are normalised, not wrapped onto earlier rows."""
    N = 4096
    M = (2**31) // N + 64
    x = torch.empty((M, N), dtype=torch.bfloat16, device="cuda")
    x[:-128].fill_(1.0)
    x[-128:] = rand((128, N), torch.bfloat16, seed=11)
    w = _weight(N, "bf16", seed=12)
    y = kbuild.rmsnorm(x, w)
    torch.testing.assert_close(y[-128:], rmsnorm_ref(x[-128:], w, 1e-6), **FWD_TOL[torch.bfloat16])
    torch.testing.assert_close(y[:4], rmsnorm_ref(x[:4], w, 1e-6), **FWD_TOL[torch.bfloat16])


def test_current_device_guard_single_gpu() -> None:
    """Called inside another device's context manager it still lands on x's device."""
    x = rand((5, 4096), torch.bfloat16, seed=13)
    w = _weight(4096, "bf16", seed=14)
    with torch.cuda.device(0):
        y = kbuild.rmsnorm(x, w)
    torch.testing.assert_close(y, rmsnorm_ref(x, w, 1e-6), **FWD_TOL[torch.bfloat16])
