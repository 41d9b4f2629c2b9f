"""The kbuild::* operators: what eager calls with the C++ hot path, and what torch.compile
traces (fullgraph, no breaks; plain RMSNorm's public function traces torch operations
instead, api.py, but kbuild::rmsnorm_fwd called by name compiles too).

Defined here for every device: the schemas, the CPU kernels (the torch reference, fp32 math)
and the fake kernels (shapes for tracing). The CUDA kernels and the autograd formulas come
from the C++ extension (kbuild/native) when it loads: then a training step runs forward and
backward without Python. Where it does not, the same two are registered here in Python
(the launch functions of ops/rmsnorm.py and ops/layernorm.py, torch.library.register_autograd):
same kernels, same results, more host time.

Forward ops return their statistics (rstd, mean) as (M,) fp32 tensors when asked to store
them, else empty ones; backward ops return empty tensors for gradients not asked for.
"""

from __future__ import annotations

import torch

from .. import native
from .autograd import _fused_backward, _layernorm_backward, _rmsnorm_backward
from .common import device_guard, row_count
from .layernorm import layernorm_fwd, layernorm_reference
from .rmsnorm import fused_add_rmsnorm_fwd, rmsnorm_fwd, rmsnorm_reference

SCHEMAS = {
    # offset: RMSNorm's weight offset, y = x_hat * (offset + weight) (Gemma: 1)
    "rmsnorm_fwd": "(Tensor x, Tensor? weight, float eps, bool store_rstd, float offset=0.0) "
    "-> (Tensor, Tensor)",
    "rmsnorm_bwd": "(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, bool need_dx, "
    "bool need_dw, float offset=0.0) -> (Tensor, Tensor)",
    "fused_add_rmsnorm_fwd": "(Tensor x, Tensor residual, Tensor? weight, float eps, "
    "ScalarType residual_dtype, bool store_rstd, float offset=0.0) -> (Tensor, Tensor, Tensor)",
    # (d(x + residual) in dy's dtype, the same in residual_dtype when given (an fp32 residual
    # stream) else empty, dw or empty)
    "fused_add_rmsnorm_bwd": "(Tensor dy, Tensor? dresidual_out, Tensor residual_out, "
    "Tensor? weight, Tensor rstd, bool need_dw, float offset=0.0, "
    "ScalarType? residual_dtype=None) -> (Tensor, Tensor, Tensor)",
    "layernorm_fwd": "(Tensor x, Tensor? weight, Tensor? bias, float eps, bool store_stats) "
    "-> (Tensor, Tensor, Tensor)",
    "layernorm_bwd": "(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, "
    "Tensor rstd, bool need_dx, bool need_dw, bool need_db) -> (Tensor, Tensor, Tensor)",
}

_lib = torch.library.Library("kbuild", "DEF")
for _name, _schema in SCHEMAS.items():
    _lib.define(_name + _schema)


def _empty(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(0, dtype=torch.float32)


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like.new_empty(0)


# ----------------------------------------------------------------------------- CPU: reference


# Outputs are dense, as the CUDA kernels' and the fakes' are (the reference keeps x's layout).
def _rmsnorm_fwd_cpu(x, weight, eps, store_rstd, offset=0.0):
    y, rstd = rmsnorm_reference(x, weight, eps, offset)
    return y.contiguous(), rstd.reshape(-1) if store_rstd else _empty(x)


def _check_stream(x, residual, residual_dtype):
    """What the CUDA kernels take: a residual of x's dtype, or an fp32 stream kept in fp32."""
    if residual.dtype != x.dtype and (
        residual.dtype != torch.float32 or residual_dtype != torch.float32
    ):
        raise TypeError(
            f"kbuild::fused_add_rmsnorm_fwd: residual must have x's dtype ({x.dtype}), or be "
            f"float32 with residual_dtype float32; got {residual.dtype} and {residual_dtype}"
        )


def _fused_add_rmsnorm_fwd_cpu(x, residual, weight, eps, residual_dtype, store_rstd, offset=0.0):
    _check_stream(x, residual, residual_dtype)
    added = (x.float() + residual.float()).to(residual_dtype)
    y, rstd = rmsnorm_reference(added, weight, eps, offset)
    rstd = rstd.reshape(-1) if store_rstd else _empty(x)
    return y.to(x.dtype).contiguous(), added.contiguous(), rstd


def _layernorm_fwd_cpu(x, weight, bias, eps, store_stats):
    y, mean, rstd = layernorm_reference(x, weight, bias, eps)
    if not store_stats:
        return y.contiguous(), _empty(x), _empty(x)
    return y.contiguous(), mean.reshape(-1), rstd.reshape(-1)


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


for _name, _fn in (
    ("rmsnorm_fwd", _rmsnorm_fwd_cpu),
    ("fused_add_rmsnorm_fwd", _fused_add_rmsnorm_fwd_cpu),
    ("layernorm_fwd", _layernorm_fwd_cpu),
    ("rmsnorm_bwd", _rmsnorm_bwd),
    ("fused_add_rmsnorm_bwd", _fused_add_rmsnorm_bwd),
    ("layernorm_bwd", _layernorm_bwd),
):
    _lib.impl(_name, _fn, "CPU")


# ----------------------------------------------------------------------------- fakes


@torch.library.register_fake("kbuild::rmsnorm_fwd", lib=_lib)
def _(x, weight, eps, store_rstd, offset=0.0):
    rows = row_count(x) if store_rstd else 0
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32)  # y is dense


@torch.library.register_fake("kbuild::rmsnorm_bwd", lib=_lib)
def _(dy, x, weight, rstd, need_dx, need_dw, offset=0.0):
    dw = torch.empty_like(weight) if need_dw and weight is not None else x.new_empty(0)
    return (x.new_empty(x.shape) if need_dx else x.new_empty(0)), dw  # dx is dense


@torch.library.register_fake("kbuild::fused_add_rmsnorm_fwd", lib=_lib)
def _(x, residual, weight, eps, residual_dtype, store_rstd, offset=0.0):
    _check_stream(x, residual, residual_dtype)
    rows = row_count(x) if store_rstd else 0
    return (
        x.new_empty(x.shape),
        x.new_empty(x.shape, dtype=residual_dtype),
        x.new_empty(rows, dtype=torch.float32),
    )


@torch.library.register_fake("kbuild::fused_add_rmsnorm_bwd", lib=_lib)
def _(dy, dresidual_out, residual_out, weight, rstd, need_dw, offset=0.0, residual_dtype=None):
    dw = torch.empty_like(weight) if need_dw and weight is not None else dy.new_empty(0)
    dres = (
        dy.new_empty(0) if residual_dtype is None else dy.new_empty(dy.shape, dtype=residual_dtype)
    )
    return dy.new_empty(dy.shape), dres, dw


@torch.library.register_fake("kbuild::layernorm_fwd", lib=_lib)
def _(x, weight, bias, eps, store_stats):
    rows = row_count(x) if store_stats else 0
    return x.new_empty(x.shape), *(x.new_empty(rows, dtype=torch.float32) for _ in range(2))


@torch.library.register_fake("kbuild::layernorm_bwd", lib=_lib)
def _(dy, x, weight, bias, mean, rstd, need_dx, need_dw, need_db):
    dx = x.new_empty(x.shape) if need_dx else x.new_empty(0)
    dw = torch.empty_like(weight) if need_dw and weight is not None else x.new_empty(0)
    db = torch.empty_like(bias) if need_db and bias is not None else x.new_empty(0)
    return dx, dw, db


rmsnorm_fwd_op = torch.ops.kbuild.rmsnorm_fwd.default
rmsnorm_bwd_op = torch.ops.kbuild.rmsnorm_bwd.default
fused_add_rmsnorm_fwd_op = torch.ops.kbuild.fused_add_rmsnorm_fwd.default
fused_add_rmsnorm_bwd_op = torch.ops.kbuild.fused_add_rmsnorm_bwd.default
layernorm_fwd_op = torch.ops.kbuild.layernorm_fwd.default
layernorm_bwd_op = torch.ops.kbuild.layernorm_bwd.default

# ----------------------------------------------------------------------------- CUDA + autograd

NATIVE = native.load()  # the C++ extension (registers CUDA and Autograd kernels), or None

if NATIVE is not None:
    from ..jit import on_forget
    from .resolve import resolve

    NATIVE.set_resolver(resolve)
    on_forget(NATIVE.clear_records)
else:  # the Python launch path, registered as the same operators

    def _rmsnorm_fwd_cuda(x, weight, eps, store_rstd, offset=0.0):
        with device_guard(x):
            y, rstd = rmsnorm_fwd(x, weight, eps, store_rstd, offset)
        return y, rstd if rstd is not None else _empty(x)

    def _fused_add_rmsnorm_fwd_cuda(
        x, residual, weight, eps, residual_dtype, store_rstd, offset=0.0
    ):
        with device_guard(x):
            y, res, rstd = fused_add_rmsnorm_fwd(
                x.contiguous(), residual.contiguous(), weight, eps, residual_dtype, store_rstd,
                offset,
            )  # fmt: skip
        return y, res, rstd if rstd is not None else _empty(x)

    def _layernorm_fwd_cuda(x, weight, bias, eps, store_stats):
        with device_guard(x):
            y, mean, rstd = layernorm_fwd(x.contiguous(), weight, bias, eps, store_stats)
        if mean is None:
            mean = rstd = _empty(x)
        return y, mean, rstd

    for _name, _fn in (
        ("rmsnorm_fwd", _rmsnorm_fwd_cuda),
        ("fused_add_rmsnorm_fwd", _fused_add_rmsnorm_fwd_cuda),
        ("layernorm_fwd", _layernorm_fwd_cuda),
        ("rmsnorm_bwd", _rmsnorm_bwd),
        ("fused_add_rmsnorm_bwd", _fused_add_rmsnorm_bwd),
        ("layernorm_bwd", _layernorm_bwd),
    ):
        _lib.impl(_name, _fn, "CUDA")

    def _rmsnorm_setup(ctx, inputs, output):
        x, weight = inputs[:2]
        ctx.save_for_backward(x, weight, output[1])
        ctx.offset = inputs[4] if len(inputs) > 4 else 0.0

    def _rmsnorm_op_backward(ctx, dy, _drstd):
        x, weight, rstd = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        need_dw = ctx.needs_input_grad[1] and weight is not None
        dx, dw = rmsnorm_bwd_op(dy, x, weight, rstd, need_dx, need_dw, ctx.offset)
        return (dx if need_dx else None), (dw if need_dw else None), None, None, None

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
        dsum, dres, dw = fused_add_rmsnorm_bwd_op(
            dy, dresidual_out, residual_out, weight, rstd, need_dw, ctx.offset, ctx.residual_dtype
        )
        # added = x + residual: one gradient serves both inputs (an fp32 residual gets its own,
        # unrounded copy).
        dx = dsum if ctx.needs_input_grad[0] else None
        dres = (dsum if ctx.residual_dtype is None else dres) if ctx.needs_input_grad[1] else None
        return dx, dres, (dw if need_dw else None), None, None, None, None

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

    torch.library.register_autograd(
        "kbuild::rmsnorm_fwd", _rmsnorm_op_backward, setup_context=_rmsnorm_setup, lib=_lib
    )
    torch.library.register_autograd(
        "kbuild::fused_add_rmsnorm_fwd", _fused_op_backward, setup_context=_fused_setup, lib=_lib
    )
    torch.library.register_autograd(
        "kbuild::layernorm_fwd", _layernorm_op_backward, setup_context=_layernorm_setup, lib=_lib
    )
