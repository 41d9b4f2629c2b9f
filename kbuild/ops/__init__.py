"""PyTorch-facing layer: public functions, autograd, custom ops. Knows nothing of MLIR."""

from .api import fused_add_rmsnorm, rmsnorm
from .autograd import FusedAddRMSNormFunction, RMSNormFunction

__all__ = ["FusedAddRMSNormFunction", "RMSNormFunction", "fused_add_rmsnorm", "rmsnorm"]
