"""MLIR types as the interpreter holds their values: one numpy array per SSA value, one
entry per thread (lane), with a trailing axis for vectors.

- integers of every width (and `index`) are int64 arrays kept wrapped to their width, signed;
  i1 is bool;
- f32 is float32 and f16 float16 (numpy rounds each operation to nearest even, as the GPU's
  .rn instructions do); bf16 has no numpy type: float32 arrays holding values already rounded
  to bf16, rounded again after every bf16 operation;
- pointers are int64 addresses: global ones the tensors' own host addresses, shared ones
  offsets into the block's shared window (see memory.py).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np

GLOBAL, SHARED, SHARED_CLUSTER = 1, 3, 7


@dataclass(frozen=True)
class Type:
    kind: str  # "int", "float", "ptr", "none"
    name: str  # "i32", "index", "f32", "bf16", "ptr"
    width: int  # bits of one element (pointers: 64)
    lanes: int | None = None  # vector length, None for a scalar
    space: int = 0  # a pointer's address space

    @property
    def bytes(self) -> int:
        return (self.width // 8) * (self.lanes or 1)

    @property
    def element(self) -> Type:
        return Type(self.kind, self.name, self.width, None, self.space)


_SCALARS = {
    "i1": ("int", 1),
    "i8": ("int", 8),
    "i16": ("int", 16),
    "i32": ("int", 32),
    "i64": ("int", 64),
    "index": ("int", 64),
    "f16": ("float", 16),
    "bf16": ("float", 16),
    "f32": ("float", 32),
    "f64": ("float", 64),
}


@functools.cache
def parse_type(text: str) -> Type:
    """A Type from MLIR's spelling of it ("vector<8xbf16>", "!llvm.ptr<3>", "i64")."""
    text = text.strip()
    if text in _SCALARS:
        kind, width = _SCALARS[text]
        return Type(kind, text, width)
    m = re.fullmatch(r"vector<(\d+)x(\w+)>", text)
    if m:
        base = parse_type(m.group(2))
        return Type(base.kind, base.name, base.width, int(m.group(1)))
    m = re.fullmatch(r"!llvm\.ptr(?:<(\d+)>)?", text)
    if m:
        return Type("ptr", "ptr", 64, None, int(m.group(1) or 0))
    if text in ("none", "!llvm.void"):
        return Type("none", "none", 0)
    raise NotImplementedError(f"the interpreter has no values of type {text}")


@functools.cache
def memory_size(text: str) -> int:
    """Bytes of an LLVM element type in memory (GEP strides, array globals)."""
    text = text.strip()
    m = re.fullmatch(r"!llvm\.array<(\d+)\s*x\s*(.+)>", text)
    if m:
        return int(m.group(1)) * memory_size(m.group(2))
    t = parse_type(text)
    return max(1, t.width // 8) * (t.lanes or 1) if t.kind != "ptr" else 8


NUMPY = {"f32": np.float32, "f16": np.float16, "f64": np.float64, "bf16": np.float32}
_STORAGE = {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}


def wrap(x: np.ndarray, width: int) -> np.ndarray:
    """Integers reduced to `width` bits, two's complement, signed (kept as int64)."""
    if width == 64:
        return x.astype(np.int64, copy=False)
    if width == 1:
        return (x & 1).astype(bool)
    half = 1 << (width - 1)
    return ((x.astype(np.int64) + half) & ((1 << width) - 1)) - half


def unsigned(x: np.ndarray, width: int) -> np.ndarray:
    """The same bits read as an unsigned integer (uint64 for 64 bits)."""
    if width == 64:
        return x.astype(np.int64).view(np.uint64)
    if width == 1:
        return x.astype(np.int64)
    return x.astype(np.int64) & ((1 << width) - 1)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16, ties to even (as cvt.rn.bf16.f32)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, np.uint32(0x7FC00000), rounded)
    return rounded.view(np.float32)


def as_float(x: np.ndarray, name: str) -> np.ndarray:
    """Values as the float type `name` holds them (rounded to it)."""
    if name == "bf16":
        return round_bf16(np.asarray(x, dtype=np.float32))
    return np.asarray(x).astype(NUMPY[name], copy=False)


def to_bytes(values: np.ndarray, t: Type) -> np.ndarray:
    """(lanes, t.bytes) uint8: what a store of `values` of type `t` writes."""
    n = values.shape[0]
    if t.kind == "float":
        if t.name == "bf16":
            raw = (np.ascontiguousarray(values, dtype=np.float32).view(np.uint32) >> 16).astype(
                np.uint16
            )
        else:
            raw = np.ascontiguousarray(values, dtype=NUMPY[t.name])
    elif t.kind == "ptr":
        raw = np.ascontiguousarray(values, dtype=np.int64)
    elif t.width == 1:
        raw = np.ascontiguousarray(values, dtype=np.uint8)
    else:
        raw = np.ascontiguousarray(values.astype(_STORAGE[t.width]))
    return raw.view(np.uint8).reshape(n, t.bytes)


def from_bytes(raw: np.ndarray, t: Type) -> np.ndarray:
    """Values of type `t` from (lanes, t.bytes) uint8 (a load)."""
    raw = np.ascontiguousarray(raw)
    n = raw.shape[0]
    shape = (n,) if t.lanes is None else (n, t.lanes)
    if t.kind == "float":
        if t.name == "bf16":
            bits = raw.view(np.uint16).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(shape)
        return raw.view(NUMPY[t.name]).reshape(shape)
    if t.kind == "ptr":
        return raw.view(np.int64).reshape(shape)
    if t.width == 1:
        return raw.view(np.uint8).reshape(shape).astype(bool)
    return raw.view(_STORAGE[t.width]).reshape(shape).astype(np.int64)


def zeros(t: Type, lanes: int) -> np.ndarray:
    shape = (lanes,) if t.lanes is None else (lanes, t.lanes)
    if t.kind == "float":
        return np.zeros(shape, NUMPY[t.name])
    return np.zeros(shape, bool if t.width == 1 else np.int64)


def splat(value, t: Type, lanes: int) -> np.ndarray:
    """One scalar `value` of type `t` in every lane (a kernel argument)."""
    if t.kind == "float":
        return np.full(lanes, value, NUMPY[t.name])
    return np.full(lanes, int(value), np.int64)


def as_type(x: np.ndarray, t: Type) -> np.ndarray:
    """A result as its type holds it: ints wrapped, bf16 rounded."""
    if t.kind == "int":
        return wrap(x, t.width) if t.width != 1 else x.astype(bool)
    if t.kind == "float":
        return as_float(x, t.name)
    return x
