"""Typed SSA values with arithmetic operators, so kernel code reads like the math.

`V` wraps an `ir.Value`. Float scalars and vectors use arith's float ops, integers (i32, i64,
index) the integer ones. A Python number on either side becomes a constant of the other
operand's type; a scalar combined with a vector is broadcast. Everything is built at the
current MLIR insertion point.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, llvm, math, vector

from ..dtypes import ELEMENT_BYTES


def element_bytes(dtype: str) -> int:
    return ELEMENT_BYTES[dtype]


def scalar_type(dtype: str) -> ir.Type:
    return {
        "f32": ir.F32Type.get,
        "f16": ir.F16Type.get,
        "bf16": ir.BF16Type.get,
        "i8": lambda: ir.IntegerType.get_signless(8),
        "i32": lambda: ir.IntegerType.get_signless(32),
        "i64": lambda: ir.IntegerType.get_signless(64),
        "i1": lambda: ir.IntegerType.get_signless(1),
        "index": ir.IndexType.get,
    }[dtype]()


def vector_type(dtype: str, width: int) -> ir.Type:
    return ir.VectorType.get([width], scalar_type(dtype))


def _element_type(t: ir.Type) -> ir.Type:
    return t.element_type if isinstance(t, ir.VectorType) else t


def _is_float(t: ir.Type) -> bool:
    return isinstance(_element_type(t), (ir.F32Type, ir.F16Type, ir.BF16Type))


NEG_INF = float("-inf")  # numbers for const/select/maximum: a max reduction's padding
POS_INF = float("inf")


def const(value: float | int, dtype: str | ir.Type = "f32") -> V:
    t = scalar_type(dtype) if isinstance(dtype, str) else dtype
    if isinstance(t, ir.VectorType):
        return splat(const(value, _element_type(t)), ir.VectorType(t).shape[0])
    attr = ir.FloatAttr.get(t, float(value)) if _is_float(t) else ir.IntegerAttr.get(t, int(value))
    return V(arith.ConstantOp(t, attr).result)


def splat(scalar: V, width: int) -> V:
    return V(vector.BroadcastOp(ir.VectorType.get([width], scalar.type), scalar.value).result)


class V:
    """An SSA value with operators. `v.value` is the raw `ir.Value` for direct op calls."""

    __slots__ = ("value",)

    def __init__(self, value: ir.Value | V):
        self.value = value.value if isinstance(value, V) else value

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

    def _coerce(self, other: V | float | int) -> tuple[ir.Value, ir.Value]:
        if not isinstance(other, V):
            other = const(other, self.type)
        a, b = self, other
        if a.width != b.width:  # scalar op vector: broadcast the scalar
            if a.width == 1:
                a = splat(a, b.width)
            else:
                b = splat(b, a.width)
        return a.value, b.value

    def _binary(self, other, float_op, int_op, reverse: bool = False) -> V:
        a, b = self._coerce(other)
        if reverse:
            a, b = b, a
        return V((float_op if self.is_float else int_op)(a, b))

    def __add__(self, o):
        return self._binary(o, arith.addf, arith.addi)

    def __radd__(self, o):
        return self._binary(o, arith.addf, arith.addi, reverse=True)

    def __sub__(self, o):
        return self._binary(o, arith.subf, arith.subi)

    def __rsub__(self, o):
        return self._binary(o, arith.subf, arith.subi, reverse=True)

    def __mul__(self, o):
        return self._binary(o, arith.mulf, arith.muli)

    def __rmul__(self, o):
        return self._binary(o, arith.mulf, arith.muli, reverse=True)

    def __truediv__(self, o):
        return self._binary(o, arith.divf, arith.divsi)

    def __rtruediv__(self, o):
        return self._binary(o, arith.divf, arith.divsi, reverse=True)

    def __floordiv__(self, o):
        return self._binary(o, arith.divf, arith.divsi)

    def __mod__(self, o):
        return self._binary(o, arith.remf, arith.remsi)

    def __neg__(self) -> V:
        return V(arith.negf(self.value)) if self.is_float else 0 - self

    def _compare(self, other, fpred: str, ipred: str) -> V:
        a, b = self._coerce(other)
        if self.is_float:
            return V(arith.cmpf(getattr(arith.CmpFPredicate, fpred), a, b))
        return V(arith.cmpi(getattr(arith.CmpIPredicate, ipred), a, b))

    def __lt__(self, o):
        return self._compare(o, "OLT", "slt")

    def __le__(self, o):
        return self._compare(o, "OLE", "sle")

    def __gt__(self, o):
        return self._compare(o, "OGT", "sgt")

    def __ge__(self, o):
        return self._compare(o, "OGE", "sge")

    def __and__(self, o):
        a, b = self._coerce(o)
        return V(arith.andi(a, b))

    def __or__(self, o):
        a, b = self._coerce(o)
        return V(arith.ori(a, b))

    def __rshift__(self, o):
        """Logical (unsigned) shift right of an integer."""
        a, b = self._coerce(o)
        return V(arith.shrui(a, b))

    def __invert__(self) -> V:
        """Logical not of a flag (i1); bitwise not of other integers."""
        return V(arith.xori(self.value, const(-1, self.type).value))

    __hash__ = None  # comparisons build IR, so values are not dict keys


# ----------------------------------------------------------------------------- conversions


def cast(v: V, dtype: str) -> V:
    """Float width conversion (extf / truncf) or integer resize, elementwise for vectors."""
    target = scalar_type(dtype)
    if v.width > 1:
        target = ir.VectorType.get([v.width], target)
    if v.type == target:
        return v
    if isinstance(v.type, ir.IndexType) or isinstance(target, ir.IndexType):
        return V(arith.index_cast(target, v.value))
    src_bits = _element_type(v.type).width
    dst_bits = _element_type(target).width
    if v.is_float:
        return V((arith.extf if dst_bits > src_bits else arith.truncf)(target, v.value))
    return V((arith.extsi if dst_bits > src_bits else arith.trunci)(target, v.value))


def to_f32(v: V) -> V:
    return cast(v, "f32")


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
    element = v.type.element_type if isinstance(v.type, ir.VectorType) else v.type
    if not isinstance(element, ir.BF16Type):
        return cast(v, "f32")
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
    shape = [v.width] if v.width > 1 else None

    def typ(t: ir.Type) -> ir.Type:
        return ir.VectorType.get(shape, t) if shape else t

    bits = arith.bitcast(typ(ir.IntegerType.get_signless(16)), v.value)
    word = arith.extui(typ(ir.IntegerType.get_signless(32)), bits)
    word = arith.shli(word, const(16, typ(ir.IntegerType.get_signless(32))).value)
    return V(arith.bitcast(typ(ir.F32Type.get()), word))


def inline_asm(text: str, constraints: str, operands: list[V], result: ir.Type | None = None):
    """Inline PTX, kept where it is written (has side effects: never hoisted, merged or
    dropped). Returns the result value (an `ir.Value`) when `result` names its type."""
    op = llvm.InlineAsmOp(
        result, [v.value for v in operands], text, constraints, has_side_effects=True
    )
    return op.result if result is not None else None


def opaque(v: V) -> V:
    """`v` unchanged, through a register move the compiler cannot see into: a value held
    across a loop and passed through this at each use is not hoisted, so work derived from
    it (an fp32 widening of a packed bf16 row) stays inside the loop instead of taking twice
    the registers for the whole loop. The moves cost nothing after ptxas; 32-bit words."""
    t = v.type
    element = _element_type(t)
    width = element.width if _is_float(t) else ir.IntegerType(element).width
    bits = v.width * width
    if bits % 32:
        raise ValueError(f"opaque takes values of whole 32-bit words, not {t}")
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
        moved = inline_asm("mov.b32 $0, $1;", "=r,r", [word], i32)
        out = vector.insert(moved, out, [], [i])
    if isinstance(t, ir.VectorType):
        return V(vector.bitcast(t, out))
    return V(vector.extract(vector.bitcast(ir.VectorType.get([1], t), out), [], [0]))


def eq(a: V, b: V | int | float) -> V:
    """a == b as a flag (V keeps Python's == for identity: values sit in lists)."""
    return a._compare(b, "OEQ", "eq")


def ne(a: V, b: V | int | float) -> V:
    return a._compare(b, "UNE", "ne")


def i64(v: V | int) -> V:
    return const(v, "i64") if isinstance(v, int) else cast(v, "i64")


def i32(v: V | int) -> V:
    return const(v, "i32") if isinstance(v, int) else cast(v, "i32")


# ----------------------------------------------------------------------------- math


def rsqrt(v: V) -> V:
    return V(math.rsqrt(v.value))


def fma(a: V, b: V | float, c: V | float) -> V:
    """a * b + c rounded once (fma.rn): one instruction where a multiply and an add take two
    (the arith ops lower to mul.rn and add.rn, which ptxas never contracts). Scalars of b
    and c broadcast over a vector a."""
    a_, b_ = a._coerce(b)
    _, c_ = V(a_)._coerce(c)
    return V(math.fma(a_, b_, c_))


def dot(a: V, b: V, start: V | float = 0.0) -> V:
    """((start + a[0] * b[0]) + a[1] * b[1]) + ...: the lanes in order, one fma each (the
    products are not rounded on their own)."""
    total = start if isinstance(start, V) else const(start, _element_type(a.type))
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
    if not isinstance(b, V):
        if not isinstance(a, V):
            raise TypeError("select needs a or b to be a V (numbers take the other's type)")
        b = const(b, a.type)
    elif not isinstance(a, V):
        a = const(a, b.type)
    width = max(cond.width, a.width, b.width)
    a, b = (splat(v, width) if v.width < width else v for v in (a, b))
    return V(arith.select(cond.value, a.value, b.value))


def minimum(a: V, b: V | int | float) -> V:
    """The smaller of a and b, lane by lane: signed for integers; for floats NaN if either is
    NaN and -0 below +0 (arith.minimumf: `min.NaN.f32` on NVIDIA, `v_min_f32` with a NaN
    check on AMD)."""
    a_, b_ = a._coerce(b)
    return V(arith.minsi(a_, b_)) if not a.is_float else V(arith.minimumf(a_, b_))


def maximum(a: V, b: V | int | float) -> V:
    """The larger of a and b, lane by lane, as `minimum` orders them (`max.NaN.f32` on
    NVIDIA): a row maximum propagates a NaN, as torch's does; pad it with NEG_INF."""
    a_, b_ = a._coerce(b)
    return V(arith.maxsi(a_, b_)) if not a.is_float else V(arith.maximumf(a_, b_))


def hsum(v: V) -> V:
    """Sum of a vector's lanes (a scalar passes through)."""
    if v.width == 1:
        return v
    elem = _element_type(v.type)
    return V(vector.reduction(elem, vector.CombiningKind.ADD, v.value))


def split(v: V, width: int) -> list[V]:
    """A vector as consecutive pieces of `width` lanes (a scalar, or width >= lanes: [v])."""
    if v.width <= width:
        return [v]
    # vector.shuffle lowers to llvm.shufflevector (extract_strided_slice has no GPU lowering).
    return [
        V(vector.shuffle(v.value, v.value, list(range(o, o + width))))
        for o in range(0, v.width, width)
    ]


def join(parts: list[V]) -> V:
    """The inverse of `split`: consecutive pieces concatenated into one vector."""
    while len(parts) > 1:
        pairs = zip(parts[::2], parts[1::2], strict=True)
        parts = [V(vector.shuffle(a.value, b.value, list(range(2 * a.width)))) for a, b in pairs]
    return parts[0]
