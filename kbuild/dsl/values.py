"""Typed SSA values with arithmetic operators, so kernel code reads like the math.

`V` wraps an `ir.Value`. Float scalars and vectors use arith's float ops, integers (i1, i32,
i64, index) the integer ones. A Python number on either side becomes a constant of the other
operand's type (an int for a float operand too, never a float for an integer one); a scalar
(or 1-lane vector) combined with a vector is broadcast. Nothing else converts implicitly:
operands of different element types (f32 and bf16, i32 and i64, an integer and a float) or
vectors of different widths raise a TypeError / ValueError naming the function and both
types, before MLIR sees them. Everything is built at the current MLIR insertion point.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

from mlir import ir
from mlir.dialects import arith, llvm, math, vector

from ..dtypes import ELEMENT_BYTES
from .asm_semantics import register as register_asm

_SCALAR_TYPES = {
    "f32": ir.F32Type.get,
    "f16": ir.F16Type.get,
    "bf16": ir.BF16Type.get,
    "i8": lambda: ir.IntegerType.get_signless(8),
    "i32": lambda: ir.IntegerType.get_signless(32),
    "i64": lambda: ir.IntegerType.get_signless(64),
    "i1": lambda: ir.IntegerType.get_signless(1),
    "index": ir.IndexType.get,
}
_FLOATS = (ir.F32Type, ir.F16Type, ir.BF16Type, ir.F64Type)
_INTEGERS = (ir.IntegerType, ir.IndexType)


def describe(x: object) -> str:
    """An operand as an error message names it: a V's MLIR type ("f32", "vector<4xbf16>"),
    else the Python value's type and value."""
    if isinstance(x, V):
        return str(x.type)
    if isinstance(x, ir.Value):
        return f"a raw ir.Value of {x.type} (wrap it: V(value))"
    if isinstance(x, (bool, int, float)):
        return f"{type(x).__name__} {x!r}"
    if x is None:
        return "None"
    return type(x).__name__


def need_v(x: object, fn: str, what: str = "the operand") -> V:
    """`x` if it is a V, else a TypeError naming `fn` and what `x` is."""
    if not isinstance(x, V):
        raise TypeError(f"{fn}: {what} must be a V (a kernel value), got {describe(x)}")
    return x


def _is_integral(x: object) -> bool:
    """A Python int (a bool too) or another integer (numpy's); the common types without the
    slower ABC check."""
    t = type(x)
    if t is int or t is bool:
        return True
    return t is not float and t is not V and isinstance(x, numbers.Integral)


def _is_real(x: object) -> bool:
    """A Python int or float (or another real number: numpy's)."""
    t = type(x)
    if t is float or t is int or t is bool:
        return True
    return t is not V and isinstance(x, numbers.Real)


def need_int(x: object, fn: str, what: str, low: int = 1) -> int:
    """`x` if it is a Python int in [low, 2^31) (a width, a count), else a TypeError /
    ValueError."""
    if isinstance(x, bool) or not _is_integral(x):
        raise TypeError(f"{fn}: {what} must be a Python int, got {describe(x)}")
    if not low <= x < 2**31:
        raise ValueError(f"{fn}: {what} must be in [{low}, 2^31), got {x}")
    return int(x)


def element_bytes(dtype: str) -> int:
    return ELEMENT_BYTES[dtype_name(dtype, "dsl.element_bytes", ELEMENT_BYTES)]


def dtype_name(dtype: object, fn: str, known: dict | tuple | None = None) -> str:
    """`dtype` if it names one of `known` (default: the DSL's scalar types), else a
    TypeError / ValueError naming `fn` and the choices."""
    known = _SCALAR_TYPES if known is None else known
    if not isinstance(dtype, str):
        raise TypeError(f"{fn}: a dtype is a string such as 'f32', got {describe(dtype)}")
    if dtype not in known:
        raise ValueError(f"{fn}: unknown dtype {dtype!r}; one of {', '.join(known)}")
    return dtype


def scalar_type(dtype: str, fn: str = "dsl.scalar_type") -> ir.Type:
    make = _SCALAR_TYPES.get(dtype) if isinstance(dtype, str) else None
    return make() if make is not None else _SCALAR_TYPES[dtype_name(dtype, fn)]()


def vector_type(dtype: str, width: int, fn: str = "dsl.vector_type") -> ir.Type:
    return ir.VectorType.get([need_int(width, fn, "width")], scalar_type(dtype, fn))


def _element_type(t: ir.Type) -> ir.Type:
    return t.element_type if isinstance(t, ir.VectorType) else t


def _is_float(t: ir.Type) -> bool:
    return isinstance(_element_type(t), _FLOATS)


def _is_int(t: ir.Type) -> bool:
    """Integers, flags (i1) and index, scalar or vector."""
    return isinstance(_element_type(t), _INTEGERS)


def need_numeric(v: V, fn: str, what: str = "the operand") -> ir.Type:
    """The type of `v`, a float or integer V (scalar or vector), else a TypeError."""
    t = need_v(v, fn, what).type
    if not isinstance(_element_type(t), _FLOATS + _INTEGERS):
        hint = " (addresses: dsl.get_llvm_ptr)" if isinstance(t, llvm.PointerType) else ""
        raise TypeError(f"{fn}: {what} must be a float or integer value, got {t}{hint}")
    return t


def need_float(v: V, fn: str, what: str = "the operand") -> ir.Type:
    t = need_numeric(v, fn, what)
    if not isinstance(_element_type(t), _FLOATS):
        raise TypeError(f"{fn}: {what} must be a float value, got {t}")
    return t


def need_int_scalar(v: V, fn: str, what: str) -> V:
    """`v` if it is an integer scalar V (i32, i64, index, ...), else a TypeError."""
    t = need_numeric(v, fn, what)
    if not isinstance(t, _INTEGERS):
        raise TypeError(f"{fn}: {what} must be an integer scalar, got {t}")
    return v


def need_flag(cond: V, fn: str, what: str = "cond", vector_ok: bool = False) -> ir.Type:
    """The type of `cond`: i1, a flag (a comparison's result); a vector of flags where
    `vector_ok`."""
    t = need_v(cond, fn, what).type
    e = _element_type(t) if vector_ok else t
    if not (isinstance(e, ir.IntegerType) and ir.IntegerType(e).width == 1):
        kind = "an i1 flag or a vector of flags" if vector_ok else "an i1 flag (a scalar)"
        raise TypeError(f"{fn}: {what} must be {kind}, such as a comparison, got {t}")
    return t


NEG_INF = float("-inf")  # numbers for const/select/maximum: a max reduction's padding
POS_INF = float("inf")


def const(value: float | int, dtype: str | ir.Type = "f32") -> V:
    """A constant of `dtype` (a name such as "f32", or an ir.Type: a vector type splats it)."""
    return _const(value, dtype, "dsl.const")


def _const(value: float | int, dtype: str | ir.Type, fn: str) -> V:
    t = scalar_type(dtype, fn) if isinstance(dtype, str) else dtype
    if not isinstance(t, ir.Type):
        raise TypeError(f"{fn}: a dtype is a string such as 'f32' or an ir.Type, got {describe(t)}")
    if isinstance(t, ir.VectorType):
        return splat(_const(value, _element_type(t), fn), ir.VectorType(t).shape[0])
    if not _is_real(value):
        raise TypeError(f"{fn}: a constant is a Python int or float, got {describe(value)}")
    if isinstance(t, _FLOATS):
        attr = ir.FloatAttr.get(t, float(value))
    elif isinstance(t, _INTEGERS):
        attr = ir.IntegerAttr.get(t, _integer(value, t, fn))
    else:
        raise TypeError(f"{fn}: constants are floats or integers, not {t}")
    return V(arith.ConstantOp(t, attr).result)


def _integer(value: numbers.Real, t: ir.Type, fn: str) -> int:
    """`value` as an int for the integer type `t`: whole, and within its signed or unsigned
    range (bits beyond would be silently dropped)."""
    if not _is_integral(value):
        if value != value or value in (POS_INF, NEG_INF) or value != int(value):
            raise ValueError(f"{fn}: {value!r} is not a whole number, for {t}")
    value = int(value)
    bits = 64 if isinstance(t, ir.IndexType) else ir.IntegerType(t).width
    if not -(1 << (bits - 1)) <= value < (1 << bits):
        raise ValueError(f"{fn}: {value} does not fit in {t}")
    return value


def splat(scalar: V, width: int) -> V:
    """`width` copies of a scalar (or of a 1-lane vector's element) as a vector."""
    t = need_numeric(scalar, "dsl.splat", "the value")
    if isinstance(t, ir.VectorType):
        if ir.VectorType(t).shape[0] != 1:
            raise ValueError(f"dsl.splat: broadcasts a scalar or a 1-lane vector, got {t}")
        t = t.element_type
    width = need_int(width, "dsl.splat", "width")
    return V(vector.BroadcastOp(ir.VectorType.get([width], t), scalar.value).result)


def _number(x: object, t: ir.Type, fn: str) -> V:
    """A Python number beside an operand of type `t`, as a constant of that type."""
    if _is_integral(x) or (_is_real(x) and _is_float(t)):
        return _const(x, t, fn)
    if _is_real(x):
        raise TypeError(f"{fn}: a float ({x!r}) beside the integer operand {t}")
    raise TypeError(f"{fn}: operands are V values or Python numbers, got {describe(x)} beside {t}")


def _mismatch(fn: str, ta: ir.Type, tb: ir.Type) -> TypeError:
    ea, eb = _element_type(ta), _element_type(tb)
    if isinstance(ea, _FLOATS) and isinstance(eb, _FLOATS):
        hint = "convert one with dsl.cast / dsl.to_f32"
    elif isinstance(ea, _INTEGERS) and isinstance(eb, _INTEGERS):
        hint = "resize one with dsl.cast / dsl.i64 / dsl.i32"
    else:
        hint = "integers and floats do not mix"
    return TypeError(f"{fn}: operands of different element types, {ta} and {tb}: {hint}")


def same_shape(fn: str, a: V, b: V, ta: ir.Type, tb: ir.Type) -> tuple[V, V]:
    """a and b of the equal element types `ta` / `tb` brought to one shape: a scalar or 1-lane
    vector beside a vector is broadcast; vectors of different widths raise."""
    wa = ir.VectorType(ta).shape[0] if isinstance(ta, ir.VectorType) else 0  # 0: a scalar
    wb = ir.VectorType(tb).shape[0] if isinstance(tb, ir.VectorType) else 0
    if wa < wb and wa <= 1:
        return splat(a, wb), b
    if wb < wa and wb <= 1:
        return a, splat(b, wa)
    if wa == wb:
        return a, b
    raise ValueError(f"{fn}: vectors of different widths, {ta} and {tb}")


_SYMBOLS = {
    "__add__": "+",
    "__sub__": "-",
    "__mul__": "*",
    "__truediv__": "/",
    "__floordiv__": "//",
    "__mod__": "%",
    "__lt__": "<",
    "__le__": "<=",
    "__gt__": ">",
    "__ge__": ">=",
    "__and__": "&",
    "__or__": "|",
    "__rshift__": ">>",
}


def _op_name(method: str) -> str:
    """How errors name an operator: "V.__sub__ (a - b)", "V.__rsub__ (b - a)"."""
    if method in _SYMBOLS:
        return f"V.{method} (a {_SYMBOLS[method]} b)"
    return f"V.{method} (b {_SYMBOLS[method.replace('__r', '__', 1)]} a)"


_OP_NAMES = {
    m: _op_name(m) for m in (*_SYMBOLS, "__radd__", "__rsub__", "__rmul__", "__rtruediv__")
}


class V:
    """An SSA value with operators. `v.value` is the raw `ir.Value` for direct op calls."""

    __slots__ = ("value",)

    def __init__(self, value: ir.Value | V):
        if isinstance(value, V):
            value = value.value
        elif not isinstance(value, ir.Value):
            hint = " (a number: dsl.const)" if isinstance(value, numbers.Number) else ""
            raise TypeError(f"V wraps an ir.Value (an op's result), got {describe(value)}{hint}")
        self.value = value

    @property
    def type(self) -> ir.Type:
        return self.value.type

    @property
    def is_float(self) -> bool:
        return _is_float(self.type)

    @property
    def width(self) -> int:
        """Lanes of a vector value; 1 for a scalar."""
        return self.type.shape[0] if isinstance(self.type, ir.VectorType) else 1

    def __repr__(self) -> str:
        return f"V({self.type})"

    def __bool__(self) -> bool:
        raise TypeError(
            f"a V ({self.type}) has no Python truth value: it is known only when the kernel "
            "runs; use dsl.select / dsl.if_then / dsl.if_else, and & | ~ for flags (not "
            "if / and / or / not)"
        )

    def _coerce(self, other: V | float | int, fn: str = "V") -> tuple[ir.Value, ir.Value]:
        ta = need_numeric(self, fn)
        if not isinstance(other, V):
            other = _number(other, ta, fn)
        tb = need_numeric(other, fn)
        if ta == tb:
            return self.value, other.value
        if _element_type(ta) != _element_type(tb):
            raise _mismatch(fn, ta, tb)
        a, b = same_shape(fn, self, other, ta, tb)
        return a.value, b.value

    def _binary(self, other, float_op, int_op, fn: str, reverse: bool = False) -> V:
        a, b = self._coerce(other, _OP_NAMES[fn])
        if reverse:
            a, b = b, a
        return V((float_op if self.is_float else int_op)(a, b))

    def __add__(self, o):
        return self._binary(o, arith.addf, arith.addi, "__add__")

    def __radd__(self, o):
        return self._binary(o, arith.addf, arith.addi, "__radd__", reverse=True)

    def __sub__(self, o):
        return self._binary(o, arith.subf, arith.subi, "__sub__")

    def __rsub__(self, o):
        return self._binary(o, arith.subf, arith.subi, "__rsub__", reverse=True)

    def __mul__(self, o):
        return self._binary(o, arith.mulf, arith.muli, "__mul__")

    def __rmul__(self, o):
        return self._binary(o, arith.mulf, arith.muli, "__rmul__", reverse=True)

    def __truediv__(self, o):
        return self._binary(o, arith.divf, arith.divsi, "__truediv__")

    def __rtruediv__(self, o):
        return self._binary(o, arith.divf, arith.divsi, "__rtruediv__", reverse=True)

    def __floordiv__(self, o):
        return self._binary(o, arith.divf, arith.divsi, "__floordiv__")

    def __mod__(self, o):
        return self._binary(o, arith.remf, arith.remsi, "__mod__")

    def __neg__(self) -> V:
        need_numeric(self, "V.__neg__ (-a)")
        return V(arith.negf(self.value)) if self.is_float else 0 - self

    def _compare(self, other, fpred: str, ipred: str, fn: str = "V") -> V:
        a, b = self._coerce(other, fn)
        if self.is_float:
            return V(arith.cmpf(getattr(arith.CmpFPredicate, fpred), a, b))
        return V(arith.cmpi(getattr(arith.CmpIPredicate, ipred), a, b))

    def __lt__(self, o):
        return self._compare(o, "OLT", "slt", _OP_NAMES["__lt__"])

    def __le__(self, o):
        return self._compare(o, "OLE", "sle", _OP_NAMES["__le__"])

    def __gt__(self, o):
        return self._compare(o, "OGT", "sgt", _OP_NAMES["__gt__"])

    def __ge__(self, o):
        return self._compare(o, "OGE", "sge", _OP_NAMES["__ge__"])

    def _bitwise(self, other, op, method: str) -> V:
        fn = _OP_NAMES[method]
        if not _is_int(need_numeric(self, fn)):
            raise TypeError(f"{fn}: takes integers or flags (i1), got {self.type}")
        a, b = self._coerce(other, fn)
        return V(op(a, b))

    def __and__(self, o):
        return self._bitwise(o, arith.andi, "__and__")

    def __or__(self, o):
        return self._bitwise(o, arith.ori, "__or__")

    def __rshift__(self, o):
        """Logical (unsigned) shift right of an integer."""
        return self._bitwise(o, arith.shrui, "__rshift__")

    def __invert__(self) -> V:
        """Logical not of a flag (i1); bitwise not of other integers."""
        t = need_numeric(self, "V.__invert__ (~a)")
        if not _is_int(t):
            raise TypeError(f"V.__invert__ (~a): takes integers or flags (i1), got {t}")
        return V(arith.xori(self.value, const(-1, t).value))

    __hash__ = None  # comparisons build IR, so values are not dict keys


# ----------------------------------------------------------------------------- conversions


def cast(v: V, dtype: str, fn: str = "dsl.cast") -> V:
    """Float width conversion (extf / truncf) or integer resize, elementwise for vectors."""
    source = need_numeric(v, fn, "the value")
    target = scalar_type(dtype, fn)
    if _is_float(source) != isinstance(target, _FLOATS):
        raise TypeError(
            f"{fn}: converts float widths (f32, f16, bf16) or integer sizes (i1, i8, i32, i64, "
            f"index), not {source} to {dtype}: integers and floats do not mix"
        )
    if isinstance(source, ir.VectorType):
        target = ir.VectorType.get([v.width], target)
    if source == target:
        return v
    if isinstance(_element_type(source), ir.IndexType) or isinstance(
        _element_type(target), ir.IndexType
    ):
        return V(arith.index_cast(target, v.value))
    src_bits = _element_type(source).width
    dst_bits = _element_type(target).width
    if v.is_float:
        if src_bits == dst_bits:  # f16 <-> bf16: exactly to f32, then one rounding
            v = cast(v, "f32", fn)
            src_bits = 32
        return V((arith.extf if dst_bits > src_bits else arith.truncf)(target, v.value))
    return V((arith.extsi if dst_bits > src_bits else arith.trunci)(target, v.value))


def to_f32(v: V) -> V:
    return cast(v, "f32", "dsl.to_f32")


def rewiden(v: V, by_words: bool = False) -> V:
    """Widen to fp32 a second time, in a form compilers do not merge with `to_f32`.

    A kernel that needs a row twice (statistics, then output) would otherwise get one fp32
    copy kept alive in between: twice the registers of the packed bf16 row. bf16 is widened
    here by moving its bits into the top half of an fp32 word (exact: a bf16 is a truncated
    fp32), so the raw row stays packed two to a register until its second use. Other dtypes
    widen as usual.

    `by_words` (vectors of an even width): straight from the packed 32-bit words, the low
    value shifted up and the high one masked, one integer op a value; the default goes
    through 16-bit halves (an unpack, a zero-extension and a shift), which some kernels at
    a register cap allocate better (the RMSNorm forward and backward rows that the
    word form made spill 4-8 bytes).
    """
    element = _element_type(need_float(v, "dsl.rewiden", "the value"))
    if not isinstance(element, ir.BF16Type):
        return cast(v, "f32", "dsl.rewiden")
    if by_words and v.width % 2 == 0:
        i32 = ir.IntegerType.get_signless(32)
        words_type = ir.VectorType.get([v.width // 2], i32)
        words = vector.bitcast(words_type, v.value)
        low = arith.shli(words, const(16, words_type).value)
        high = arith.andi(words, const(-65536, words_type).value)
        half = v.width // 2
        order = [j for i in range(half) for j in (i, half + i)]  # low, high of each word
        both = vector.shuffle(low, high, order)
        return V(arith.bitcast(ir.VectorType.get([v.width], ir.F32Type.get()), both))
    shape = [v.width] if isinstance(v.type, ir.VectorType) else None

    def typ(t: ir.Type) -> ir.Type:
        return ir.VectorType.get(shape, t) if shape else t

    bits = arith.bitcast(typ(ir.IntegerType.get_signless(16)), v.value)
    word = arith.extui(typ(ir.IntegerType.get_signless(32)), bits)
    word = arith.shli(word, const(16, typ(ir.IntegerType.get_signless(32))).value)
    return V(arith.bitcast(typ(ir.F32Type.get()), word))


def inline_asm(
    text: str,
    constraints: str,
    operands: list[V],
    result: ir.Type | None = None,
    meaning: Callable | None = None,
):
    """Inline PTX, kept where it is written (has side effects: never hoisted, merged or
    dropped). Returns the result value (an `ir.Value`) when `result` names its type.
    `meaning(machine, *operands) -> results` is what it computes, for the interpreter
    (dsl.asm_semantics); a template emitted without one cannot be interpreted."""
    if meaning is not None:
        register_asm(text, meaning)
    for i, operand in enumerate(operands):
        need_v(operand, "dsl.inline_asm", f"operand {i}")
    op = llvm.InlineAsmOp(
        result, [v.value for v in operands], text, constraints, has_side_effects=True
    )
    return op.result if result is not None else None


def _same(machine, word):
    return [word]


def opaque(v: V) -> V:
    """`v` unchanged, through a register move the compiler cannot see into: a value held
    across a loop and passed through this at each use is not hoisted, so work derived from
    it (an fp32 widening of a packed bf16 row) stays inside the loop instead of taking twice
    the registers for the whole loop. The moves cost nothing after ptxas; 32-bit words."""
    t = need_numeric(v, "dsl.opaque", "the value")
    element = _element_type(t)
    if isinstance(element, ir.IndexType):
        raise TypeError("dsl.opaque: index values have no fixed width; cast to i32 or i64 first")
    width = element.width if _is_float(t) else ir.IntegerType(element).width
    bits = v.width * width
    if bits % 32:
        raise ValueError(f"dsl.opaque: takes values of whole 32-bit words, not {t}")
    i32 = ir.IntegerType.get_signless(32)
    words = bits // 32
    packed = ir.VectorType.get([words], i32)
    as_words = vector.bitcast(packed, v.value) if isinstance(t, ir.VectorType) else None
    if as_words is None:
        as_words = vector.broadcast(ir.VectorType.get([1], t), v.value)
        as_words = vector.bitcast(packed, as_words)
    out = as_words
    for i in range(words):
        word = V(vector.extract(out, [], [i]))
        moved = inline_asm("mov.b32 $0, $1;", "=r,r", [word], i32, meaning=_same)
        out = vector.insert(moved, out, [], [i])
    if isinstance(t, ir.VectorType):
        return V(vector.bitcast(t, out))
    return V(vector.extract(vector.bitcast(ir.VectorType.get([1], t), out), [], [0]))


def eq(a: V, b: V | int | float) -> V:
    """a == b as a flag (V keeps Python's == for identity: values sit in lists)."""
    return need_v(a, "dsl.eq", "a")._compare(b, "OEQ", "eq", "dsl.eq")


def ne(a: V, b: V | int | float) -> V:
    return need_v(a, "dsl.ne", "a")._compare(b, "UNE", "ne", "dsl.ne")


def _index(v: V | int, dtype: str, fn: str) -> V:
    if _is_integral(v):
        return _const(v, dtype, fn)
    if not _is_int(need_numeric(v, fn, "the value")):
        raise TypeError(f"{fn}: converts integers (or Python ints), got {v.type}")
    return cast(v, dtype, fn)


def i64(v: V | int) -> V:
    return _index(v, "i64", "dsl.i64")


def i32(v: V | int) -> V:
    return _index(v, "i32", "dsl.i32")


# ----------------------------------------------------------------------------- math


def rsqrt(v: V) -> V:
    need_float(v, "dsl.rsqrt", "the value")
    return V(math.rsqrt(v.value))


def fma(a: V, b: V | float, c: V | float) -> V:
    """a * b + c rounded once (fma.rn): one instruction where a multiply and an add take two
    (the arith ops lower to mul.rn and add.rn, which ptxas never contracts). Scalars of b
    and c broadcast over a vector a."""
    need_float(a, "dsl.fma", "a")
    a_, b_ = a._coerce(b, "dsl.fma")
    wide, c_ = V(a_)._coerce(c, "dsl.fma")
    if wide is not a_:  # c was the only vector: b broadcasts too
        _, b_ = V(wide)._coerce(V(b_), "dsl.fma")
    return V(math.fma(wide, b_, c_))


def dot(a: V, b: V, start: V | float = 0.0) -> V:
    """((start + a[0] * b[0]) + a[1] * b[1]) + ...: the lanes in order, one fma each (the
    products are not rounded on their own)."""
    ta, tb = need_float(a, "dsl.dot", "a"), need_float(b, "dsl.dot", "b")
    if ta != tb:
        raise TypeError(f"dsl.dot: a and b must have one type, got {ta} and {tb}")
    elem = _element_type(ta)
    if isinstance(start, V):
        if start.type != elem:
            raise TypeError(f"dsl.dot: start must be a {elem} scalar, got {start.type}")
        total = start
    else:
        total = _number(start, elem, "dsl.dot")
    if a.width == 1:
        return fma(a, b, total)
    for i in range(a.width):
        lane_a = V(vector.extract(a.value, [], [i]))
        lane_b = V(vector.extract(b.value, [], [i]))
        total = fma(lane_a, lane_b, total)
    return total


def select(cond: V, a: V | float | int, b: V | float | int) -> V:
    """a where `cond` holds, else b: lane by lane for a vector of flags; a scalar flag picks
    one whole value. A number becomes a constant of the other value's type; a scalar value
    beside vectors is broadcast."""
    fn = "dsl.select"
    tc = need_flag(cond, fn, vector_ok=True)
    if not isinstance(b, V):
        if not isinstance(a, V):
            raise TypeError(
                f"{fn}: a or b must be a V (a number takes the other's type), got "
                f"{describe(a)} and {describe(b)}"
            )
        b = _number(b, a.type, fn)
    elif not isinstance(a, V):
        a = _number(a, b.type, fn)
    ta, tb = a.type, b.type
    if _element_type(ta) != _element_type(tb):
        raise TypeError(f"{fn}: the two values have different element types, {ta} and {tb}")
    widths = {ir.VectorType(t).shape[0] for t in (tc, ta, tb) if isinstance(t, ir.VectorType)}
    if not widths:
        return V(arith.select(cond.value, a.value, b.value))
    width = max(widths)
    if widths - {1, width} or isinstance(tc, ir.VectorType) and tc.shape[0] != width:
        raise ValueError(f"{fn}: vectors of different widths, cond {tc}, values {ta} and {tb}")
    a, b = (splat(v, width) if v.type != _vector_of(v, width) else v for v in (a, b))
    return V(arith.select(cond.value, a.value, b.value))


def _vector_of(v: V, width: int) -> ir.Type:
    return ir.VectorType.get([width], _element_type(v.type))


def minimum(a: V, b: V | int | float) -> V:
    """The smaller of a and b, lane by lane: signed for integers; for floats NaN if either is
    NaN and -0 below +0 (arith.minimumf: `min.NaN.f32` on NVIDIA, `v_min_f32` with a NaN
    check on AMD)."""
    a_, b_ = need_v(a, "dsl.minimum", "a")._coerce(b, "dsl.minimum")
    return V(arith.minsi(a_, b_)) if not a.is_float else V(arith.minimumf(a_, b_))


def maximum(a: V, b: V | int | float) -> V:
    """The larger of a and b, lane by lane, as `minimum` orders them (`max.NaN.f32` on
    NVIDIA): a row maximum propagates a NaN, as torch's does; pad it with NEG_INF."""
    a_, b_ = need_v(a, "dsl.maximum", "a")._coerce(b, "dsl.maximum")
    return V(arith.maxsi(a_, b_)) if not a.is_float else V(arith.maximumf(a_, b_))


def hsum(v: V) -> V:
    """Sum of a vector's lanes (a scalar passes through)."""
    t = need_numeric(v, "dsl.hsum", "the value")
    if v.width == 1:
        return v
    return V(vector.reduction(t.element_type, vector.CombiningKind.ADD, v.value))


def split(v: V, width: int) -> list[V]:
    """A vector as consecutive pieces of `width` lanes (a scalar, or width >= lanes: [v])."""
    need_v(v, "dsl.split", "the value")
    width = need_int(width, "dsl.split", "width")
    if v.width <= width:
        return [v]
    if v.width % width:
        raise ValueError(f"dsl.split: {v.type} does not split into pieces of {width} lanes")
    # vector.shuffle lowers to llvm.shufflevector (extract_strided_slice has no GPU lowering).
    return [
        V(vector.shuffle(v.value, v.value, list(range(o, o + width))))
        for o in range(0, v.width, width)
    ]


def join(parts: list[V]) -> V:
    """The inverse of `split`: consecutive pieces (vectors of one element type) concatenated
    into one vector; a single piece is returned as it is (a scalar too)."""
    if isinstance(parts, V) or not isinstance(parts, (list, tuple)):
        raise TypeError(f"dsl.join: takes a list of V pieces, got {describe(parts)}")
    if not parts:
        raise ValueError("dsl.join: takes at least one piece, got an empty list")
    types = [need_v(p, "dsl.join", f"piece {i}").type for i, p in enumerate(parts)]
    if len(parts) == 1:
        return parts[0]
    parts = list(parts)
    elements = {str(_element_type(t)) for t in types}
    if len(elements) > 1 or not all(isinstance(t, ir.VectorType) for t in types):
        names = [str(t) for t in types] if len(types) <= 4 else list(dict.fromkeys(map(str, types)))
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        scalars = sum(not isinstance(t, ir.VectorType) for t in types)
        note = "" if not scalars else " (scalars)" if scalars == len(types) else " (some scalars)"
        raise TypeError(f"dsl.join: expects vectors of one element type, got {listed}{note}")
    while len(parts) > 1:
        pairs = zip(parts[::2], parts[1::2], strict=False)  # an odd last piece waits
        joined = [
            V(vector.shuffle(a.value, b.value, list(range(a.width + b.width)))) for a, b in pairs
        ]
        parts = joined + parts[len(parts) - len(parts) % 2 :]
    return parts[0]
