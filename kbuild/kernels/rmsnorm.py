"""RMSNorm forward, plain and with a fused residual add (the kernel is norm_forward.py's).

    rmsnorm:    rstd = 1 / sqrt(sum(x[j]^2) / N + eps);  y[j] = x[j] * rstd * (offset + w[j])
                (offset: 0, or Gemma's 1, added to w in fp32 inside the kernel)
    fused add:  s = round_to_residual_dtype(x + residual)  -> residual_out
                y = rmsnorm(s)      (from exactly the stored s, so the backward pass, which
                                     reads residual_out, sees the same input)

Bytes that must move: rmsnorm reads x and writes y (2 * M * N elements); the fused form reads
x and residual and writes residual_out and y (4 * M * N). With `store_rstd`, one fp32 per row
is written for the backward pass.
"""

from __future__ import annotations

from ..dsl import Kernel
from ..targets import Target
from .norm_forward import NormForward, build_norm_forward


def build_rmsnorm_module(
    N: int,
    dtype: str,
    weight_dtype: str | None,
    store_rstd: bool,
    eps: float,
    target: Target,
    vectorize: bool = True,
    offset: float = 0.0,
    strided: bool = False,
    **shape: int | bool | None,
) -> Kernel:
    """RMSNorm forward over rows of N `dtype` elements; weight of `weight_dtype` or none,
    scaled as offset + weight.

    Launch arguments: x, [weight], y, [rstd], M, [x_group, x_stride, x_group_magic].
    `strided`: x's rows are read in groups of x_group contiguous rows, x_stride elements
    apart (a (B, T, H, D) view of a fused qkv projection: dsl.GroupedRows), y is
    dense. `vectorize=False` gives the kernel for
    tensors whose addresses are not 16-byte aligned; `shape` holds launch-shape overrides for
    tuning (`threads_per_row`, `cluster`: see norm_forward.build_norm_forward).
    """
    p = NormForward(
        name="rmsnorm_fwd",
        N=N,
        dtype=dtype,
        weight_dtype=weight_dtype,
        store_stats=store_rstd,
        eps=eps,
        offset=offset,
        strided=strided,
    )
    return build_norm_forward(p, target, vectorize, **shape)


def build_fused_add_rmsnorm_module(
    N: int,
    dtype: str,
    weight_dtype: str | None,
    residual_dtype: str,
    store_rstd: bool,
    eps: float,
    target: Target,
    vectorize: bool = True,
    offset: float = 0.0,
    residual_in_dtype: str | None = None,
    **shape: int | bool | None,
) -> Kernel:
    """residual_out = x + residual (stored as `residual_dtype`: x's dtype, or "f32" to keep
    the residual stream in fp32), y = rmsnorm(residual_out). `residual_in_dtype`: the
    residual's dtype when it is not x's ("f32": the stream continues in fp32, so
    residual_dtype must be "f32" too).

    Launch arguments: x, residual, [weight], y, residual_out, [rstd], M.
    """
    if residual_in_dtype not in (None, dtype) and residual_dtype != residual_in_dtype:
        raise ValueError(
            f"an {residual_in_dtype} residual continues an {residual_in_dtype} stream: "
            f"residual_dtype must be {residual_in_dtype}, got {residual_dtype}"
        )
    p = NormForward(
        name="fused_add_rmsnorm_fwd",
        N=N,
        dtype=dtype,
        weight_dtype=weight_dtype,
        residual_dtype=residual_dtype,
        residual_in_dtype=None if residual_in_dtype == dtype else residual_in_dtype,
        store_stats=store_rstd,
        eps=eps,
        offset=offset,
    )
    return build_norm_forward(p, target, vectorize, **shape)
