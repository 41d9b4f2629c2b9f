"""LayerNorm on tensors: specs, launches, and the torch reference (see kernels/norms/rmsnorm.py for
the conventions: contiguous (..., N) CUDA tensors seen as (M, N) rows)."""

from __future__ import annotations

import torch

from ...op.launch import launch_persistent, launch_rows
from ...op.tensors import DTYPE_NAMES, aligned, data_ptrs, dtype_name, empty_row_stats, row_count
from .kernels import LAYERNORM_BWD, LAYERNORM_FWD

# The specs, by the kernel table (see kernels/norms/rmsnorm.py).
layernorm_fwd_spec = LAYERNORM_FWD.spec
layernorm_bwd_spec = LAYERNORM_BWD.spec


def layernorm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    store_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(y, mean, rstd); mean and rstd are (M,) fp32 when `store_stats`, else None."""
    N = x.shape[-1]
    M = x.numel() // N if N else row_count(x)
    y = torch.empty_like(x)
    stats = [torch.empty(M, dtype=torch.float32, device=x.device) for _ in range(2)]
    mean, rstd = stats if store_stats else (None, None)
    if M == 0 or N == 0:
        return y, empty_row_stats(mean), empty_row_stats(rstd)
    ptrs = data_ptrs(x, weight, bias, y)
    values = (
        N,
        DTYPE_NAMES[x.dtype],
        dtype_name(weight),
        dtype_name(bias),
        store_stats,
        eps,
        aligned(*ptrs),
    )
    launch_rows(LAYERNORM_FWD, values, x.get_device(), M, ptrs + data_ptrs(mean, rstd))
    return y, mean, rstd


def layernorm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    need_dw: bool,
    bias: torch.Tensor | None,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dw or None, db or None); dw/db in the parameters' dtypes."""
    N = x.shape[-1]
    M = x.numel() // N if N else 0
    compute_dw = need_dw and weight is not None
    compute_db = need_db and bias is not None
    dx = torch.empty_like(x)
    device = x.get_device()
    ptrs = data_ptrs(x, weight, dy, mean, rstd, dx)
    values = (N, DTYPE_NAMES[x.dtype], dtype_name(weight), compute_dw, compute_db, aligned(*ptrs))
    dw, db = launch_persistent(
        LAYERNORM_BWD,
        values,
        device,
        M,
        N,
        ptrs,
        weight if compute_dw else None,
        bias if compute_db else None,
    )
    return dx, dw, db


def layernorm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch, fp32, centred variance, differentiable: (y, mean, rstd)."""
    xf = x.float()
    mean = xf.mean(-1)
    centred = xf - mean.unsqueeze(-1)
    rstd = torch.rsqrt(centred.square().mean(-1) + eps)
    y = centred * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mean, rstd


def layernorm_bwd_reference(dy, x, weight, mean, rstd):
    """The backward formulas of kernels/layernorm.py in plain torch (fp32): (dx, dw, db)."""
    N = x.shape[-1]
    x_hat = (x.float() - mean.reshape(*x.shape[:-1], 1)) * rstd.reshape(*x.shape[:-1], 1)
    wdy = dy.float() * (weight.float() if weight is not None else 1.0)
    c1 = wdy.mean(-1, keepdim=True)
    c2 = (wdy * x_hat).mean(-1, keepdim=True)
    dx = (wdy - c1 - x_hat * c2) * rstd.reshape(*x.shape[:-1], 1)
    flat_dy, flat_xhat = dy.float().reshape(-1, N), x_hat.reshape(-1, N)
    return dx.to(x.dtype), (flat_dy * flat_xhat).sum(0), flat_dy.sum(0)
