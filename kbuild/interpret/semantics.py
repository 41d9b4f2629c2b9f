"""What the arith, math and vector ops compute, on every lane at once: their entries of
op_table.OPS (the LLVM dialect's twins of them too), the `MATH` table of elementwise math
functions (lowered.py's intrinsics and library calls use it as well) and `shuffle_maker`.

Arithmetic is exact IEEE (numpy float32 rounds each operation to nearest even, as .rn
instructions do); a fused multiply-add rounds once (the product is exact in float64); the
approximate instructions (rsqrt.approx, ex2.approx, tanh.approx) are computed in float64 and
rounded once, which lies inside the hardware's documented error bounds.
"""

from __future__ import annotations

import numpy as np

from . import types as T
from .op_table import (
    OPS,
    elementwise,
    int_attr,
    op,
    operand_slots,
    operand_type,
    result_slots,
    result_type,
)


def _quiet(fn):
    def wrapped(*a):
        with np.errstate(all="ignore"):
            return fn(*a)

    return wrapped


# -- arith -------------------------------------------------------------------------------


@op("arith.constant", "llvm.mlir.constant")
def _constant(program, o):
    (r,) = result_slots(program, o)
    t = result_type(o)
    value = _constant_value(o.attributes["value"], t)

    def run(m):
        shape = (m.lanes,) if t.lanes is None else (m.lanes, t.lanes)
        m.vals[r] = np.broadcast_to(value, shape).copy()

    return run


def _constant_value(attr, t: T.Type):
    from mlir import ir

    dtype = T.NUMPY[t.name] if t.kind == "float" else (bool if t.width == 1 else np.int64)
    if isinstance(attr, ir.DenseElementsAttr):
        dense = attr
        if dense.is_splat:
            v = _scalar_attr(dense.get_splat_value())
            return np.full(t.lanes, v, dtype)
        values = [_scalar_attr(dense[i]) for i in range(len(dense))]
        return np.array(values, dtype)
    return np.array(_scalar_attr(attr), dtype)


def _scalar_attr(attr):
    from mlir import ir

    if isinstance(attr, (bool, int, float)):  # a dense attribute's element, already a number
        return attr
    if isinstance(attr, ir.FloatAttr):
        return attr.value
    if isinstance(attr, ir.BoolAttr):
        return bool(attr.value)
    return ir.IntegerAttr(attr).value


def _divsi(a, b):
    b = np.where(b == 0, 1, b)
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q)


def _remsi(a, b):
    return a - _divsi(a, b) * np.where(b == 0, 1, b)


def _unsigned_op(fn):
    def maker(program, o):
        ins, (r,) = operand_slots(program, o), result_slots(program, o)
        t = result_type(o)
        w = operand_type(o).width

        def run(m):
            a, b = (T.unsigned(m.vals[i], w) for i in ins)
            got = fn(a, np.where(b == 0, 1, b) if fn is not None else b)
            m.vals[r] = T.as_type(np.asarray(got), t)

        return run

    return maker


OPS["arith.addi"] = elementwise(lambda a, b: a + b)
OPS["arith.subi"] = elementwise(lambda a, b: a - b)
OPS["arith.muli"] = elementwise(lambda a, b: a * b)
OPS["arith.divsi"] = elementwise(_divsi)
OPS["arith.remsi"] = elementwise(_remsi)
OPS["arith.divui"] = _unsigned_op(lambda a, b: a // b)
OPS["arith.remui"] = _unsigned_op(lambda a, b: a % b)
OPS["arith.andi"] = elementwise(lambda a, b: a & b)
OPS["arith.ori"] = elementwise(lambda a, b: a | b)
OPS["arith.xori"] = elementwise(lambda a, b: a ^ b)
OPS["arith.minsi"] = elementwise(np.minimum)
OPS["arith.maxsi"] = elementwise(np.maximum)
OPS["arith.minui"] = _unsigned_op(np.minimum)
OPS["arith.maxui"] = _unsigned_op(np.maximum)
OPS["arith.select"] = elementwise(lambda c, a, b: np.where(_lanes_like(c, a), a, b))
OPS["llvm.select"] = OPS["arith.select"]


def _lanes_like(c, a):
    return c if c.ndim == a.ndim else c.reshape(c.shape + (1,) * (a.ndim - c.ndim))


@op("arith.shli")
def _shli(program, o):
    (a, b), (r,) = operand_slots(program, o), result_slots(program, o)
    t = result_type(o)

    def run(m):
        n = m.vals[b]
        m.vals[r] = np.where(n < t.width, T.as_type(m.vals[a] << np.clip(n, 0, 63), t), 0)

    return run


@op("arith.shrui")
def _shrui(program, o):
    (a, b), (r,) = operand_slots(program, o), result_slots(program, o)
    t = result_type(o)

    def run(m):
        n = m.vals[b]
        u = T.unsigned(m.vals[a], t.width)
        shifted = u >> np.clip(n, 0, 63).astype(u.dtype)
        m.vals[r] = np.where(n < t.width, T.as_type(shifted.astype(np.int64), t), 0)

    return run


@op("arith.shrsi")
def _shrsi(program, o):
    (a, b), (r,) = operand_slots(program, o), result_slots(program, o)
    t = result_type(o)

    def run(m):
        m.vals[r] = T.as_type(m.vals[a] >> np.clip(m.vals[b], 0, 63), t)

    return run


_CMPI = {
    0: np.equal,
    1: np.not_equal,
    2: np.less,
    3: np.less_equal,
    4: np.greater,
    5: np.greater_equal,
}


@op("arith.cmpi", "llvm.icmp")
def _cmpi(program, o):
    (a, b), (r,) = operand_slots(program, o), result_slots(program, o)
    pred = int_attr(o, "predicate")
    w = operand_type(o).width
    if o.name == "llvm.icmp":  # eq ne slt sle sgt sge ult ule ugt uge
        pred = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6, 7: 7, 8: 8, 9: 9}[pred]
    if pred <= 5:
        fn = _CMPI[pred]

        def run(m):
            m.vals[r] = fn(m.vals[a], m.vals[b])
    else:
        fn = _CMPI[pred - 4]

        def run(m):
            m.vals[r] = fn(T.unsigned(m.vals[a], w), T.unsigned(m.vals[b], w))

    return run


_CMPF = {
    1: lambda a, b: a == b,
    2: lambda a, b: a > b,
    3: lambda a, b: a >= b,
    4: lambda a, b: a < b,
    5: lambda a, b: a <= b,
    6: lambda a, b: (a != b) & ~np.isnan(a) & ~np.isnan(b),
    7: lambda a, b: ~np.isnan(a) & ~np.isnan(b),
    8: lambda a, b: (a == b) | np.isnan(a) | np.isnan(b),
    9: lambda a, b: ~(a <= b),
    10: lambda a, b: ~(a < b),
    11: lambda a, b: ~(a >= b),
    12: lambda a, b: ~(a > b),
    13: lambda a, b: a != b,
    14: lambda a, b: np.isnan(a) | np.isnan(b),
}


@op("arith.cmpf", "llvm.fcmp")
def _cmpf(program, o):
    (a, b), (r,) = operand_slots(program, o), result_slots(program, o)
    pred = int_attr(o, "predicate")
    if pred in (0, 15):
        value = pred == 15

        def run(m):
            m.vals[r] = np.full(m.vals[a].shape, value)

        return run
    fn = _quiet(_CMPF[pred])

    def run(m):
        m.vals[r] = fn(m.vals[a], m.vals[b])

    return run


def _cast(fn):
    def maker(program, o):
        (a,), (r,) = operand_slots(program, o), result_slots(program, o)
        src, dst = operand_type(o), result_type(o)

        def run(m):
            m.vals[r] = T.as_type(fn(m.vals[a], src, dst), dst)

        return run

    return maker


OPS["arith.extsi"] = _cast(lambda x, s, d: x.astype(np.int64))
OPS["arith.extui"] = _cast(lambda x, s, d: T.unsigned(x, s.width).astype(np.int64))
OPS["arith.trunci"] = _cast(lambda x, s, d: x)
OPS["arith.index_cast"] = _cast(lambda x, s, d: x.astype(np.int64))
OPS["arith.index_castui"] = _cast(lambda x, s, d: T.unsigned(x, s.width).astype(np.int64))
OPS["arith.extf"] = _cast(lambda x, s, d: x.astype(T.NUMPY[d.name]))
OPS["arith.truncf"] = _cast(_quiet(lambda x, s, d: x))
OPS["arith.sitofp"] = _cast(lambda x, s, d: x.astype(np.float64))
OPS["arith.uitofp"] = _cast(lambda x, s, d: T.unsigned(x, s.width).astype(np.float64))
OPS["arith.fptosi"] = _cast(_quiet(lambda x, s, d: np.trunc(x).astype(np.int64)))
OPS["llvm.sext"] = OPS["arith.extsi"]
OPS["llvm.zext"] = OPS["arith.extui"]
OPS["llvm.trunc"] = OPS["arith.trunci"]
OPS["llvm.fpext"] = OPS["arith.extf"]
OPS["llvm.fptrunc"] = OPS["arith.truncf"]
OPS["llvm.sitofp"] = OPS["arith.sitofp"]
OPS["llvm.uitofp"] = OPS["arith.uitofp"]
OPS["llvm.fptosi"] = OPS["arith.fptosi"]


def bitcast(x: np.ndarray, src: T.Type, dst: T.Type) -> np.ndarray:
    """The same bits as another type of the same size (lanes kept)."""
    return T.from_bytes(T.to_bytes(x, src), dst)


OPS["arith.bitcast"] = _cast(bitcast)
OPS["vector.bitcast"] = OPS["arith.bitcast"]
OPS["llvm.bitcast"] = OPS["arith.bitcast"]

# floats: numpy's float32 operations round once to nearest even (add.rn / mul.rn / div.rn)
OPS["arith.addf"] = elementwise(_quiet(lambda a, b: a + b))
OPS["arith.subf"] = elementwise(_quiet(lambda a, b: a - b))
OPS["arith.mulf"] = elementwise(_quiet(lambda a, b: a * b))
OPS["arith.divf"] = elementwise(_quiet(lambda a, b: a / b))
OPS["arith.remf"] = elementwise(_quiet(np.fmod))
OPS["arith.negf"] = elementwise(lambda a: -a)
OPS["arith.maximumf"] = elementwise(np.maximum)  # NaN wins
OPS["arith.minimumf"] = elementwise(np.minimum)
OPS["arith.maxnumf"] = elementwise(np.fmax)  # NaN loses
OPS["arith.minnumf"] = elementwise(np.fmin)
for _n, _f in {
    "llvm.fadd": lambda a, b: a + b,
    "llvm.fsub": lambda a, b: a - b,
    "llvm.fmul": lambda a, b: a * b,
    "llvm.fdiv": lambda a, b: a / b,
    "llvm.fneg": lambda a: -a,
    "llvm.add": lambda a, b: a + b,
    "llvm.sub": lambda a, b: a - b,
    "llvm.mul": lambda a, b: a * b,
    "llvm.and": lambda a, b: a & b,
    "llvm.or": lambda a, b: a | b,
    "llvm.xor": lambda a, b: a ^ b,
    "llvm.sdiv": _divsi,
    "llvm.srem": _remsi,
}.items():
    OPS[_n] = elementwise(_quiet(_f))
OPS["llvm.shl"] = _shli
OPS["llvm.lshr"] = _shrui
OPS["llvm.ashr"] = _shrsi


def fma(a, b, c):
    """One rounding: the float32 product is exact in float64, the sum rounds once there and
    once more to float32, which differs from a single rounding only in rare double-rounding
    ties."""
    out_dtype = np.result_type(a)
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(out_dtype)


def _f64(fn):
    return _quiet(lambda *a: fn(*(x.astype(np.float64) for x in a)).astype(np.result_type(a[0])))


MATH = {
    "fma": _quiet(fma),
    "rsqrt": _f64(lambda x: 1.0 / np.sqrt(x)),
    "sqrt": _f64(np.sqrt),
    "exp": _f64(np.exp),
    "exp2": _f64(np.exp2),
    "log": _f64(np.log),
    "log2": _f64(np.log2),
    "log1p": _f64(np.log1p),
    "tanh": _f64(np.tanh),
    "erf": _f64(lambda x: np.vectorize(__import__("math").erf)(x) if x.size else x),
    "absf": np.abs,
    "fabs": np.abs,
    "copysign": np.copysign,
    "floor": np.floor,
    "ceil": np.ceil,
    "maxnum": np.fmax,
    "minnum": np.fmin,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "sin": _f64(np.sin),
    "cos": _f64(np.cos),
}
for _n, _f in MATH.items():
    OPS[f"math.{_n}"] = elementwise(_f)
    OPS[f"llvm.intr.{_n}"] = elementwise(_f)


@op("llvm.call_intrinsic")
def _intrinsic(program, o):
    from mlir import ir

    name = ir.StringAttr(o.attributes["intrin"]).value  # llvm.exp2.v8f32
    parts = name.split(".")
    fn = MATH.get(parts[1])
    if fn is None:
        raise NotImplementedError(f"the interpreter does not know the intrinsic {name}")
    return elementwise(fn)(program, o)


# -- vectors -----------------------------------------------------------------------------


@op("vector.broadcast", "vector.splat")
def _broadcast(program, o):
    (a,), (r,) = operand_slots(program, o), result_slots(program, o)
    t = result_type(o)

    def run(m):
        v = m.vals[a]
        m.vals[r] = v.copy() if v.ndim == 2 else np.repeat(v[:, None], t.lanes, axis=1)

    return run


def _positions(o):
    from mlir import ir

    return list(ir.DenseI64ArrayAttr(o.attributes["static_position"]))


@op("vector.extract")
def _extract(program, o):
    ins, (r,) = operand_slots(program, o), result_slots(program, o)
    pos = _positions(o)
    if len(pos) != 1 or pos[0] < 0 or len(ins) != 1:
        raise NotImplementedError("vector.extract with dynamic or nested positions")
    p = pos[0]

    def run(m):
        m.vals[r] = m.vals[ins[0]][:, p].copy()

    return run


@op("vector.insert")
def _insert(program, o):
    ins, (r,) = operand_slots(program, o), result_slots(program, o)
    (p,) = _positions(o)

    def run(m):
        v = m.vals[ins[1]].copy()
        v[:, p] = m.vals[ins[0]]
        m.vals[r] = v

    return run


@op("vector.from_elements")
def _from_elements(program, o):
    ins, (r,) = operand_slots(program, o), result_slots(program, o)

    def run(m):
        m.vals[r] = np.stack([m.vals[i] for i in ins], axis=1)

    return run


def shuffle_maker(array_attr):
    """vector.shuffle / llvm.shufflevector: lanes of the two vectors by the static mask
    (`array_attr`: the mask attribute's array type; -1, an undefined lane, reads lane 0)."""

    def maker(program, o):
        (a, b), (r,) = operand_slots(program, o), result_slots(program, o)
        mask = [max(i, 0) for i in array_attr(o.attributes["mask"])]

        def run(m):
            m.vals[r] = np.concatenate([m.vals[a], m.vals[b]], axis=1)[:, mask]

        return run

    return maker


def _shuffle_attr_i64(attr):
    from mlir import ir

    return list(ir.DenseI64ArrayAttr(attr))


OPS["vector.shuffle"] = shuffle_maker(_shuffle_attr_i64)


_REDUCE = {
    "add": np.add,
    "mul": np.multiply,
    "maxnumf": np.fmax,
    "minnumf": np.fmin,
    "maximumf": np.maximum,
    "minimumf": np.minimum,
    "maxsi": np.maximum,
    "minsi": np.minimum,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
}


@op("vector.reduction")
def _reduction(program, o):
    ins, (r,) = operand_slots(program, o), result_slots(program, o)
    text = str(o).split("vector.reduction")[1].lstrip(" <")
    kind = text.split(">")[0].split(",")[0].strip()
    fn = _REDUCE[kind]
    t = result_type(o)

    def run(m):  # in order, element 0 first, as the sequential LLVM reduction
        v = m.vals[ins[0]]
        acc = v[:, 0] if len(ins) == 1 else fn(m.vals[ins[1]], v[:, 0])
        with np.errstate(all="ignore"):
            for j in range(1 if len(ins) == 1 else 1, v.shape[1]):
                acc = T.as_type(fn(acc, v[:, j]), t)
        m.vals[r] = T.as_type(acc, t)

    return run
