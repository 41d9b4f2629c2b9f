"""PyTorch-facing layer: public functions, autograd, custom ops. Knows nothing of MLIR."""

from .api import rmsnorm

__all__ = ["rmsnorm"]
