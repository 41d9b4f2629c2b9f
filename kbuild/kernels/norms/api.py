"""The public functions: argument checks, CPU fallback, and the route to the kernels.

CUDA tensors go to the kbuild::* operators: eagerly through the C++ extension's entry points
(kbuild/native: forward, autograd and backward in C++), under torch.compile as the operators
themselves, so the graph has no breaks (plain RMSNorm excepted: under torch.compile it is its
fp32 math in torch operations, which inductor fuses with the neighbouring ones). Where the
extension is unavailable, eager calls take the Python launch path (autograd Functions, or the
forward launch directly when no gradient is needed). All of these routes run the same kernels.
Eager CPU tensors run the torch reference. The extension is loaded (built the first time) by
the first call given a CUDA tensor, never by CPU calls.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import native
from ...op.tensors import (
    INTERPRETED,
    check_eps,
    check_input,
    check_like,
    check_offset,
    check_param,
    contiguous,
    device_guard,
    is_current,
    on_gpu,
    readable_rows,
)
from .autograd import FusedAddRMSNormFunction, LayerNormFunction, RMSNormFunction
from .custom_ops import fused_add_rmsnorm_fwd_op, layernorm_fwd_op
from .layernorm import layernorm_fwd, layernorm_reference
from .rmsnorm import fused_add_rmsnorm_fwd, rmsnorm_fwd, rmsnorm_reference


class _Unloaded:
    """`_native` until the extension is loaded. Its entries, given a CUDA tensor, load it
    (kbuild.native; built the first time) and run it; given anything else they decline, as
    the extension's own entries decline CPU tensors, so CPU calls never build it."""

    def _entry(self, name: str, x: Any, args: tuple) -> Any:
        global _native
        if not (isinstance(x, torch.Tensor) and x.is_cuda):
            return None
        module = native.load()
        if _native is self:  # (the load's hook has done this, unless a test had set it)
            _native = module
        return None if module is None else getattr(module, name)(x, *args)

    def rmsnorm(self, x, *args):
        return self._entry("rmsnorm", x, args)

    def fused_add_rmsnorm(self, x, *args):
        return self._entry("fused_add_rmsnorm", x, args)

    def layernorm(self, x, *args):
        return self._entry("layernorm", x, args)

    def linear(self, x, *args):  # kbuild.linear's (kernels/llmc/op.py)
        return self._entry("linear", x, args)


# The C++ entry points once loaded, until then `_Unloaded`; None for the Python path (where
# the extension cannot be had; tests of that path set it to None).
_native: Any = None if INTERPRETED else _Unloaded()


def _loaded(module: Any) -> None:
    global _native
    if isinstance(_native, _Unloaded):
        _native = module


native.on_load(lambda: None, _loaded)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dimension: x * rsqrt(mean(x^2, -1) + eps) * (offset + weight).

    x: (..., N), float32/float16/bfloat16, any layout; a strided view whose rows lie in
    groups of contiguous rows at one stride (the (B, T, H, D) q or k of a fused qkv
    projection) is read in place, without a copy, forward and backward. weight: (N,) of x's
    dtype or float32, or None. offset: added to the weight in fp32 inside the kernels, never
    to the stored weight (Gemma's RMSNorm: offset=1.0 with a weight stored around 0; dweight
    is unchanged by it); None is 0. Returns x's shape and dtype (dense from the kernels);
    statistics in fp32.
    Differentiable in x and weight (saved for backward: x, weight and one fp32 rstd per row;
    nothing when no grad is needed).
    CUDA tensors run the kbuild kernels; CPU tensors run the plain torch reference (same
    math), so code using kbuild runs anywhere. Under torch.compile the reference is what is
    traced (inductor fuses it with the neighbouring operations; see the comment below).
    """
    if _native is not None and not torch.compiler.is_compiling():
        y = _native.rmsnorm(x, weight, eps, offset)  # the common CUDA case, whole, in C++
        if y is not None:
            return y
    check_input("x", x)
    weight = check_param("weight", weight, x)
    eps = check_eps(eps)
    offset = check_offset(offset, weight)
    # Under torch.compile, plain RMSNorm is this same fp32 math in torch operations, which
    # inductor fuses with its neighbours (the residual add before it, RoPE after a QK-norm):
    # as an opaque kbuild::rmsnorm_fwd op it made a compiled Qwen3-style model 0.973x the
    # stock one and Llama-style ones 1.00x, as torch operations 1.002x / 0.997x (H200, 8ca1d1c:
    # bench/NOTES.md, "Models"). The eager path, the fused form and LayerNorm keep the kernels.
    if not on_gpu(x) or torch.compiler.is_compiling():
        return rmsnorm_reference(x, weight, eps, offset)[0]
    x = readable_rows(x)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or (weight is not None and weight.requires_grad)
    )
    if _native is not None:
        return _native.rmsnorm_fwd(x, weight, eps, needs_grad, offset)[0]
    if needs_grad:
        return RMSNormFunction.apply(x, weight, eps, offset)
    if is_current(x):  # the guard costs ~2 us: only if needed
        return rmsnorm_fwd(x, weight, eps, False, offset)[0]
    with device_guard(x):
        return rmsnorm_fwd(x, weight, eps, False, offset)[0]


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    prenorm: bool = True,
    residual_in_fp32: bool = False,
    offset: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """residual_out = x + residual; out = rmsnorm(residual_out) * (offset + weight).

    The pre-norm transformer block's "add the sublayer output to the residual stream, then
    normalise" in one pass. x, residual: (..., N) on one device; residual of x's dtype, or
    fp32 (an fp32 residual stream: the residual_out of a call with `residual_in_fp32`).
    residual_out is stored in x's dtype, or fp32 with `residual_in_fp32` or an fp32 residual,
    and out is computed from exactly the stored values. An fp32 residual's gradient comes in
    fp32 (not rounded to x's dtype), so the stream stays fp32 through a whole stack, forward
    and backward. Returns (out, residual_out) when `prenorm`, else out. Gradients flow to x,
    residual and weight; d(x) and d(residual) are one computation (for an fp32 residual, d(x)
    is its rounding to x's dtype). `offset`: as in rmsnorm (None is 0).
    """
    if _native is not None and not torch.compiler.is_compiling():
        out = _native.fused_add_rmsnorm(x, residual, weight, eps, prenorm, residual_in_fp32, offset)
        if out is not None:
            return out
    check_input("x", x)
    check_like("residual", residual, x, or_fp32=True)
    weight = check_param("weight", weight, x)
    eps = check_eps(eps)
    offset = check_offset(offset, weight)
    if not isinstance(prenorm, bool) or not isinstance(residual_in_fp32, bool):
        raise TypeError("prenorm and residual_in_fp32 must be bools")
    residual_dtype = torch.float32 if residual_in_fp32 else residual.dtype
    needs_grad = _needs_grad(x, residual, weight)
    if on_gpu(x):
        x, residual = contiguous(x), contiguous(residual)
    if not on_gpu(x) or torch.compiler.is_compiling():
        out, residual_out, _ = fused_add_rmsnorm_fwd_op(
            x, residual, weight, eps, residual_dtype, needs_grad, offset
        )
    elif _native is not None:
        out, residual_out, _ = _native.fused_add_rmsnorm_fwd(
            x, residual, weight, eps, residual_dtype, needs_grad, offset
        )
    elif needs_grad:
        out, residual_out = FusedAddRMSNormFunction.apply(
            x, residual, weight, eps, residual_dtype, offset
        )
    else:
        with device_guard(x):
            out, residual_out, _ = fused_add_rmsnorm_fwd(
                x, residual, weight, eps, residual_dtype, False, offset
            )
    return (out, residual_out) if prenorm else out


def layernorm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """LayerNorm over the last dimension: (x - mean) * rsqrt(var + eps) * weight + bias.

    x: (..., N), float32/float16/bfloat16, any layout. weight, bias: (N,) of x's dtype or
    float32, or None (elementwise_affine=False / bias=False). The variance is taken over the
    centred row (exact for rows with a large mean). Differentiable in x, weight and bias
    (saved for backward: x, weight, bias and one fp32 mean and rstd per row).
    """
    if _native is not None and not torch.compiler.is_compiling():
        y = _native.layernorm(x, weight, bias, eps)
        if y is not None:
            return y
    check_input("x", x)
    weight = check_param("weight", weight, x)
    bias = check_param("bias", bias, x)
    eps = check_eps(eps)
    # Under torch.compile CPU tensors take the custom-op route too (the ops run this same
    # reference on CPU), so a CPU compile traces the kbuild::* ops and their autograd.
    if not on_gpu(x) and not torch.compiler.is_compiling():
        return layernorm_reference(x, weight, bias, eps)[0]
    x = contiguous(x)
    needs_grad = _needs_grad(x, weight, bias)
    if torch.compiler.is_compiling():
        return layernorm_fwd_op(x, weight, bias, eps, needs_grad)[0]
    if _native is not None:
        return _native.layernorm_fwd(x, weight, bias, eps, needs_grad)[0]
    if needs_grad:
        return LayerNormFunction.apply(x, weight, bias, eps)
    with device_guard(x):
        return layernorm_fwd(x, weight, bias, eps, False)[0]
