"""Kernel builders, one module per family, named by the specs that select them.

What each kernel is (parameters, launch arguments, builder) is written once, in table.py (or,
for a user's kernel, beside its builder, registered with `kbuild.kernel`: declare.py).
Builders are imported only when a kernel is compiled: they need MLIR, and a machine that only
runs kernels from a warmed cache has none.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from .table import KERNELS, KernelDef, kernel_def, register

__all__ = ["KERNELS", "KernelDef", "get_builder", "kernel_def", "register"]


def get_builder(kernel: str) -> Callable:
    definition = kernel_def(kernel)
    if definition.function is not None:
        return definition.function
    module, function = definition.builder.split(":")
    found = getattr(importlib.import_module(module), function)
    # a module-level name bound to a KernelDef (`@kbuild.kernel`) stands for its builder
    return found.function if isinstance(found, KernelDef) else found
