"""PyTorch-facing layer: public functions, autograd, custom ops. Knows nothing of MLIR."""

from .api import fused_add_rmsnorm, layernorm, rmsnorm
from .autograd import FusedAddRMSNormFunction, LayerNormFunction, RMSNormFunction

__all__ = [
    "FusedAddRMSNormFunction",
    "LayerNormFunction",
    "RMSNormFunction",
    "fused_add_rmsnorm",
    "layernorm",
    "rmsnorm",
]
