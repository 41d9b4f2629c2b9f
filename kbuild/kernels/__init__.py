"""Kernel builders, one module per family, named by the specs that select them.

What each kernel is (parameters, launch arguments, builder) is written once, in table.py; the
registry below is read off it. Builders are imported only when a kernel is compiled: they
need MLIR, and a machine that only runs kernels from a warmed cache has none.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from .table import KERNELS, KernelDef, kernel_def

REGISTRY: dict[str, str] = {name: d.builder for name, d in KERNELS.items()}

__all__ = ["KERNELS", "REGISTRY", "KernelDef", "get_builder", "kernel_def"]


def get_builder(kernel: str) -> Callable:
    module, function = kernel_def(kernel).builder.split(":")
    return getattr(importlib.import_module(module), function)
