"""The public functions: argument checks, (..., N) -> (M, N), CPU fallback, autograd."""

from __future__ import annotations

import torch

from .common import check_eps, check_input, check_param, contiguous, device_guard
from .rmsnorm import rmsnorm_fwd, rmsnorm_reference


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension: x * rsqrt(mean(x^2, -1) + eps) * weight.

    x: (..., N), float32/float16/bfloat16, any layout. weight: (N,) of x's dtype or float32,
    or None. Returns x's shape and dtype; statistics are computed in fp32. CUDA tensors run the
    kbuild kernel; CPU tensors run the plain torch reference (same math), so code using kbuild
    runs anywhere.
    """
    check_input("x", x)
    weight = check_param("weight", weight, x)
    eps = check_eps(eps)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or (weight is not None and weight.requires_grad)
    )
    if needs_grad:
        raise NotImplementedError(
            "kbuild.rmsnorm has no backward yet: call it under torch.no_grad() or on tensors "
            "that do not require grad"
        )
    if not x.is_cuda:
        return rmsnorm_reference(x, weight, eps)[0]
    with device_guard(x):
        return rmsnorm_fwd(contiguous(x), weight, eps, False)[0]
