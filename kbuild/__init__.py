"""kbuild: GPU kernels written as Python MLIR builders, compiled, cached and called from PyTorch.

    import kbuild
    y = kbuild.rmsnorm(x, weight, eps=1e-6)

Importing kbuild does not import MLIR: kernels compile on first use (or ahead of time with
`kbuild warmup`) and load from the disk cache afterwards.
"""

from .ops import FusedAddRMSNormFunction, RMSNormFunction, fused_add_rmsnorm, rmsnorm

__all__ = ["FusedAddRMSNormFunction", "RMSNormFunction", "fused_add_rmsnorm", "rmsnorm"]
__version__ = "0.1.0"
