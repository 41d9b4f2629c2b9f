"""The bound tests/test_opdef_gpu.py holds the example softmax's kernels to, on CPU: derived
from the kernels' own arithmetic (its comment), not from torch's error on the same input.

What this catches: a bound taken from torch's own error (it failed on an H100: dx at (33,
1000) fp32 off by 2.385e-5 against 1.5 x torch's 1.59e-5, a kernel within its accuracy), and a
derived bound that is not one: fp32 arithmetic done in the worst order the bound allows (one
long serial sum, each term rounded) must stay inside it, and a real fault (a term of the dot
product dropped) must not.
"""

from __future__ import annotations

import torch

from .test_opdef_gpu import row_errors, softmax_backward_bound, softmax_bound

MEASURED_DX = 2.385e-5  # the H100's dx error at (33, 1000) fp32 (2026-12-07)


def _case(M=33, N=1000, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, N, generator=g) * 4.0  # as the GPU test's rand(..., scale=4.0)
    dy = torch.randn(M, N, generator=g)
    return x, dy


def _serial_sum(t: torch.Tensor) -> torch.Tensor:
    """fp32 sum along the last dim, one element at a time (the longest chain of roundings)."""
    total = torch.zeros(t.shape[:-1], dtype=torch.float32)
    for j in range(t.shape[-1]):
        total = total + t[..., j]
    return total


def test_the_fp32_bound_covers_the_kernels_measured_error_and_stays_tight():
    x, dy = _case()
    y = torch.softmax(x, -1)  # fp32, as stored by the kernel
    bound = softmax_backward_bound(y.double(), dy.double(), torch.float32)
    assert (bound > MEASURED_DX).all(), bound.min().item()
    assert (bound < 1e-3).all(), bound.max().item()  # a fault of 1e-3 still fails
    assert (softmax_bound(x.double(), torch.float32) < 1e-3).all()


def test_fp32_arithmetic_in_the_worst_order_stays_within_the_bound():
    x, dy = _case(M=8)
    m = x.amax(-1, keepdim=True)
    e = torch.exp(x - m)
    y = e * (1.0 / _serial_sum(e))[:, None]
    forward = row_errors(y, torch.softmax(x.double(), -1))
    assert (forward <= softmax_bound(x.double(), torch.float32)).all()
    yd, dyd = y.double(), dy.double()
    dx = y * (dy - _serial_sum(y * dy)[:, None])
    want = yd * (dyd - (yd * dyd).sum(-1, keepdim=True))
    bound = softmax_backward_bound(yd, dyd, torch.float32)
    assert (row_errors(dx, want) <= bound).all()
    # a dot product missing one term is a fault the bound must not pass
    wrong = y * (dy - _serial_sum((y * dy)[:, 1:])[:, None])
    assert (row_errors(wrong, want) > bound).any()
