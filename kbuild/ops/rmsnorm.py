"""RMSNorm on tensors: specs, launches and the torch reference used on CPU.

Launch functions take contiguous (..., N) CUDA tensors, seen as (M, N) rows with
M = numel // N (no reshapes: each costs microseconds at small shapes); the public API in
kbuild/ops/api.py checks arguments and makes inputs contiguous before anything here runs.
"""

from __future__ import annotations

import torch

from ..jit import get_launcher
from ..spec import KernelSpec
from .common import DTYPE_NAMES, aligned, stream_of


def _vectorize(N: int, dtype: str, is_aligned: bool) -> bool:
    from ..dtypes import ELEMENT_BYTES

    return is_aligned and N % (16 // ELEMENT_BYTES[dtype]) == 0


def rmsnorm_fwd_spec(
    N: int, dtype: str, weight_dtype: str | None, store_rstd: bool, eps: float, is_aligned: bool = True
) -> KernelSpec:
    """The forward kernel for these parameters (warmup manifests use the same function)."""
    return KernelSpec.make(
        "rmsnorm_fwd",
        N=N,
        dtype=dtype,
        weight_dtype=weight_dtype,
        store_rstd=store_rstd,
        eps=float(eps),
        vectorize=_vectorize(N, dtype, is_aligned),
    )


def rmsnorm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, store_rstd: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y = x * rstd * weight on a contiguous CUDA tensor; rstd (M,) fp32 when `store_rstd`."""
    N = x.shape[-1]
    M = x.numel() // N if N else 0
    y = torch.empty_like(x)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device) if store_rstd else None
    if M == 0:
        return y, rstd
    device = x.get_device()
    args = [x.data_ptr()]
    if weight is not None:
        args.append(weight.data_ptr())
    args.append(y.data_ptr())
    is_aligned = aligned(*args)
    if rstd is not None:
        args.append(rstd.data_ptr())
    args.append(M)
    w_dtype = weight.dtype if weight is not None else None
    key = ("rmsnorm_fwd", N, x.dtype, w_dtype, store_rstd, eps, is_aligned, device)
    launcher = get_launcher(
        key,
        device,
        lambda: rmsnorm_fwd_spec(
            N, DTYPE_NAMES[x.dtype], DTYPE_NAMES.get(w_dtype), store_rstd, eps, is_aligned
        ),
    )
    launcher(-(-M // launcher.rows_per_block), stream_of(device), *args)
    return y, rstd


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, fp32 math: what CPU tensors run, and the kernels' contract."""
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    y = xf * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype), rstd
