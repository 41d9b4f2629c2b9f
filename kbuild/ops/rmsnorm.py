"""RMSNorm and fused add + RMSNorm on tensors: specs, launches, and the torch reference.

Launch functions take contiguous (..., N) CUDA tensors, seen as (M, N) rows with
M = numel // N (no reshapes: each costs microseconds at small shapes); the public API in
kbuild/ops/api.py checks arguments and makes inputs contiguous before anything here runs.
The *_spec functions are also what warmup manifests call, so a warmed cache holds exactly
the kernels these launches ask for.
"""

from __future__ import annotations

import torch

from ..jit import get_launcher, loaded
from ..spec import KernelSpec
from .common import (
    DTYPE_NAMES,
    aligned,
    data_ptrs,
    dtype_name,
    empty_row_stats,
    row_count,
    stream_of,
)
from .launch import launch_persistent, launch_rows, rows_grid, vectorizable


def rmsnorm_fwd_spec(
    N: int,
    dtype: str,
    weight_dtype: str | None,
    store_rstd: bool,
    eps: float,
    is_aligned: bool = True,
) -> KernelSpec:
    return KernelSpec.make(
        "rmsnorm_fwd",
        N=N,
        dtype=dtype,
        weight_dtype=weight_dtype,
        store_rstd=store_rstd,
        eps=float(eps),
        vectorize=vectorizable(N, (dtype,), is_aligned),
    )


def rmsnorm_bwd_spec(
    N: int, dtype: str, weight_dtype: str | None, compute_dw: bool, is_aligned: bool = True
) -> KernelSpec:
    return KernelSpec.make(
        "rmsnorm_bwd",
        N=N,
        dtype=dtype,
        weight_dtype=weight_dtype,
        compute_dw=compute_dw and weight_dtype is not None,
        vectorize=vectorizable(N, (dtype,), is_aligned),
    )


def fused_add_rmsnorm_fwd_spec(
    N: int,
    dtype: str,
    weight_dtype: str | None,
    residual_dtype: str,
    store_rstd: bool,
    eps: float,
    is_aligned: bool = True,
) -> KernelSpec:
    return KernelSpec.make(
        "fused_add_rmsnorm_fwd",
        N=N,
        dtype=dtype,
        weight_dtype=weight_dtype,
        residual_dtype=residual_dtype,
        store_rstd=store_rstd,
        eps=float(eps),
        vectorize=vectorizable(N, (dtype, residual_dtype), is_aligned),
    )


def fused_add_rmsnorm_bwd_spec(
    N: int,
    dtype: str,
    weight_dtype: str | None,
    residual_dtype: str,
    has_dresidual_out: bool,
    compute_dw: bool,
    is_aligned: bool = True,
) -> KernelSpec:
    return KernelSpec.make(
        "fused_add_rmsnorm_bwd",
        N=N,
        dtype=dtype,
        weight_dtype=weight_dtype,
        residual_dtype=residual_dtype,
        has_dresidual_out=has_dresidual_out,
        compute_dw=compute_dw and weight_dtype is not None,
        vectorize=vectorizable(N, (dtype, residual_dtype), is_aligned),
    )


def rmsnorm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, store_rstd: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y = x * rstd * weight; rstd (M,) fp32 when `store_rstd` (for the backward pass).

    The one launch path where host microseconds show (inference at small shapes), so it is
    written flat: one dict lookup for the loaded kernel, no closures or lists on a hit.
    """
    N = x.shape[-1]
    M = x.numel() // N if N else row_count(x)
    y = torch.empty_like(x)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device) if store_rstd else None
    if M == 0 or N == 0:
        return y, empty_row_stats(rstd)
    device = x.get_device()
    xp, yp = x.data_ptr(), y.data_ptr()
    wp = 0 if weight is None else weight.data_ptr()
    is_aligned = not (xp | yp | wp) & 15
    w_dtype = None if weight is None else weight.dtype
    key = ("rmsnorm_fwd", N, x.dtype, w_dtype, store_rstd, eps, is_aligned, device)
    launcher = loaded(key)
    if launcher is None:
        launcher = get_launcher(
            key,
            device,
            lambda: rmsnorm_fwd_spec(
                N, dtype_name(x), dtype_name(weight), store_rstd, eps, is_aligned
            ),
        )
    grid = rows_grid(launcher, M)
    stream = stream_of(device)
    if weight is None and rstd is None:
        launcher(grid, stream, xp, yp, M)
    elif rstd is None:
        launcher(grid, stream, xp, wp, yp, M)
    elif weight is None:
        launcher(grid, stream, xp, yp, rstd.data_ptr(), M)
    else:
        launcher(grid, stream, xp, wp, yp, rstd.data_ptr(), M)
    return y, rstd


def rmsnorm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dx (x's dtype) and, when `need_dw`, dw (weight's dtype) for y = rmsnorm(x) * weight."""
    return _backward(dy, None, x, weight, rstd, need_dw, fused=False)


def fused_add_rmsnorm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual_dtype: torch.dtype,
    store_rstd: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(y, residual_out = x + residual in `residual_dtype`, rstd or None)."""
    N = x.shape[-1]
    M = x.numel() // N if N else row_count(x)
    y = torch.empty_like(x)
    residual_out = torch.empty_like(x, dtype=residual_dtype)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device) if store_rstd else None
    if M == 0 or N == 0:
        return y, residual_out, empty_row_stats(rstd)
    device = x.get_device()
    ptrs = data_ptrs(x, residual, weight, y, residual_out)
    is_aligned = aligned(*ptrs)
    w_dtype = None if weight is None else weight.dtype
    key = ("fused_add_rmsnorm_fwd", N, x.dtype, w_dtype, residual_dtype, store_rstd, eps)
    launch_rows(
        (*key, is_aligned, device),
        lambda: fused_add_rmsnorm_fwd_spec(
            N,
            dtype_name(x),
            dtype_name(weight),
            DTYPE_NAMES[residual_dtype],
            store_rstd,
            eps,
            is_aligned,
        ),
        device,
        stream_of(device),
        M,
        *ptrs,
        *data_ptrs(rstd),
    )
    return y, residual_out, rstd


def fused_add_rmsnorm_bwd(
    dy: torch.Tensor,
    dresidual_out: torch.Tensor | None,
    residual_out: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """d(x + residual), in dy's dtype (it is both dx and dresidual), and dw when asked."""
    return _backward(dy, dresidual_out, residual_out, weight, rstd, need_dw, fused=True)


def _backward(dy, dres, x, weight, rstd, need_dw: bool, fused: bool):
    """The one launch behind both backward passes (x is residual_out in the fused form)."""
    N = dy.shape[-1]
    M = dy.numel() // N if N else 0
    compute_dw = need_dw and weight is not None
    dx = torch.empty_like(dy)
    device = dy.get_device()
    ptrs = data_ptrs(x, weight, dy, rstd, dres, dx)
    is_aligned = aligned(*ptrs)
    w_dtype = None if weight is None else weight.dtype
    has_dres = dres is not None

    def spec() -> KernelSpec:
        if not fused:
            return rmsnorm_bwd_spec(N, dtype_name(x), dtype_name(weight), compute_dw, is_aligned)
        return fused_add_rmsnorm_bwd_spec(
            N, dtype_name(dy), dtype_name(weight), dtype_name(x), has_dres, compute_dw, is_aligned
        )

    key = (fused, N, dy.dtype, x.dtype, w_dtype, has_dres, compute_dw, is_aligned, device)
    dw = launch_persistent(
        ("fused_add_rmsnorm_bwd" if fused else "rmsnorm_bwd", *key),
        spec,
        device,
        M,
        N,
        ptrs,
        weight if compute_dw else None,
    )
    return dx, dw


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, fp32 math, differentiable: what CPU tensors run, and the kernels' contract."""
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    y = xf * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype), rstd


def rmsnorm_bwd_reference(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backward formulas of kernels/rmsnorm_bwd.py in plain torch (fp32): (dx fp32, dw)."""
    rstd = rstd.reshape(*x.shape[:-1], 1)
    x_hat = x.float() * rstd
    wdy = dy.float() * (weight.float() if weight is not None else 1.0)
    c1 = (x_hat * wdy).mean(-1, keepdim=True)
    dx = (wdy - x_hat * c1) * rstd
    dw = None
    if weight is not None:
        dw = (dy.float() * x_hat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx, dw
