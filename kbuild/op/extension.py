"""The C++ extension's stand-in for every Op: until the extension (kbuild/native) loads, and
for good where it cannot, an op whose kernels the extension serves runs its Python kernels,
registered here in libraries of their own; just before the extension's import they are taken
away (torch warns when a kernel replaces another), then replaced by its kernels.

The extension registers the norm operators' CUDA and Autograd kernels (and bias_grad's CUDA
kernel) when it is imported, and runs the CUDA kernel and autograd of ops declared with
launches by name (its generic kernels). It is loaded at the first CUDA call, never in a
CPU-only process. A Python CUDA kernel registered here loads the extension on its first call,
so a torch.ops.kbuild.* call on CUDA (a compiled graph's) loads it as a public function's
first CUDA call does. opdef.py holds the one stand-in (`STANDIN`); kbuild/kernels/resolve.py
gives it the resolver the extension calls on a miss (`use_resolver`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import native
from ..jit import on_forget


def loading(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """`kernel` (a Python CUDA kernel) that first loads the extension where it has not been
    tried yet; this call still runs `kernel` (the same results), later ones the extension's."""

    def cuda_kernel(*args: Any) -> Any:
        native.load()  # once tried, a list lookup
        return kernel(*args)

    return cuda_kernel


class Standin:
    """`native[0]` until the extension loads: registers, where it will, the Python kernels the
    extension replaces once loaded (its `define_generic` and `define_generic_autograd` take
    an op declared meanwhile, found by `lookup` from its qualified name), and swaps them for
    the extension's kernels when it loads, setting `native[0]` to the extension."""

    def __init__(self, lookup: Callable[[str], Any], native_slot: list) -> None:
        self.lookup, self.native = lookup, native_slot
        self.resolver: Callable | None = None  # what the extension calls on a miss
        self.libraries: dict[str, torch.library.Library] = {}  # namespace -> library
        # What is registered, in order: (op, "cuda" / "autograd", the C++ program or None)
        self.registered: list[tuple[Any, str, dict | None]] = []
        self.taken = False  # its libraries taken away (the extension is being imported)

    def _register(self, op: Any, what: str) -> None:
        """op's Python CUDA kernel or autograd formula, as Op.register_cuda_and_autograd
        registers them where the extension does not load."""
        lib = self.libraries.get(op.namespace)
        if lib is None:
            lib = self.libraries[op.namespace] = torch.library.Library(op.namespace, "IMPL")
        op.register_python(lib, what, wrap=loading)

    def add(self, op: Any, what: str, program: dict | None = None) -> None:
        self._register(op, what)
        self.registered.append((op, what, program))

    # opdef.Op.register_cuda_and_autograd calls these for an op of generic kernels
    def define_generic(self, namespace: str, name: str, program: dict) -> None:
        op = self.lookup(f"{namespace}::{name}")
        self.add(op, "cuda", program)
        op.generic_native = False  # (until the extension loads)

    def define_generic_autograd(self, namespace: str, name: str, program: dict) -> None:
        op = self.lookup(f"{namespace}::{name}")
        self.add(op, "autograd", program)
        op.native_autograd = False

    def take_away(self) -> None:
        """Just before the extension's import: its kernels take these keys."""
        for lib in self.libraries.values():
            lib._destroy()  # (a kernel of these may be running: the one loading it)
        self.libraries.clear()
        self.taken = True

    def wire(self, module: Any) -> None:
        """After the import: the extension's resolver, and the generic kernels of the ops
        declared meanwhile; where it failed (module None), the Python kernels back, for good."""
        if module is None:
            self.native[0] = None  # ops declared from now on: the Python launch path
            if self.taken:
                for op, what, _ in self.registered:
                    self._register(op, what)
            return
        if self.resolver is not None:
            module.set_resolver(self.resolver)
        on_forget(module.clear_records)
        self.native[0] = module  # ops declared from now on run its generic kernels
        for op, what, program in self.registered:
            if program is None:  # a norm op's (or bias_grad's): registered by the import
                continue
            if what == "cuda":
                module.define_generic(op.namespace, op.op_name, program)
                op.generic_native = True
            else:
                module.define_generic_autograd(op.namespace, op.op_name, program)
                op.native_autograd = True
        self.registered.clear()

    def use_resolver(self, resolver: Callable) -> None:
        """The function the extension calls on a miss (kbuild/kernels/resolve.py's), now and
        for an extension loaded later."""
        self.resolver = resolver
        if self.native[0] is not None and self.native[0] is not self:
            self.native[0].set_resolver(resolver)

    def register_until_native(self, op: Any) -> None:
        """Register the CUDA kernel and autograd of an op whose kernels the extension provides
        (`native=True`): its Python ones until the extension loads, or for good where it cannot
        (nothing where it is loaded: its import registered them)."""
        if native.loaded() is not None:
            return
        if self.native[0] is None:  # tried, and unavailable
            op.register_cuda_and_autograd()
            return
        self.add(op, "cuda")
        if op.backward is not None or op._autograd is not None:
            self.add(op, "autograd")
