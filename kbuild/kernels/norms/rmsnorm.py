"""RMSNorm and fused add + RMSNorm on tensors: specs, launches, and the torch reference.

Launch functions take contiguous (..., N) CUDA tensors, seen as (M, N) rows with
M = numel // N (no reshapes: each costs microseconds at small shapes); the public API in
kbuild/kernels/norms/api.py checks arguments and makes inputs contiguous before anything here runs.
RMSNorm's x may also be a strided view whose rows the kernels read in place
(common.readable_rows: the (B, T, H, D) q or k of a fused qkv projection); y and dx are
dense.
Each launch gives the kernel table's parameter values in its order (kbuild/registry.py)
and the pointers in its argument order; the *_spec names are the table's spec functions,
which warmup manifests call too, so a warmed cache holds exactly the kernels launched here.
"""

from __future__ import annotations

import torch

from ...op.launch import launch_persistent, launch_rows, launcher_for, rows_grid
from ...op.tensors import (
    DTYPE_NAMES,
    aligned,
    data_ptrs,
    dtype_name,
    empty_row_stats,
    row_count,
    rows_to_read,
    stream_of,
)
from .kernels import FUSED_ADD_RMSNORM_BWD, FUSED_ADD_RMSNORM_FWD, RMSNORM_BWD, RMSNORM_FWD

# The specs, by the kernel table (positional in its order: N, dtypes, flags, eps, vectorize);
# warmup manifests call these with the shapes the tests and benchmarks use.
rmsnorm_fwd_spec = RMSNORM_FWD.spec
rmsnorm_bwd_spec = RMSNORM_BWD.spec
fused_add_rmsnorm_fwd_spec = FUSED_ADD_RMSNORM_FWD.spec
fused_add_rmsnorm_bwd_spec = FUSED_ADD_RMSNORM_BWD.spec


def rmsnorm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    store_rstd: bool,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y = x * rstd * (offset + weight); rstd (M,) fp32 when `store_rstd` (for the backward).

    The launch path where host microseconds show (inference at small shapes), so it is
    written flat, without the list helpers the other launches use (3.5 us less per call).
    """
    N = x.shape[-1]
    M = x.numel() // N if N else row_count(x)
    # A strided x's rows are read in place: (x_group, x_stride, x_group_magic) after M.
    x, layout = (x, None) if x.is_contiguous() else rows_to_read(x)
    y = torch.empty_like(x)  # dense: x is contiguous, or not dense at all
    rstd = torch.empty(M, dtype=torch.float32, device=x.device) if store_rstd else None
    if M == 0 or N == 0:
        return y, empty_row_stats(rstd)
    device = x.get_device()
    xp, yp = x.data_ptr(), y.data_ptr()
    if weight is None:
        ptrs, w_name, is_aligned = (xp, yp), None, not (xp | yp) & 15
    else:
        wp = weight.data_ptr()
        ptrs, w_name, is_aligned = (xp, wp, yp), DTYPE_NAMES[weight.dtype], not (xp | yp | wp) & 15
    if rstd is not None:
        ptrs += (rstd.data_ptr(),)  # the table's order: x, [weight], y, [rstd]
    if layout is None:
        values = (N, DTYPE_NAMES[x.dtype], w_name, store_rstd, eps, is_aligned, offset)
        launcher = launcher_for(RMSNORM_FWD, device, values)
        launcher(rows_grid(launcher, M), stream_of(device), *ptrs, M)
        return y, rstd
    is_aligned = is_aligned and aligned(layout[1] * x.element_size())
    values = (N, DTYPE_NAMES[x.dtype], w_name, store_rstd, eps, is_aligned, offset, True)
    launcher = launcher_for(RMSNORM_FWD, device, values)
    launcher(rows_grid(launcher, M), stream_of(device), *ptrs, M, *layout)
    return y, rstd


def rmsnorm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    need_dw: bool,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dx (x's dtype) and, when `need_dw`, dw (weight's dtype) for
    y = rmsnorm(x) * (offset + weight)."""
    return _backward(dy, None, x, weight, rstd, need_dw, offset, fused=False)


def fused_add_rmsnorm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual_dtype: torch.dtype,
    store_rstd: bool,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(y, residual_out = x + residual in `residual_dtype`, rstd or None). The residual is of
    x's dtype or, continuing an fp32 stream, fp32 (then `residual_dtype` is fp32 too)."""
    N = x.shape[-1]
    M = x.numel() // N if N else row_count(x)
    y = torch.empty_like(x)
    residual_out = torch.empty_like(x, dtype=residual_dtype)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device) if store_rstd else None
    if M == 0 or N == 0:
        return y, residual_out, empty_row_stats(rstd)
    ptrs = data_ptrs(x, residual, weight, y, residual_out)
    values = (
        N,
        DTYPE_NAMES[x.dtype],
        dtype_name(weight),
        DTYPE_NAMES[residual_dtype],
        store_rstd,
        eps,
        aligned(*ptrs),
        offset,
        None if residual.dtype == x.dtype else DTYPE_NAMES[residual.dtype],
    )
    launch_rows(FUSED_ADD_RMSNORM_FWD, values, x.get_device(), M, ptrs + data_ptrs(rstd))
    return y, residual_out, rstd


def fused_add_rmsnorm_bwd(
    dy: torch.Tensor,
    dresidual_out: torch.Tensor | None,
    residual_out: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    need_dw: bool,
    offset: float = 0.0,
    residual_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(d(x + residual) in dy's dtype: both dx and dresidual, the same d(residual) in
    `residual_dtype` when given (an fp32 residual stream's gradient, not rounded to dy's
    dtype) else None, dw when asked)."""
    if residual_dtype not in (None, torch.float32):
        raise TypeError(f"residual_dtype must be None or torch.float32, got {residual_dtype}")
    return _backward(
        dy, dresidual_out, residual_out, weight, rstd, need_dw, offset, True, residual_dtype
    )


def _backward(
    dy, dres, x, weight, rstd, need_dw: bool, offset: float, fused: bool, dres_dtype=None
):
    """The launch behind both backward passes (x is residual_out in the fused form)."""
    N = dy.shape[-1]
    M = dy.numel() // N if N else 0
    compute_dw = need_dw and weight is not None
    dx = torch.empty_like(dy)
    dres_in = None if dres_dtype is None else torch.empty_like(dy, dtype=dres_dtype)
    device = dy.get_device()
    # RMSNorm's x may be read in place at a two-level stride (the forward's input, as saved;
    # a copy, as the forward made, of one whose rows are not: kbuild::rmsnorm_fwd by name).
    x, layout = (x, None) if fused else rows_to_read(x)
    ptrs = data_ptrs(x, weight, dy, rstd, dres, dx, dres_in)
    is_aligned = aligned(*ptrs, *(() if layout is None else (layout[1] * x.element_size(),)))
    if fused:
        kernel = FUSED_ADD_RMSNORM_BWD
        values = (N, DTYPE_NAMES[dy.dtype], dtype_name(weight), DTYPE_NAMES[x.dtype])
        values += (dres is not None, compute_dw, is_aligned, offset, dtype_name(dres_in))
    else:
        kernel = RMSNORM_BWD
        values = (N, DTYPE_NAMES[x.dtype], dtype_name(weight), compute_dw, is_aligned, offset)
        values += () if layout is None else (True,)
    wanted = weight if compute_dw else None
    dw = launch_persistent(kernel, values, device, M, N, ptrs, wanted, layout=layout)
    return (dx, dres_in, dw) if fused else (dx, dw)


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, fp32 math, differentiable: what CPU tensors run, and the kernels' contract.
    The offset is added to the weight in fp32 (a bf16 1 + w would round w away)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    y = xf * rstd.unsqueeze(-1)
    if weight is not None:
        w = weight.float()
        y = y * (w + offset if offset else w)  # no add of 0 in a traced graph (torch.compile)
    return y.to(x.dtype), rstd


def rmsnorm_bwd_reference(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backward formulas of kernels/rmsnorm_bwd.py in plain torch (fp32): (dx fp32, dw)."""
    rstd = rstd.reshape(*x.shape[:-1], 1)
    x_hat = x.float() * rstd
    wdy = dy.float() * (weight.float() + offset if weight is not None else 1.0)
    c1 = (x_hat * wdy).mean(-1, keepdim=True)
    dx = (wdy - x_hat * c1) * rstd
    dw = None
    if weight is not None:
        dw = (dy.float() * x_hat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx, dw
