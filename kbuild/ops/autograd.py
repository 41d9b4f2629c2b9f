"""Autograd for the norms: torch.autograd.Functions for eager mode, and the same forward and
backward registered as torch.library custom ops so torch.compile(fullgraph=True) traces them.

Both routes call one pair of functions per norm (`_rmsnorm_backward`, ...), so eager and
compiled training compute the same gradients with the same kernels. What is saved for
backward: the kernel's input (x, or residual_out for the fused form), the weight and the
per-row fp32 rstd; nothing at all when no input needs a gradient.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .common import contiguous, device_guard, row_count
from .layernorm import layernorm_bwd, layernorm_bwd_reference, layernorm_fwd, layernorm_reference
from .rmsnorm import (
    fused_add_rmsnorm_bwd,
    fused_add_rmsnorm_fwd,
    rmsnorm_bwd,
    rmsnorm_bwd_reference,
    rmsnorm_fwd,
    rmsnorm_reference,
)

# ----------------------------------------------------------------------------- shared backward


def _rmsnorm_backward(saved, needs, dy):
    x, weight, rstd = saved
    if not dy.is_cuda:
        dx, dw = rmsnorm_bwd_reference(dy, x, weight, rstd)
        return (dx.to(x.dtype) if needs[0] else None), (dw if needs[1] else None)
    with device_guard(dy):
        dx, dw = rmsnorm_bwd(dy.contiguous(), x, weight, rstd, needs[1])
    return (dx if needs[0] else None), dw


def _fused_backward(saved, needs, dy, dresidual_out):
    residual_out, weight, rstd = saved
    dres = None if dresidual_out is None else dresidual_out.contiguous()
    if not dy.is_cuda:
        dsum, dw = rmsnorm_bwd_reference(dy, residual_out, weight, rstd)
        dsum = (dsum if dres is None else dsum + dres.float()).to(dy.dtype)
        dw = dw if needs[2] else None
    else:
        with device_guard(dy):
            dsum, dw = fused_add_rmsnorm_bwd(
                dy.contiguous(), dres, residual_out, weight, rstd, needs[2]
            )
    # added = x + residual: one gradient serves both inputs.
    return (dsum if needs[0] else None), (dsum if needs[1] else None), dw


# ----------------------------------------------------------------------------- eager


class RMSNormFunction(torch.autograd.Function):
    """y = rmsnorm(x) * weight on a contiguous CUDA x; saves x, weight and rstd."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        with device_guard(x):
            y, rstd = rmsnorm_fwd(x, weight, eps, store_rstd=True)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable  # the kernels' backward has no graph of its own: no double backward
    def backward(ctx, dy):
        dx, dw = _rmsnorm_backward(ctx.saved_tensors, ctx.needs_input_grad, dy)
        return dx, dw, None


class FusedAddRMSNormFunction(torch.autograd.Function):
    """(y, residual_out) = (rmsnorm(x + residual) * weight, x + residual)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, residual_dtype):
        with device_guard(x):
            y, residual_out, rstd = fused_add_rmsnorm_fwd(
                x, residual, weight, eps, residual_dtype, store_rstd=True
            )
        ctx.save_for_backward(residual_out, weight, rstd)
        ctx.out_dtype = y.dtype
        ctx.set_materialize_grads(False)  # an unused residual_out has no gradient to add
        return y, residual_out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dresidual_out):
        if dy is None:
            dy = torch.zeros_like(ctx.saved_tensors[0], dtype=ctx.out_dtype)
        return (
            *_fused_backward(ctx.saved_tensors, ctx.needs_input_grad, dy, dresidual_out),
            None,
            None,
        )


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("kbuild::rmsnorm_fwd", mutates_args=())
def rmsnorm_fwd_op(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, store_rstd: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd); rstd is (M,) fp32 when `store_rstd`, else empty."""
    if not x.is_cuda:
        y, rstd = rmsnorm_reference(x, weight, eps)
        return y, rstd.reshape(-1) if store_rstd else rstd.new_empty(0)
    with device_guard(x):
        y, rstd = rmsnorm_fwd(x, weight, eps, store_rstd)
    return y, rstd if rstd is not None else x.new_empty(0, dtype=torch.float32)


@rmsnorm_fwd_op.register_fake
def _(x, weight, eps, store_rstd):
    rows = row_count(x) if store_rstd else 0
    return torch.empty_like(x), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("kbuild::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw); dw is empty unless `need_dw` and a weight is given."""
    dx, dw = _rmsnorm_backward((x, weight, rstd), (need_dx, need_dw), dy)
    return (dx if dx is not None else x.new_empty(0)), (dw if dw is not None else x.new_empty(0))


@rmsnorm_bwd_op.register_fake
def _(dy, x, weight, rstd, need_dx, need_dw):
    dw = torch.empty_like(weight) if need_dw and weight is not None else x.new_empty(0)
    return (torch.empty_like(x) if need_dx else x.new_empty(0)), dw


def _rmsnorm_setup(ctx, inputs, output):
    x, weight, _, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rmsnorm_op_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and weight is not None
    dx, dw = rmsnorm_bwd_op(dy, x, weight, rstd, need_dx, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None, None


rmsnorm_fwd_op.register_autograd(_rmsnorm_op_backward, setup_context=_rmsnorm_setup)


@torch.library.custom_op("kbuild::fused_add_rmsnorm_fwd", mutates_args=())
def fused_add_rmsnorm_fwd_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual_dtype: torch.dtype,
    store_rstd: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, residual_out, rstd); rstd empty unless `store_rstd`."""
    if not x.is_cuda:
        added = (x.float() + residual.float()).to(residual_dtype)
        y, rstd = rmsnorm_reference(added, weight, eps)
        return y.to(x.dtype), added, rstd.reshape(-1) if store_rstd else rstd.new_empty(0)
    with device_guard(x):
        y, res, rstd = fused_add_rmsnorm_fwd(
            contiguous(x), contiguous(residual), weight, eps, residual_dtype, store_rstd
        )
    return y, res, rstd if rstd is not None else x.new_empty(0, dtype=torch.float32)


@fused_add_rmsnorm_fwd_op.register_fake
def _(x, residual, weight, eps, residual_dtype, store_rstd):
    rows = row_count(x) if store_rstd else 0
    return (
        x.new_empty(x.shape),
        x.new_empty(x.shape, dtype=residual_dtype),
        x.new_empty(rows, dtype=torch.float32),
    )


@torch.library.custom_op("kbuild::fused_add_rmsnorm_bwd", mutates_args=())
def fused_add_rmsnorm_bwd_op(
    dy: torch.Tensor,
    dresidual_out: torch.Tensor | None,
    residual_out: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d(x + residual), dw); dw empty unless `need_dw` and a weight is given."""
    saved = (residual_out, weight, rstd)
    dsum, _, dw = _fused_backward(saved, (True, False, need_dw), dy, dresidual_out)
    return dsum, dw if dw is not None else dy.new_empty(0)


@fused_add_rmsnorm_bwd_op.register_fake
def _(dy, dresidual_out, residual_out, weight, rstd, need_dw):
    dw = torch.empty_like(weight) if need_dw and weight is not None else dy.new_empty(0)
    return dy.new_empty(dy.shape), dw


def _fused_setup(ctx, inputs, output):
    _, _, weight, _, _, _ = inputs
    ctx.save_for_backward(output[1], weight, output[2])


def _fused_op_backward(ctx, dy, dresidual_out, _drstd):
    residual_out, weight, rstd = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[2] and weight is not None
    dsum, dw = fused_add_rmsnorm_bwd_op(dy, dresidual_out, residual_out, weight, rstd, need_dw)
    # added = x + residual: one gradient, written once, serves both inputs.
    dx = dsum if ctx.needs_input_grad[0] else None
    dres = dsum if ctx.needs_input_grad[1] else None
    return dx, dres, (dw if need_dw else None), None, None, None


fused_add_rmsnorm_fwd_op.register_autograd(_fused_op_backward, setup_context=_fused_setup)


# ----------------------------------------------------------------------------- layernorm


def _layernorm_backward(saved, needs, dy):
    """needs: (x, weight, bias) need grads."""
    x, weight, bias, mean, rstd = saved
    if not dy.is_cuda:
        dx, dw, db = layernorm_bwd_reference(dy, x, weight, mean, rstd)
        dw = dw.to(weight.dtype) if needs[1] and weight is not None else None
        db = db.to(bias.dtype) if needs[2] and bias is not None else None
        return (dx if needs[0] else None), dw, db
    with device_guard(dy):
        dx, dw, db = layernorm_bwd(dy.contiguous(), x, weight, mean, rstd, needs[1], bias, needs[2])
    return (dx if needs[0] else None), dw, db


class LayerNormFunction(torch.autograd.Function):
    """y = layernorm(x) * weight + bias on a contiguous CUDA x; saves x, weight, mean, rstd."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        with device_guard(x):
            y, mean, rstd = layernorm_fwd(x, weight, bias, eps, store_stats=True)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        return (*_layernorm_backward(ctx.saved_tensors, ctx.needs_input_grad, dy), None)


@torch.library.custom_op("kbuild::layernorm_fwd", mutates_args=())
def layernorm_fwd_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    store_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd); mean and rstd are (M,) fp32 when `store_stats`, else empty."""
    if not x.is_cuda:
        y, mean, rstd = layernorm_reference(x, weight, bias, eps)
        if not store_stats:
            return y, mean.new_empty(0), rstd.new_empty(0)
        return y, mean.reshape(-1), rstd.reshape(-1)
    with device_guard(x):
        y, mean, rstd = layernorm_fwd(x, weight, bias, eps, store_stats)
    if mean is None:
        mean = rstd = x.new_empty(0, dtype=torch.float32)
    return y, mean, rstd


@layernorm_fwd_op.register_fake
def _(x, weight, bias, eps, store_stats):
    rows = row_count(x) if store_stats else 0
    return torch.empty_like(x), *(x.new_empty(rows, dtype=torch.float32) for _ in range(2))


@torch.library.custom_op("kbuild::layernorm_bwd", mutates_args=())
def layernorm_bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db); each empty unless asked for (and its parameter given)."""
    saved = (x, weight, bias, mean, rstd)
    grads = _layernorm_backward(saved, (need_dx, need_dw, need_db), dy)
    return tuple(g if g is not None else x.new_empty(0) for g in grads)


@layernorm_bwd_op.register_fake
def _(dy, x, weight, bias, mean, rstd, need_dx, need_dw, need_db):
    dx = torch.empty_like(x) if need_dx else x.new_empty(0)
    dw = torch.empty_like(weight) if need_dw and weight is not None else x.new_empty(0)
    db = torch.empty_like(bias) if need_db and bias is not None else x.new_empty(0)
    return dx, dw, db


def _layernorm_setup(ctx, inputs, output):
    x, weight, bias, _, _ = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])


def _layernorm_op_backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_dw, need_db = need[1] and weight is not None, need[2] and bias is not None
    dx, dw, db = layernorm_bwd_op(dy, x, weight, bias, mean, rstd, need[0], need_dw, need_db)
    return (
        (dx if need[0] else None),
        (dw if need_dw else None),
        (db if need_db else None),
        None,
        None,
    )


layernorm_fwd_op.register_autograd(_layernorm_op_backward, setup_context=_layernorm_setup)
