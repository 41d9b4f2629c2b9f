"""LayerNorm forward and backward (the kernels are norm_forward.py's and norm_backward.py's).

    mean  = sum(x) / N
    rstd  = 1 / sqrt(sum((x - mean)^2) / N + eps)      (centred: exact for large means)
    y     = (x - mean) * rstd * w + b                   (w, b optional)

    x_hat = (x - mean) * rstd,  wdy = dy * w
    dx    = (wdy - mean(wdy) - x_hat * mean(wdy * x_hat)) * rstd
    dw    = sum over rows of dy * x_hat,  db = sum over rows of dy   (deterministic)

Bytes that must move: forward reads x and writes y; backward reads x and dy and writes dx.
`store_stats` writes one fp32 mean and rstd per row for the backward pass.
"""

from __future__ import annotations

from ..dsl import Kernel
from ..targets import Target
from .norm_backward import NormBackward, build_norm_backward
from .norm_forward import NormForward, build_norm_forward


def build_layernorm_module(
    N: int,
    dtype: str,
    weight_dtype: str | None,
    bias_dtype: str | None,
    store_stats: bool,
    eps: float,
    target: Target,
    vectorize: bool = True,
    **shape: int | bool | None,
) -> Kernel:
    """Launch arguments: x, [weight], [bias], y, [mean, rstd], M."""
    p = NormForward(
        name="layernorm_fwd",
        N=N,
        dtype=dtype,
        weight_dtype=weight_dtype,
        bias_dtype=bias_dtype,
        center=True,
        store_stats=store_stats,
        eps=eps,
    )
    return build_norm_forward(p, target, vectorize, **shape)


def build_layernorm_bwd_module(
    N: int,
    dtype: str,
    weight_dtype: str | None,
    compute_dw: bool,
    compute_db: bool,
    target: Target,
    vectorize: bool = True,
    **shape: int | bool | None,
) -> Kernel:
    """Launch arguments: x, [weight], dy, mean, rstd, dx, [dw_partial], [db_partial], M."""
    p = NormBackward(
        name="layernorm_bwd",
        N=N,
        dtype=dtype,
        x_dtype=dtype,
        weight_dtype=weight_dtype,
        center=True,
        compute_dw=compute_dw,
        compute_db=compute_db,
    )
    return build_norm_backward(p, target, vectorize, **shape)
