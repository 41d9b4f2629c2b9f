"""The kbuild::* operators: what eager calls with the C++ hot path, and what torch.compile
traces (fullgraph, no breaks; plain RMSNorm's public function traces torch operations
instead, api.py, but kbuild::rmsnorm_fwd called by name compiles too).

Defined here for every device: the schemas, the CPU kernels (the torch reference, fp32 math)
and the fake kernels (shapes for tracing). The CUDA kernels and the autograd formulas come
from the C++ extension (kbuild/native) when it loads: then a training step runs forward and
backward without Python. Where it does not, the same two are registered here in Python
(the launch functions of kernels/norms/rmsnorm.py and kernels/norms/layernorm.py,
torch.library.register_autograd): same kernels, same results, more host time.

Forward ops return their statistics (rstd, mean) as (M,) fp32 tensors when asked to store
them, else empty ones; backward ops return empty tensors for gradients not asked for.
"""

from __future__ import annotations

import os

import torch

from ... import native
from ...op import opdef
from ...op.opdef import Feature, Like, Op, Out, Rows, Scalar, Tensors, eps
from ...op.tensors import INTERPRETED, device_guard
from ..resolve import resolve
from .autograd import _fused_backward, _layernorm_backward, _rmsnorm_backward
from .layernorm import layernorm_fwd, layernorm_reference
from .rmsnorm import fused_add_rmsnorm_fwd, rmsnorm_fwd, rmsnorm_reference


def _empty(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(0, dtype=torch.float32)


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like.new_empty(0)


def _check_stream(bound):
    """What the CUDA kernels take: a residual of x's dtype, or an fp32 stream kept in fp32."""
    x, residual, residual_dtype = bound["x"], bound["residual"], bound["residual_dtype"]
    if residual.dtype != x.dtype and (
        residual.dtype != torch.float32 or residual_dtype != torch.float32
    ):
        raise TypeError(
            f"kbuild::fused_add_rmsnorm_fwd: residual must have x's dtype ({x.dtype}), or be "
            f"float32 with residual_dtype float32; got {residual.dtype} and {residual_dtype}"
        )


# ----------------------------------------------------------------------------- CPU: reference


def _fused_add_rmsnorm_fwd_cpu(x, residual, weight, eps, residual_dtype, store_rstd, offset=0.0):
    added = (x.float() + residual.float()).to(residual_dtype)
    y, rstd = rmsnorm_reference(added, weight, eps, offset)
    return y.to(x.dtype), added, rstd


# The backward ops: the shared backward functions (CPU reference or Python launches by device).
def _rmsnorm_bwd(dy, x, weight, rstd, need_dx, need_dw, offset=0.0):
    dx, dw = _rmsnorm_backward((x, weight, rstd), (need_dx, need_dw), dy, offset)
    return _or_empty(dx, x).contiguous(), _or_empty(dw, x)


def _fused_add_rmsnorm_bwd(
    dy, dresidual_out, residual_out, weight, rstd, need_dw, offset=0.0, residual_dtype=None
):
    saved, needs = (residual_out, weight, rstd), (True, residual_dtype is not None, need_dw)
    dsum, dres, dw = _fused_backward(saved, needs, dy, dresidual_out, offset, residual_dtype)
    dres = dres.contiguous() if residual_dtype is not None else dy.new_empty(0)
    return dsum.contiguous(), dres, _or_empty(dw, dy)


def _layernorm_bwd(dy, x, weight, bias, mean, rstd, need_dx, need_dw, need_db):
    grads = _layernorm_backward((x, weight, bias, mean, rstd), (need_dx, need_dw, need_db), dy)
    return tuple(_or_empty(g, x).contiguous() for g in grads)


# ----------------------------------------------------------------------------- Python CUDA


def _rmsnorm_fwd_cuda(x, weight, eps, store_rstd, offset=0.0):
    with device_guard(x):
        y, rstd = rmsnorm_fwd(x, weight, eps, store_rstd, offset)
    return y, rstd if rstd is not None else _empty(x)


def _fused_add_rmsnorm_fwd_cuda(x, residual, weight, eps, residual_dtype, store_rstd, offset=0.0):
    with device_guard(x):
        y, res, rstd = fused_add_rmsnorm_fwd(
            x.contiguous(), residual.contiguous(), weight, eps, residual_dtype, store_rstd, offset
        )
    return y, res, rstd if rstd is not None else _empty(x)


def _layernorm_fwd_cuda(x, weight, bias, eps, store_stats):
    with device_guard(x):
        y, mean, rstd = layernorm_fwd(x.contiguous(), weight, bias, eps, store_stats)
    if mean is None:
        mean = rstd = _empty(x)
    return y, mean, rstd


def _fused_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], inputs[2], output[2])
    ctx.out_dtype = output[0].dtype
    ctx.offset = inputs[6] if len(inputs) > 6 else 0.0
    x, residual = inputs[:2]
    ctx.residual_dtype = None if residual.dtype == x.dtype else residual.dtype


def _fused_op_backward(ctx, dy, dresidual_out, _drstd):
    residual_out, weight, rstd = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[2] and weight is not None
    if dy is None:
        dy = torch.zeros_like(residual_out, dtype=ctx.out_dtype)
    dsum, dres, dw = FUSED_ADD_RMSNORM_BWD.run(
        dy, dresidual_out, residual_out, weight, rstd, need_dw, ctx.offset, ctx.residual_dtype
    )
    # added = x + residual: one gradient serves both inputs (an fp32 residual gets its own,
    # unrounded copy).
    dx = dsum if ctx.needs_input_grad[0] else None
    dres = (dsum if ctx.residual_dtype is None else dres) if ctx.needs_input_grad[1] else None
    return dx, dres, (dw if need_dw else None), None, None, None, None


# ----------------------------------------------------------------------------- the operators
# Their CUDA kernels and autograd are the C++ extension's where it loads (native=True), else
# the Python launches and formulas registered below.

_EPS = eps()  # the public functions give its default (1e-6 RMSNorm, 1e-5 LayerNorm)
# RMSNorm's weight offset: y = x_hat * (offset + weight) (Gemma: 1)
_OFFSET = Scalar("offset", "float", 0.0)
_WEIGHT, _BIAS = Feature("weight"), Feature("bias")
_NEED_DW = Scalar("need_dw", "bool", need_grad_of="weight")
_DW = Out("dw", like="weight", when=("need_dw", "weight"), grad_of="weight")

RMSNORM_BWD = Op(
    "kbuild::rmsnorm_bwd",
    args=(
        Rows("dy"),
        Rows("x"),
        _WEIGHT,
        Tensors("rstd"),
        Scalar("need_dx", "bool"),
        _NEED_DW,
        _OFFSET,
    ),  # fmt: skip
    outputs=(Out("dx", like="x", when="need_dx"), _DW),
    reference=_rmsnorm_bwd,
    cuda=_rmsnorm_bwd,
    native=True,
)
RMSNORM_FWD = Op(
    "kbuild::rmsnorm_fwd",
    args=(Rows("x"), _WEIGHT, _EPS, Scalar("store_rstd", "bool"), _OFFSET),
    outputs=(Out("y", like="x"), Out("rstd", rows="x", when="store_rstd")),
    reference=lambda x, weight, eps, store_rstd, offset=0.0: rmsnorm_reference(
        x, weight, eps, offset
    ),
    cuda=_rmsnorm_fwd_cuda,
    backward=RMSNORM_BWD,
    native=True,
)
# (d(x + residual) in dy's dtype, the same in residual_dtype when given (an fp32 residual
# stream) else empty, dw or empty)
FUSED_ADD_RMSNORM_BWD = Op(
    "kbuild::fused_add_rmsnorm_bwd",
    args=(
        Rows("dy"),
        Like("dresidual_out", "dy", or_fp32=True, optional=True),
        Rows("residual_out"),
        Feature("weight", of="dy"),  # (no x here)
        Tensors("rstd"),
        _NEED_DW,
        _OFFSET,
        Scalar("residual_dtype", "dtype", None, optional=True),
    ),
    outputs=(
        Out("dsum", like="dy"),
        Out("dresidual", like="dy", dtype="residual_dtype", when="residual_dtype"),
        _DW,
    ),
    reference=_fused_add_rmsnorm_bwd,
    cuda=_fused_add_rmsnorm_bwd,
    native=True,
)
FUSED_ADD_RMSNORM_FWD = Op(
    "kbuild::fused_add_rmsnorm_fwd",
    args=(
        Rows("x"),
        Like("residual", "x", or_fp32=True),
        _WEIGHT,
        _EPS,
        Scalar("residual_dtype", "dtype"),
        Scalar("store_rstd", "bool"),
        _OFFSET,
    ),
    outputs=(
        Out("y", like="x"),
        Out("residual_out", like="x", dtype="residual_dtype"),
        Out("rstd", rows="x", when="store_rstd"),
    ),
    check=_check_stream,
    reference=_fused_add_rmsnorm_fwd_cpu,
    cuda=_fused_add_rmsnorm_fwd_cuda,
    autograd=(_fused_setup, _fused_op_backward),  # one gradient serves x and the residual
    native=True,
)
LAYERNORM_BWD = Op(
    "kbuild::layernorm_bwd",
    args=(
        Rows("dy"),
        Rows("x"),
        _WEIGHT,
        _BIAS,
        Tensors("mean"),
        Tensors("rstd"),
        Scalar("need_dx", "bool"),
        _NEED_DW,
        Scalar("need_db", "bool", need_grad_of="bias"),
    ),
    outputs=(
        Out("dx", like="x", when="need_dx"),
        _DW,
        Out("db", like="bias", when=("need_db", "bias"), grad_of="bias"),
    ),
    reference=_layernorm_bwd,
    cuda=_layernorm_bwd,
    native=True,
)
LAYERNORM_FWD = Op(
    "kbuild::layernorm_fwd",
    args=(Rows("x"), _WEIGHT, _BIAS, _EPS, Scalar("store_stats", "bool")),
    outputs=(
        Out("y", like="x"),
        Out("mean", rows="x", when="store_stats"),
        Out("rstd", rows="x", when="store_stats"),
    ),
    reference=lambda x, weight, bias, eps, store_stats: layernorm_reference(x, weight, bias, eps),
    cuda=_layernorm_fwd_cuda,
    backward=LAYERNORM_BWD,
    native=True,
)
NORM_OPS = (RMSNORM_FWD, RMSNORM_BWD, FUSED_ADD_RMSNORM_FWD, FUSED_ADD_RMSNORM_BWD,
            LAYERNORM_FWD, LAYERNORM_BWD)  # fmt: skip

rmsnorm_fwd_op = RMSNORM_FWD.overload
rmsnorm_bwd_op = RMSNORM_BWD.overload
fused_add_rmsnorm_fwd_op = FUSED_ADD_RMSNORM_FWD.overload
fused_add_rmsnorm_bwd_op = FUSED_ADD_RMSNORM_BWD.overload
layernorm_fwd_op = LAYERNORM_FWD.overload
layernorm_bwd_op = LAYERNORM_BWD.overload

# ----------------------------------------------------------------------------- CUDA + autograd
# The extension's kernels where it loads, the Python ones until then (kbuild/op/extension.py);
# the resolver it calls on a miss is kbuild/kernels/resolve.py's.
opdef.STANDIN.use_resolver(resolve)

for _op in NORM_OPS:
    opdef.STANDIN.register_until_native(_op)

# settled at import: never, or now (the interpreter never loads it)
if os.environ.get(native.DISABLE_ENV) in ("0", "1") and not INTERPRETED:
    native.load()
