"""Softmax and log-softmax along a dimension. Kernels: kernels.py. Op: op.py."""
