"""GELU and the gated MLP activations (SwiGLU, GeGLU). Kernels: kernels.py. Op: op.py."""
