"""A kernel module turned into Python closures, run by every thread of a chunk of blocks at
once (one numpy lane per thread).

`Program(module_op, name)` walks the `gpu.func` once: each SSA value gets a slot, each op a
closure `run(machine)` from the op table (`op_table.OPS`, filled by the semantics modules
semantics.py, access.py, threads.py, control.py and lowered.py, all imported here); a region
is the list of its ops' closures (`regions.py`). Control flow is structured in the builder's
module (scf), so divergence is a mask: `scf.if` runs its branches under `mask & cond` and
`mask & ~cond` and merges what they yield; `scf.for` / `scf.while` loop while any lane is
still in, lanes that are done keeping their values. The lowered module's unstructured control
flow (cf.br / cf.cond_br) runs the same ops block by block, earliest waiting block first, so
lanes meet again where their paths join.
"""

from __future__ import annotations

# each semantics module registers its ops into op_table.OPS when imported: all of them are
# here before a kernel is read
from . import access, control, lowered, semantics, threads  # noqa: F401
from .regions import region
from .types import parse_type


class Program:
    """One kernel of a module, ready to run (no MLIR objects are kept)."""

    def __init__(self, module_op, name: str | None = None) -> None:
        self.globals: dict[str, tuple[int, int]] = {}  # shared array -> (offset, bytes)
        self.dynamic_global: str | None = None
        self.static_shared = 0
        func = None
        for op in _walk(module_op):
            kind = op.operation.name
            if kind == "llvm.mlir.global":
                self._declare_global(op)
            elif kind in ("gpu.func", "llvm.func") and func is None:
                attrs = op.operation.attributes
                if "gpu.kernel" in attrs or "nvvm.kernel" in attrs or "rocdl.kernel" in attrs:
                    if name is None or _sym(op) == name:
                        func = op
        if func is None:
            raise ValueError(f"no kernel {name or ''} in the module")
        self.name = _sym(func)
        attrs = func.operation.attributes
        self.block = _array_attr(attrs, ("known_block_size", "gpu.known_block_size"), [0])[0]
        self.cluster = _array_attr(attrs, ("nvvm.cluster_dim",), [1])[0]
        self._slots: dict = {}
        self.nslots = 0
        body = func.operation.regions[0]
        entry = body.blocks[0]
        self.params = [self.slot(a) for a in entry.arguments]
        self.param_types = [parse_type(str(a.type)) for a in entry.arguments]
        self.body = region(self, body)

    # -- building ---------------------------------------------------------------------

    def slot(self, value) -> int:
        s = self._slots.get(value)
        if s is None:
            s = self._slots[value] = self.nslots
            self.nslots += 1
        return s

    def _declare_global(self, op) -> None:
        from mlir import ir

        attrs = op.operation.attributes
        name = ir.StringAttr(attrs["sym_name"]).value
        space = ir.IntegerAttr(attrs["addr_space"]).value if "addr_space" in attrs else 0
        if space != 3:
            raise NotImplementedError(f"global {name} in address space {space}")
        from .types import memory_size

        size = memory_size(str(ir.TypeAttr(attrs["global_type"]).value))
        if size == 0:  # the extern dynamic array: placed after the static ones at launch
            self.dynamic_global = name
            return
        offset = -(-self.static_shared // 16) * 16
        self.globals[name] = (offset, size)
        self.static_shared = offset + size


def _walk(op):
    yield op
    for reg in op.operation.regions:
        for block in reg.blocks:
            for inner in block.operations:
                yield from _walk(inner)


def _sym(op) -> str:
    from mlir import ir

    return ir.StringAttr(op.operation.attributes["sym_name"]).value


def _array_attr(attrs, names, default):
    from mlir import ir

    for n in names:
        if n in attrs:
            return list(ir.DenseI32ArrayAttr(attrs[n]))
    return default
