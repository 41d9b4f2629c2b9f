"""RMSNorm backward, plain and for the fused residual add (the kernel is norm_backward.py's).

    x_hat = x * rstd
    c1    = sum(x_hat * dy * w) / N
    dx    = (dy * w - x_hat * c1) * rstd        (+ d_residual_out in the fused form)
            with w read as offset + w when the forward had a weight offset (Gemma)
    dw    = sum over rows of dy * x_hat         (deterministic: persistent grid + reduce.py)

In the fused form x is residual_out (the normalised input, perhaps fp32) and, since
added = x + residual, dx is also dresidual: it is written once and returned for both, or,
for an fp32 residual stream, written a second time in fp32 as d(residual).
Bytes that must move: read x and dy, write dx (plus d_residual_out in the fused form).
"""

from __future__ import annotations

from ..dsl import Kernel
from ..targets import Target
from .norm_backward import NormBackward, build_norm_backward


def build_rmsnorm_bwd_module(
    N: int,
    dtype: str,
    weight_dtype: str | None,
    compute_dw: bool,
    target: Target,
    vectorize: bool = True,
    offset: float = 0.0,
    strided: bool = False,
    **shape: int | bool | None,
) -> Kernel:
    """dx (and dw partials) for y = rmsnorm(x) * (offset + w) with x, dy, dx of `dtype`.

    Launch arguments: x, [weight], dy, rstd, dx, [dw_partial], M, [x_group, x_stride,
    x_group_magic]. `strided`: x's rows grouped at a stride, as the forward's (dy and dx are
    dense). Grid: persistent.
    """
    p = NormBackward(
        name="rmsnorm_bwd",
        N=N,
        dtype=dtype,
        x_dtype=dtype,
        weight_dtype=weight_dtype,
        compute_dw=compute_dw,
        offset=offset,
        strided=strided,
    )
    return build_norm_backward(p, target, vectorize, **shape)


def build_fused_add_rmsnorm_bwd_module(
    N: int,
    dtype: str,
    weight_dtype: str | None,
    residual_dtype: str,
    has_dresidual_out: bool,
    compute_dw: bool,
    target: Target,
    vectorize: bool = True,
    offset: float = 0.0,
    dresidual_dtype: str | None = None,
    **shape: int | bool | None,
) -> Kernel:
    """Gradient of (y, residual_out) = fused_add_rmsnorm(x, residual) w.r.t. x + residual.

    Launch arguments: residual_out, [weight], dy, rstd, [dresidual_out], dx, [dresidual],
    [dw_partial], M. dx (of `dtype`) is both dx and dresidual, unless `dresidual_dtype` asks
    for d(residual) in its own dtype as well (an fp32 residual stream: its gradient is not
    rounded to x's dtype).
    """
    p = NormBackward(
        name="fused_add_rmsnorm_bwd",
        N=N,
        dtype=dtype,
        x_dtype=residual_dtype,
        weight_dtype=weight_dtype,
        has_dres=has_dresidual_out,
        dres_dtype=dresidual_dtype,
        compute_dw=compute_dw,
        offset=offset,
    )
    return build_norm_backward(p, target, vectorize, **shape)
