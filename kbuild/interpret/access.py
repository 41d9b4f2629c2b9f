"""Memory ops: addresses (addressof, getelementptr), loads, stores, atomics, cp.async."""

from __future__ import annotations

import numpy as np

from . import types as T
from .op_table import int_attr, op, operand_slots, operand_type, result_slots, result_type
from .types import GLOBAL, SHARED, SHARED_CLUSTER, parse_type


@op("llvm.mlir.addressof")
def _addressof(program, o):
    from mlir import ir

    (r,) = result_slots(program, o)
    name = ir.FlatSymbolRefAttr(o.attributes["global_name"]).value
    if name == program.dynamic_global:
        offset = None
    else:
        offset = program.globals[name][0]

    def run(m):
        m.vals[r] = np.full(m.lanes, m.dynamic_base if offset is None else offset, np.int64)

    return run


@op("llvm.getelementptr")
def _gep(program, o):
    from mlir import ir

    ins, (r,) = operand_slots(program, o), result_slots(program, o)
    raw = list(ir.DenseI32ArrayAttr(o.attributes["rawConstantIndices"]))
    elem = str(ir.TypeAttr(o.attributes["elem_type"]).value)
    if len(raw) != 1:
        raise NotImplementedError(f"getelementptr with {len(raw)} indices")
    size = T.memory_size(elem)
    dynamic = raw[0] == -(2**31)
    const = raw[0]

    def run(m):
        base = m.vals[ins[0]]
        index = m.vals[ins[1]] if dynamic else const
        m.vals[r] = base + index * size

    return run


@op("llvm.ptrtoint", "llvm.inttoptr", "llvm.addrspacecast")
def _ptr_cast(program, o):
    (a,), (r,) = operand_slots(program, o), result_slots(program, o)
    dst = result_type(o)

    def run(m):
        v = m.vals[a]
        m.vals[r] = T.wrap(v, dst.width) if dst.kind == "int" else v.copy()

    return run


def _alignment(o, t: T.Type) -> int:
    if "alignment" in o.attributes:
        return int_attr(o, "alignment")
    return max(1, t.width // 8)


def _active(m) -> np.ndarray:
    return np.nonzero(m.mask)[0]


def read(m, space: int, lanes, addr, t: T.Type, align: int, what: str = "load") -> np.ndarray:
    """Values of type `t` at each lane's address (lanes: the active lane indices)."""
    _check_alignment(m, lanes, addr, align, what)
    size = t.bytes
    if space in (GLOBAL, 0):
        region, offset = m.gmem.locate(addr, size)
        _check_global(m, lanes, addr, region, size, what)
        return T.from_bytes(m.gmem.read(region, offset, size), t)
    flat, owner = m.shared_flat(lanes, addr, size, what, space == SHARED_CLUSTER)
    m.check_race(lanes, flat, size, owner, write=False)
    raw = m.smem.flat[flat[:, None] + np.arange(size)]
    return T.from_bytes(raw, t)


def write(m, space: int, lanes, addr, values, t: T.Type, align: int, what="store") -> None:
    _check_alignment(m, lanes, addr, align, what)
    size = t.bytes
    raw = T.to_bytes(values, t)
    if space in (GLOBAL, 0):
        region, offset = m.gmem.locate(addr, size)
        _check_global(m, lanes, addr, region, size, what)
        m.gmem.write(region, offset, raw)
        return
    flat, owner = m.shared_flat(lanes, addr, size, what, space == SHARED_CLUSTER)
    m.check_race(lanes, flat, size, owner, write=True)
    m.smem.flat[flat[:, None] + np.arange(size)] = raw


def _check_alignment(m, lanes, addr, align, what) -> None:
    bad = addr % align != 0
    if bad.any():
        i = int(np.argmax(bad))
        raise m.fault(
            f"misaligned {what} at {int(addr[i]):#x} (the access needs {align}-byte alignment)",
            int(lanes[i]),
        )


def _check_global(m, lanes, addr, region, size, what) -> None:
    bad = region < 0
    if bad.any():
        i = int(np.argmax(bad))
        raise m.fault(
            f"out-of-bounds global {what} of {size} bytes at {int(addr[i]):#x} (no tensor "
            "holds those bytes)",
            int(lanes[i]),
        )


@op("llvm.load")
def _load(program, o):
    (p,), (r,) = operand_slots(program, o), result_slots(program, o)
    t = result_type(o)
    space = operand_type(o).space
    align = _alignment(o, t)

    def run(m):
        lanes = _active(m)
        out = T.zeros(t, m.lanes)
        if lanes.size:
            out[lanes] = read(m, space, lanes, m.vals[p][lanes], t, align)
        m.vals[r] = out

    return run


@op("llvm.store")
def _store(program, o):
    v, p = operand_slots(program, o)
    t = operand_type(o, 0)
    space = operand_type(o, 1).space
    align = _alignment(o, t)

    def run(m):
        lanes = _active(m)
        if lanes.size:
            write(m, space, lanes, m.vals[p][lanes], m.vals[v][lanes], t, align)

    return run


_ATOMIC = {
    "add": lambda old, v: old + v,
    "fadd": lambda old, v: old + v,
    "sub": lambda old, v: old - v,
    "fsub": lambda old, v: old - v,
    "max": max,
    "min": min,
    "fmax": max,
    "fmin": min,
    "xchg": lambda old, v: v,
    "and": lambda old, v: old & v,
    "or": lambda old, v: old | v,
    "xor": lambda old, v: old ^ v,
}


@op("llvm.atomicrmw")
def _atomicrmw(program, o):
    (p, v), (r,) = operand_slots(program, o), result_slots(program, o)
    kind = str(o).split("llvm.atomicrmw", 1)[1].split()[0]
    fn = _ATOMIC[kind]
    t = result_type(o)
    space = operand_type(o, 0).space

    def run(m):  # one lane at a time, in lane order: each sees the one before
        lanes = _active(m)
        out = T.zeros(t, m.lanes)
        addr = m.vals[p]
        for lane in lanes:
            one = np.array([lane])
            old = read(m, space, one, addr[one], t, t.bytes, "atomic")
            new = T.as_float(fn(old, m.vals[v][one]), t.name) if t.kind == "float" else None
            if new is None:
                new = T.wrap(np.asarray(fn(old, m.vals[v][one])), t.width)
            write(m, space, one, addr[one], new, t, t.bytes, "atomic")
            out[lane] = old[0]
        m.vals[r] = out

    return run


@op("nvvm.cp.async.shared.global")
def _cp_async(program, o):
    dst, src = operand_slots(program, o)[:2]
    size = int_attr(o, "size")
    t = parse_type(f"vector<{size}xi8>")

    def run(m):  # copied at once: the wait that follows orders nothing more here
        lanes = _active(m)
        if lanes.size:
            values = read(m, GLOBAL, lanes, m.vals[src][lanes], t, size, "cp.async read")
            write(m, SHARED, lanes, m.vals[dst][lanes], values, t, size, "cp.async write")

    return run


def _nothing(program, o):
    def run(m):
        return None

    return run


for _name in (
    "nvvm.cp.async.commit.group",
    "nvvm.cp.async.wait.group",
    "nvvm.cp.async.bulk.prefetch",
    "llvm.intr.prefetch",
):
    op(_name)(_nothing)
