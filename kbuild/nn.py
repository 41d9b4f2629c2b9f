"""Drop-in replacements for torch.nn.RMSNorm and torch.nn.LayerNorm on kbuild's kernels.

They subclass the torch modules, so constructor arguments, parameters, initialisation,
state_dict keys and repr are torch's own: a checkpoint loads into either class unchanged.
Only `forward` differs. kbuild normalises over the last dimension only, so a
`normalized_shape` of more than one dimension raises ValueError at construction.
"""

from __future__ import annotations

import torch

from .ops import layernorm, rmsnorm

_FP32_EPS = torch.finfo(torch.float32).eps  # kbuild computes in fp32 whatever the I/O dtype


def _last_dim_only(cls: str, normalized_shape) -> None:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(
            f"kbuild.nn.{cls} normalises over the last dimension only: normalized_shape must be "
            f"an int or a 1-tuple, got {normalized_shape!r} (use torch.nn.{cls} for that)"
        )


def _check_last_dim(module: torch.nn.Module, x: torch.Tensor) -> None:
    # With a weight, kbuild's own checks catch this; without one (elementwise_affine=False)
    # nothing else would, and torch's modules raise here too.
    (n,) = module.normalized_shape
    if x.ndim == 0 or x.shape[-1] != n:
        raise ValueError(
            f"{type(module).__name__} expects inputs (..., {n}); got shape {tuple(x.shape)}"
        )


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm computed by kbuild.rmsnorm. eps=None means what it means in torch:
    the machine epsilon of the computation type, fp32 for every input kbuild takes (so
    finfo(float32).eps for bf16 and fp16 too, not the 16-bit type's own)."""

    def __init__(
        self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None
    ):
        _last_dim_only("RMSNorm", normalized_shape)
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(self, x)
        eps = self.eps if self.eps is not None else _FP32_EPS
        return rmsnorm(x, self.weight, eps)


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm computed by kbuild.layernorm."""

    def __init__(
        self,
        normalized_shape,
        eps=1e-5,
        elementwise_affine=True,
        bias=True,
        device=None,
        dtype=None,
    ):
        _last_dim_only("LayerNorm", normalized_shape)
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(self, x)
        return layernorm(x, self.weight, self.bias, self.eps)
