"""Autograd for the norms on the Python launch path: torch.autograd.Functions for eager mode
(used where the C++ extension is unavailable), and the backward functions that the kbuild::*
operators' CPU kernels and Python CUDA kernels share (kernels/norms/custom_ops.py).

Every route through the operators calls one backward function per norm (`_rmsnorm_backward`,
...), so eager and compiled training compute the same gradients with the same kernels (plain
RMSNorm under torch.compile excepted: api.py traces its torch math). What is saved for
backward: the kernel's input (x, or residual_out for the fused form), the weight and the
per-row fp32 rstd; nothing at all when no input needs a gradient.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...op.tensors import device_guard, on_gpu
from .layernorm import layernorm_bwd, layernorm_bwd_reference, layernorm_fwd
from .rmsnorm import (
    fused_add_rmsnorm_bwd,
    fused_add_rmsnorm_fwd,
    rmsnorm_bwd,
    rmsnorm_bwd_reference,
    rmsnorm_fwd,
)

# ----------------------------------------------------------------------------- shared backward


def _rmsnorm_backward(saved, needs, dy, offset: float = 0.0):
    x, weight, rstd = saved
    if not on_gpu(dy):
        dx, dw = rmsnorm_bwd_reference(dy, x, weight, rstd, offset)
        return (dx.to(x.dtype) if needs[0] else None), (dw if needs[1] else None)
    with device_guard(dy):
        dx, dw = rmsnorm_bwd(dy.contiguous(), x, weight, rstd, needs[1], offset)
    return (dx if needs[0] else None), dw


def _fused_backward(saved, needs, dy, dresidual_out, offset=0.0, residual_dtype=None):
    """(dx, dresidual, dw). `residual_dtype`: the residual's dtype where it is not x's (an fp32
    stream), whose gradient then comes in that dtype, not rounded to x's."""
    residual_out, weight, rstd = saved
    dres = None if dresidual_out is None else dresidual_out.contiguous()
    if not needs[1]:
        residual_dtype = None  # no residual gradient wanted: no fp32 copy written either
    if not on_gpu(dy):
        dsum, dw = rmsnorm_bwd_reference(dy, residual_out, weight, rstd, offset)
        dsum = dsum if dres is None else dsum + dres.float()
        dres_in = None if residual_dtype is None else dsum.to(residual_dtype)
        dsum = dsum.to(dy.dtype)
        dw = dw if needs[2] else None
    else:
        with device_guard(dy):
            dsum, dres_in, dw = fused_add_rmsnorm_bwd(
                dy.contiguous(), dres, residual_out, weight, rstd, needs[2], offset, residual_dtype
            )
    # added = x + residual: one gradient serves both inputs (written twice for an fp32 stream).
    dres_in = dsum if dres_in is None else dres_in
    return (dsum if needs[0] else None), (dres_in if needs[1] else None), dw


# ----------------------------------------------------------------------------- eager


class RMSNormFunction(torch.autograd.Function):
    """y = rmsnorm(x) * (offset + weight) on a CUDA x of readable rows (contiguous, or a
    strided view read in place: common.readable_rows); saves x, weight and rstd."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset=0.0):
        with device_guard(x):
            y, rstd = rmsnorm_fwd(x, weight, eps, True, offset)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return y

    @staticmethod
    @once_differentiable  # the kernels' backward has no graph of its own: no double backward
    def backward(ctx, dy):
        dx, dw = _rmsnorm_backward(ctx.saved_tensors, ctx.needs_input_grad, dy, ctx.offset)
        return dx, dw, None, None


class FusedAddRMSNormFunction(torch.autograd.Function):
    """(y, residual_out) = (rmsnorm(x + residual) * (offset + weight), x + residual)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, residual_dtype, offset=0.0):
        with device_guard(x):
            y, residual_out, rstd = fused_add_rmsnorm_fwd(
                x, residual, weight, eps, residual_dtype, True, offset
            )
        ctx.save_for_backward(residual_out, weight, rstd)
        ctx.out_dtype, ctx.offset = y.dtype, offset
        ctx.residual_dtype = None if residual.dtype == x.dtype else residual.dtype
        ctx.set_materialize_grads(False)  # an unused residual_out has no gradient to add
        return y, residual_out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dresidual_out):
        if dy is None:
            dy = torch.zeros_like(ctx.saved_tensors[0], dtype=ctx.out_dtype)
        saved, needs = ctx.saved_tensors, ctx.needs_input_grad
        grads = _fused_backward(saved, needs, dy, dresidual_out, ctx.offset, ctx.residual_dtype)
        return (*grads, None, None, None)


# ----------------------------------------------------------------------------- layernorm


def _layernorm_backward(saved, needs, dy):
    """needs: (x, weight, bias) need grads."""
    x, weight, bias, mean, rstd = saved
    if not on_gpu(dy):
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
