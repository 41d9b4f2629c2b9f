"""PyTorch-facing layer: public functions, autograd, custom ops. Knows nothing of MLIR."""

from .api import fused_add_rmsnorm, layernorm, rmsnorm
from .autograd import FusedAddRMSNormFunction, LayerNormFunction, RMSNormFunction
from .launch import launch_kernel as launch
from .llmc import LinearFunction, bias_grad, encoder, encoder_backward, linear

__all__ = [
    "FusedAddRMSNormFunction",
    "LayerNormFunction",
    "LinearFunction",
    "RMSNormFunction",
    "bias_grad",
    "encoder",
    "encoder_backward",
    "fused_add_rmsnorm",
    "launch",
    "layernorm",
    "linear",
    "rmsnorm",
]
