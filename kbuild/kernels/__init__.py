"""Kernel builders, one module per family, named by the specs that select them.

The registry maps a spec's kernel name to "module:function" and imports the builder only when
a kernel is compiled: builders need MLIR, and a machine that only runs kernels from a warmed
cache has none.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

REGISTRY: dict[str, str] = {
    "rmsnorm_fwd": "kbuild.kernels.rmsnorm:build_rmsnorm_module",
    "rmsnorm_bwd": "kbuild.kernels.rmsnorm_bwd:build_rmsnorm_bwd_module",
    "fused_add_rmsnorm_fwd": "kbuild.kernels.rmsnorm:build_fused_add_rmsnorm_module",
    "fused_add_rmsnorm_bwd": "kbuild.kernels.rmsnorm_bwd:build_fused_add_rmsnorm_bwd_module",
    "layernorm_fwd": "kbuild.kernels.layernorm:build_layernorm_module",
    "layernorm_bwd": "kbuild.kernels.layernorm:build_layernorm_bwd_module",
    "column_sum": "kbuild.kernels.reduce:build_column_sum_module",
}


def get_builder(kernel: str) -> Callable:
    try:
        module, function = REGISTRY[kernel].split(":")
    except KeyError:
        raise ValueError(
            f"unknown kernel {kernel!r}; known: {', '.join(sorted(REGISTRY))}"
        ) from None
    return getattr(importlib.import_module(module), function)
