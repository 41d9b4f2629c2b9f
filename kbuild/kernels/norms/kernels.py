"""The norms' kernels: RMSNorm, fused add + RMSNorm and LayerNorm, forward and backward,
declared with `kernel` beside their builders. The builders are thin: each describes its
kernel (plan/norms.py's NormForward / NormBackward) and hands it to the shared emitters,
forward.py and backward.py, imported only when a kernel is built (they need MLIR).

RMSNorm forward, plain and with a fused residual add:

    rmsnorm:    rstd = 1 / sqrt(sum(x[j]^2) / N + eps);  y[j] = x[j] * rstd * (offset + w[j])
                (offset: 0, or Gemma's 1, added to w in fp32 inside the kernel)
    fused add:  s = round_to_residual_dtype(x + residual)  -> residual_out
                y = rmsnorm(s)      (from exactly the stored s, so the backward pass, which
                                     reads residual_out, sees the same input)

Bytes that must move: rmsnorm reads x and writes y (2 * M * N elements); the fused form reads
x and residual and writes residual_out and y (4 * M * N). With `store_rstd`, one fp32 per row
is written for the backward pass.

RMSNorm backward:

    x_hat = x * rstd
    c1    = sum(x_hat * dy * w) / N
    dx    = (dy * w - x_hat * c1) * rstd        (+ d_residual_out in the fused form)
            with w read as offset + w when the forward had a weight offset (Gemma)
    dw    = sum over rows of dy * x_hat         (deterministic: persistent grid + reduce.py)

In the fused form x is residual_out (the normalised input, perhaps fp32) and, since
added = x + residual, dx is also dresidual: it is written once and returned for both, or,
for an fp32 residual stream, written a second time in fp32 as d(residual).
Bytes that must move: read x and dy, write dx (plus d_residual_out in the fused form).

LayerNorm:

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

from typing import TYPE_CHECKING

from ...plan.norms import NormBackward, NormForward
from ...registry import DTYPE, ROW_VECTORIZE, ROWS, TRACE, WEIGHT_DTYPE, WIDTH, Arg, Param, kernel

if TYPE_CHECKING:
    from ...dsl import Kernel
    from ...targets import Target

_EPS = Param("eps", "float", bounds=(0.0, None))
# RMSNorm's weight offset (y = x_hat * (offset + w), Gemma: 1). Last, and out of the spec at
# 0: the specs (and warmed caches) of plain RMSNorm stay what they were.
_OFFSET = Param("offset", "float", 0.0, needs="weight_dtype", keyed=False)
# x's rows in groups of x_group contiguous rows, the groups x_stride elements apart (a
# (B, T, H, D) view of a fused qkv projection, read without a copy: dsl.rows.GroupedRows).
# Last, and out of the spec when False, as the offset.
_STRIDED = Param("strided", "bool", False, keyed=False)
_GROUPED_ROWS = tuple(
    Arg(name, "i64", when="strided") for name in ("x_group", "x_stride", "x_group_magic")
)
# What every norm kernel takes first: the row width, x's dtype, the weight's (or none).
_ROW = (WIDTH, DTYPE, WEIGHT_DTYPE)
_RESIDUAL = Param("residual_dtype", "dtype")
_COMPUTE_DW = Param("compute_dw", "bool", needs="weight_dtype")
_PARTIALS = (Arg("dw_partial", when="compute_dw"), Arg("db_partial", when="compute_db"))


def _forward(p: NormForward, target: Target, vectorize: bool, shape: dict) -> Kernel:
    from .forward import build_norm_forward

    return build_norm_forward(p, target, vectorize, **shape)


def _backward(p: NormBackward, target: Target, vectorize: bool, shape: dict) -> Kernel:
    from .backward import build_norm_backward

    return build_norm_backward(p, target, vectorize, **shape)


def build_rmsnorm_module(
    N,
    dtype,
    weight_dtype,
    store_rstd,
    eps,
    target,
    vectorize=True,
    offset=0.0,
    strided=False,
    **shape,
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
    return _forward(p, target, vectorize, shape)


RMSNORM_FWD = kernel(
    "rmsnorm_fwd",
    params=(
        *_ROW,
        Param("store_rstd", "bool"),
        _EPS,
        ROW_VECTORIZE,
        _OFFSET,
        _STRIDED,
    ),
    args=(
        TRACE,
        Arg("x"),
        Arg("weight", when="weight_dtype"),
        Arg("y"),
        Arg("rstd", when="store_rstd"),
        ROWS,
        *_GROUPED_ROWS,
    ),
    tunable=True,
)(build_rmsnorm_module)


def build_fused_add_rmsnorm_module(
    N,
    dtype,
    weight_dtype,
    residual_dtype,
    store_rstd,
    eps,
    target,
    vectorize=True,
    offset=0.0,
    residual_in_dtype=None,
    **shape,
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
    return _forward(p, target, vectorize, shape)


# fmt: off
FUSED_ADD_RMSNORM_FWD = kernel(
    "fused_add_rmsnorm_fwd",
    params=(*_ROW, _RESIDUAL, Param("store_rstd", "bool"), _EPS, ROW_VECTORIZE, _OFFSET,
            # The residual's dtype when it is not x's (an fp32 stream); keyed only when set.
            Param("residual_in_dtype", "dtype?", None, keyed=False)),
    args=(TRACE, Arg("x"), Arg("residual"), Arg("weight", when="weight_dtype"), Arg("y"),
          Arg("residual_out"), Arg("rstd", when="store_rstd"), ROWS),
    tunable=True,
)(build_fused_add_rmsnorm_module)
# fmt: on


def build_layernorm_module(
    N, dtype, weight_dtype, bias_dtype, store_stats, eps, target, vectorize=True, **shape
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
    return _forward(p, target, vectorize, shape)


LAYERNORM_FWD = kernel(
    "layernorm_fwd",
    params=(
        *_ROW,
        Param("bias_dtype", "dtype?"),
        Param("store_stats", "bool"),
        _EPS,
        ROW_VECTORIZE,
    ),
    args=(
        TRACE,
        Arg("x"),
        Arg("weight", when="weight_dtype"),
        Arg("bias", when="bias_dtype"),
        Arg("y"),
        Arg("mean", when="store_stats"),
        Arg("rstd", when="store_stats"),
        ROWS,
    ),
    tunable=True,
)(build_layernorm_module)


def build_rmsnorm_bwd_module(
    N, dtype, weight_dtype, compute_dw, target, vectorize=True, offset=0.0, strided=False, **shape
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
    return _backward(p, target, vectorize, shape)


RMSNORM_BWD = kernel(
    "rmsnorm_bwd",
    params=(*_ROW, _COMPUTE_DW, ROW_VECTORIZE, _OFFSET, _STRIDED),
    args=(
        TRACE,
        Arg("x"),
        Arg("weight", when="weight_dtype"),
        Arg("dy"),
        Arg("rstd"),
        Arg("dx"),
        *_PARTIALS,
        ROWS,
        *_GROUPED_ROWS,
    ),
    tunable=True,
)(build_rmsnorm_bwd_module)


def build_fused_add_rmsnorm_bwd_module(
    N,
    dtype,
    weight_dtype,
    residual_dtype,
    has_dresidual_out,
    compute_dw,
    target,
    vectorize=True,
    offset=0.0,
    dresidual_dtype=None,
    **shape,
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
    return _backward(p, target, vectorize, shape)


# fmt: off
FUSED_ADD_RMSNORM_BWD = kernel(
    "fused_add_rmsnorm_bwd",
    params=(*_ROW, _RESIDUAL, Param("has_dresidual_out", "bool"), _COMPUTE_DW, ROW_VECTORIZE,
            _OFFSET,
            # d(residual) written apart from dx, in this dtype (an fp32 stream); keyed when set.
            Param("dresidual_dtype", "dtype?", None, keyed=False)),
    args=(TRACE, Arg("x"), Arg("weight", when="weight_dtype"), Arg("dy"), Arg("rstd"),
          Arg("dresidual_out", when="has_dresidual_out"), Arg("dx"),
          Arg("dresidual", when="dresidual_dtype"), *_PARTIALS, ROWS),
    tunable=True,
)(build_fused_add_rmsnorm_bwd_module)
# fmt: on


def build_layernorm_bwd_module(
    N, dtype, weight_dtype, compute_dw, compute_db, target, vectorize=True, **shape
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
    return _backward(p, target, vectorize, shape)


LAYERNORM_BWD = kernel(
    "layernorm_bwd",
    params=(*_ROW, _COMPUTE_DW, Param("compute_db", "bool"), ROW_VECTORIZE),
    args=(
        TRACE,
        Arg("x"),
        Arg("weight", when="weight_dtype"),
        Arg("dy"),
        Arg("mean"),
        Arg("rstd"),
        Arg("dx"),
        *_PARTIALS,
        ROWS,
    ),
    tunable=True,
)(build_layernorm_bwd_module)
