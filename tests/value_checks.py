"""What the CPU value tests share: seeded inputs and the checks that hold an output to fp64.

On CPU tensors kbuild runs plain torch references (kbuild/kernels/norms/rmsnorm.py, layernorm.py):
fp32 math, one rounding to the output dtype. A 16-bit output is then the fp64 result rounded once,
except where fp32 error lands it across a rounding midpoint (measured: under 0.6% of the
elements, one ulp off). FWD_TOL is a couple of ulps wide, so a second rounding (y rounded
before the weight multiply, an fp32 weight cast to bf16, the sum of the fused form normalised
before it is rounded) passes it, yet it moves a fifth or more of the elements by an ulp:
`assert_rounded_once` counts those.
"""

from __future__ import annotations

import math

import torch

from .gpu_utils import FWD_TOL, GRAD_TOL
from .reference import assert_close_rel

# Of the elements, the share that may sit one ulp from the once-rounded fp64 value. Correct
# code measures 0-0.6% on these inputs; every double rounding tried measures 18% or more.
MAX_FLIPS = 0.02


def randn(shape, dtype, seed, scale=1.0, offset=0.0, strided=False) -> torch.Tensor:
    """Seeded normal values; `strided`: a transposed view, so the last dim is not contiguous."""
    g = torch.Generator().manual_seed(seed)
    if not strided:
        return (torch.randn(shape, generator=g) * scale + offset).to(dtype)
    base = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g) * scale + offset
    return base.to(dtype).transpose(-1, -2)


def param(kind, n, dtype, seed) -> torch.Tensor | None:
    """kind None (absent), "same" (x's dtype) or "f32". Values far from 1 and 0, so a weight
    or bias that is ignored, swapped or applied twice shows."""
    if kind is None:
        return None
    return randn((n,), dtype if kind == "same" else torch.float32, seed, scale=0.7, offset=0.4)


def rounding_flips(out: torch.Tensor, ref: torch.Tensor, neighbours_only=True) -> float:
    """The share of `out`'s elements that differ from fp64 `ref` rounded once to out's dtype;
    inf when `neighbours_only` and some element is not that value or one of its neighbours."""
    once = ref.to(out.dtype)
    differs = out != once
    up = torch.nextafter(once, torch.full_like(once, math.inf))
    down = torch.nextafter(once, torch.full_like(once, -math.inf))
    if neighbours_only and (differs & (out != up) & (out != down)).any():
        return math.inf
    return differs.double().mean().item() if out.numel() else 0.0


def assert_rounded_once(out, ref, what="", neighbours_only=True) -> None:
    flips = rounding_flips(out, ref, neighbours_only)
    assert flips <= MAX_FLIPS, f"{what}: {flips:.1%} of elements off the once-rounded fp64 value"


def loosely_close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within FWD_TOL of out's dtype: what the GPU tests allow."""
    return torch.allclose(out.double(), ref.double(), **FWD_TOL[out.dtype])


def assert_forward(out: torch.Tensor, ref: torch.Tensor, like: torch.Tensor, what="") -> None:
    """`out` has `like`'s shape and dtype; fp32 within FWD_TOL of fp64 `ref`, 16-bit exactly
    `ref` rounded once (bar MAX_FLIPS one-ulp elements)."""
    assert out.shape == like.shape, what
    assert out.dtype == like.dtype, what
    if out.dtype == torch.float32:
        torch.testing.assert_close(
            out.double(), ref.double(), **FWD_TOL[out.dtype], msg=what or None
        )
    else:
        assert_rounded_once(out, ref, what)


def assert_grad(grad, ref, like, what="") -> None:
    """A gradient in `like`'s dtype and shape, within GRAD_TOL of fp64 `ref` by norm; 16-bit
    ones are also `ref` rounded once (the CPU backward is fp32 math, rounded at the end) bar
    MAX_FLIPS elements. Those may be more than an ulp off: an element of dx that is a small
    difference of large terms carries the terms' fp32 error (GRAD_TOL bounds it by norm)."""
    assert grad is not None, f"{what}: no gradient"
    assert grad.shape == like.shape and grad.dtype == like.dtype, what
    assert_close_rel(grad, ref, GRAD_TOL[grad.dtype], what)
    if grad.dtype != torch.float32:
        assert_rounded_once(grad, ref, what, neighbours_only=False)
