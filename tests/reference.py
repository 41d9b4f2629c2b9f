"""The torch references every kbuild test compares against, computed in float64.

RMSNorm, for one row x of N elements:

    rstd = 1 / sqrt(mean(x^2) + eps)
    y    = x * rstd * weight          (weight omitted when None)

The kernels accumulate in fp32, so they are held to these fp64 results within a couple of ulps
of the output dtype (tests/gpu_utils.py FWD_TOL).
"""

from __future__ import annotations

import torch


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in float64, cast back to x's dtype."""
    xd = x.double()
    rstd = torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps)
    y = xd * rstd
    if weight is not None:
        y = y * weight.double()
    return y.to(x.dtype)
