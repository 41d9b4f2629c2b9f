"""Loading and launching compiled kernels (CUDA driver API via cuda-bindings). No MLIR here."""
