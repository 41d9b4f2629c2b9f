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


def rmsnorm_grads(x, weight, dy, eps, residual=None, dresidual_out=None):
    """fp64 autograd through rmsnorm_ref (of x + residual for the fused form).

    Returns (y, dx, dw, residual_out): dx is the gradient w.r.t. x (equal to the residual's
    in the fused form), dw None without a weight.
    """
    xd = x.detach().double().requires_grad_()
    wd = weight.detach().double().requires_grad_() if weight is not None else None
    added = xd if residual is None else xd + residual.detach().double()
    y = added * torch.rsqrt(added.square().mean(-1, keepdim=True) + eps)
    if wd is not None:
        y = y * wd
    loss = (y * dy.double()).sum()
    if dresidual_out is not None:
        loss = loss + (added * dresidual_out.double()).sum()
    grads = torch.autograd.grad(loss, [t for t in (xd, wd) if t is not None])
    return y.detach(), grads[0], (grads[1] if wd is not None else None), added.detach()


def assert_close_rel(out, ref, tol: float, what: str = "") -> None:
    """Relative error by norm and by max, against the reference's scale (METHOD.md)."""
    assert out.shape == ref.shape, what
    if ref.numel() == 0:
        return
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    scale = ref.abs().max().clamp_min(1e-30)
    norm_err = (out - ref).norm() / ref.norm().clamp_min(1e-30)
    max_err = (out - ref).abs().max() / scale
    assert norm_err <= tol and max_err <= 4 * tol, (
        f"{what}: norm err {norm_err:.2e}, max err {max_err:.2e}"
    )
