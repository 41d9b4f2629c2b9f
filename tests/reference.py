"""The torch references every kbuild test compares against, computed in float64.

RMSNorm, for one row x of N elements:

    rstd = 1 / sqrt(mean(x^2) + eps)
    y    = x * rstd * weight          (weight omitted when None)

The kernels accumulate in fp32, so they are held to these fp64 results within a couple of ulps
of the output dtype (tests/gpu_utils.py FWD_TOL).
"""

from __future__ import annotations

import torch


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in float64, cast back to x's dtype."""
    xd = x.double()
    rstd = torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps)
    y = xd * rstd
    if weight is not None:
        y = y * weight.double()
    return y.to(x.dtype)


def rmsnorm_grads(x, weight, dy, eps, residual=None, dresidual_out=None, offset=0.0):
    """fp64 autograd through rmsnorm_ref (of x + residual for the fused form), the weight
    read as offset + weight (Gemma) when `offset` is given.

    Returns (y, dx, dw, residual_out): dx is the gradient w.r.t. x (equal to the residual's
    in the fused form), dw None without a weight.
    """
    xd = x.detach().double().requires_grad_()
    wd = weight.detach().double().requires_grad_() if weight is not None else None
    added = xd if residual is None else xd + residual.detach().double()
    y = added * torch.rsqrt(added.square().mean(-1, keepdim=True) + eps)
    if wd is not None:
        y = y * (wd + offset)
    loss = (y * dy.double()).sum()
    if dresidual_out is not None:
        loss = loss + (added * dresidual_out.double()).sum()
    grads = torch.autograd.grad(loss, [t for t in (xd, wd) if t is not None])
    return y.detach(), grads[0], (grads[1] if wd is not None else None), added.detach()


def assert_close_rel(out, ref, tol: float, what: str = "", floor=None) -> None:
    """Relative error by norm and by max, against the reference's scale (METHOD.md).

    `floor` (a tensor of ref's shape) sets a minimum scale: where the exact result is a
    cancellation far smaller than its terms (dx of an N = 1 row is dy * eps / (x^2 + eps)),
    fp32 rounding is measured against the terms, not against the tiny difference.
    """
    assert out.shape == ref.shape, what
    if ref.numel() == 0:
        return
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    scale = ref.abs().max().clamp_min(1e-30)
    ref_norm = ref.norm().clamp_min(1e-30)
    if floor is not None:
        scale = torch.maximum(scale, floor.double().abs().max())
        ref_norm = torch.maximum(ref_norm, floor.double().norm())
    norm_err = (out - ref).norm() / ref_norm
    max_err = (out - ref).abs().max() / scale
    assert norm_err <= tol and max_err <= 4 * tol, (
        f"{what}: norm err {norm_err:.2e}, max err {max_err:.2e}"
    )


def layernorm_grads(x, weight, bias, dy, eps):
    """fp64 autograd of the LayerNorm formula: (y, dx, dw, db); dw/db None when absent."""
    xd = x.detach().double().requires_grad_()
    params = [
        p.detach().double().requires_grad_() if p is not None else None for p in (weight, bias)
    ]
    mean = xd.mean(-1, keepdim=True)
    centred = xd - mean
    y = centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)
    if params[0] is not None:
        y = y * params[0]
    if params[1] is not None:
        y = y + params[1]
    wanted = [xd] + [p for p in params if p is not None]
    grads = iter(torch.autograd.grad((y * dy.double()).sum(), wanted))
    dx = next(grads)
    dw, db = (next(grads) if p is not None else None for p in params)
    return y.detach(), dx, dw, db


def dx_terms(x, weight, dy, eps):
    """|dy * w * rstd|: the size of the terms an RMSNorm dx is a difference of."""
    xd = x.detach().double()
    rstd = torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps)
    w = weight.detach().double() if weight is not None else 1.0
    return dy.double() * w * rstd
