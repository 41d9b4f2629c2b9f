"""f32 sine and cosine for kernels (RoPE's angles): sin, cos, sincos; scalars and vectors.

No hardware approximation: NVIDIA's `sin.approx.f32` is specified by an absolute error
(2^-20.9 within [-pi, pi], PTX ISA), so it has no relative accuracy near the zeros of sin and
none at all beyond, and NVPTX does not select llvm.sin without fast-math flags (an LLVM fatal
error). No vendor library either (see dsl/math.py). Instead: a reduction to r = x - j * pi/2,
|r| <= pi/4, and polynomials for sin(r) and cos(r), all IEEE arithmetic, so the bits are the
same on every target. Accuracy against fp64, measured as for dsl/math.py (every third f32 bit
pattern): at most 1.57 ulp for sin and cos, on every target.

Two reductions, as CUDA's sinf has: below 2^19, x - j * pi/2 by three fmas against pi/2 split
in three f32s (Cody and Waite; measured at 1.57 ulp up to 2^19, but 1.8 up to 2^20, 2.0 up
to 2^21 and 5.4 beyond: the middle step's rounding grows with j and shows where r is small).
From 2^19 on (RoPE angles past half a million positions), Payne and Hanek's: x times 2/pi in
64-bit fixed point from the bits of 1/(2 pi), exact for every f32. That path is a branch
taken only when some lane needs it, so smaller angles never pay its ~50 integer operations.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, scf, vector

from .math import _ROUNDER, _f32, absolute, bits, from_bits, fused, polynomial
from .values import V, const, eq, select, splat

_TWO_OVER_PI = 0.6366197466850281
_PIO2 = (1.5707963705062866, -4.371138828673793e-08, -1.7151245100058819e-15)  # hi, mid, lo
_FAST_BELOW = 2.0**19
# sin(r) = r + r^3 * S(r^2): 0.67 ulp alone; cos(r) = 1 - r^2/2 + r^4 * C(r^2): 0.88 ulp alone.
_SIN = (-0.16666655242443085, 0.008332189172506332, -0.00019518291810527444)
_COS = (0.04166664555668831, -0.0013887309469282627, 2.4432327336398885e-05)
# 1/(2 pi) in 32-bit words after the binary point, a zero word first (Payne-Hanek's table).
_INV_2PI_WORDS = (
    0x00000000,
    0x28BE60DB,
    0x9391054A,
    0x7F09D5F4,
    0x7D4D3770,
    0x36D8A566,
    0x4F10E410,
    0x7F9458EA,
)


def sincos(x: V) -> tuple[V, V]:
    """(sin x, cos x) from one argument reduction (RoPE wants both of one angle): at most
    1.57 ulp each, for every finite x; sin(-0) = -0; inf and NaN give NaN."""
    return _sincos(_f32(x, "dsl.sincos"))


def _sincos(x: V) -> tuple[V, V]:
    # |x| is reduced and sin's sign restored from x's bit: the fmas of the reduction turn
    # -0 into +0 (-0 + +0 is +0), and sin(-0) is -0.
    r, quadrant = _reduce(absolute(x))
    s = r * r
    sin_r = fused(r * s, polynomial(s, _SIN), r)
    cos_r = fused(s, fused(s, polynomial(s, _COS), -0.5), 1.0)
    # |x| = j * pi/2 + r: sin is +-sin r or +-cos r by j mod 4, and cos x is sin(|x| + pi/2).
    odd = eq(quadrant & 1, 1)
    sin_sign = V(arith.xori(_sign(quadrant).value, (bits(x) & -(2**31)).value))
    sin_x = _flip(select(odd, cos_r, sin_r), sin_sign)
    cos_x = _flip(select(odd, sin_r, cos_r), _sign(quadrant + 1))
    return sin_x, cos_x


def sin(x: V) -> V:
    """sin x: at most 1.57 ulp for every finite x (see sincos)."""
    return _sincos(_f32(x, "dsl.sin"))[0]


def cos(x: V) -> V:
    """cos x: at most 1.57 ulp for every finite x (see sincos)."""
    return _sincos(_f32(x, "dsl.cos"))[1]


def _sign(quadrant: V) -> V:
    """The sign bit where bit 1 of the quadrant is set (j mod 4 = 2 or 3: negate)."""
    return V(arith.shli((quadrant & 2).value, const(30, quadrant.type).value))


def _flip(v: V, sign: V) -> V:
    return from_bits(V(arith.xori(bits(v).value, sign.value)))


def _reduce(x: V) -> tuple[V, V]:
    """(r, j) with x = j * pi/2 + r, |r| <= pi/4, for x >= 0 (j as i32; only j mod 4 is
    used)."""
    shifted = fused(x, _TWO_OVER_PI, _ROUNDER)  # j in the low mantissa bits (|j| < 2^22)
    j = shifted - _ROUNDER
    r = fused(j, -_PIO2[0], x)  # exact: x and j * pi/2 agree in their leading bits
    r = fused(j, -_PIO2[1], r)
    r = fused(j, -_PIO2[2], r)
    large = (x >= _FAST_BELOW) & (x < float("inf"))
    fast = (r, bits(shifted))
    branch = scf.IfOp(_any(large).value, [r.type, fast[1].type], has_else=True)
    with ir.InsertionPoint(branch.then_block):
        slow = _reduce_exactly(x)
        scf.YieldOp([select(large, s, f).value for s, f in zip(slow, fast, strict=True)])
    with ir.InsertionPoint(branch.else_block):
        scf.YieldOp([v.value for v in fast])
    return V(branch.results[0]), V(branch.results[1])


def _any(flags: V) -> V:
    if not isinstance(flags.type, ir.VectorType):
        return flags
    return V(vector.reduction(ir.IntegerType.get_signless(1), vector.CombiningKind.OR, flags.value))


def _ints(like: V, width: int) -> ir.Type:
    t = ir.IntegerType.get_signless(width)
    return ir.VectorType.get(like.type.shape, t) if isinstance(like.type, ir.VectorType) else t


def _reduce_exactly(x: V) -> tuple[V, V]:
    """Payne-Hanek for x >= 2^19 (other lanes get values to be discarded): x = m * 2^(e-32)
    with m the 32-bit mantissa, and frac(x / (2 pi)) * 2^64 = m * W mod 2^64 where W is the
    96-bit window of 1/(2 pi) * 2^(e+32) around its binary point (two 32-bit words above it,
    one below: higher bits only add multiples of 2^64). Its top two bits are the quadrant,
    the 62 below the remainder (pi/2 = 2^62), rounded to the nearer quadrant."""
    i32, i64 = _ints(x, 32), _ints(x, 64)

    def c(value: int, t: ir.Type) -> V:  # an unsigned constant as the signless attribute
        width = ir.IntegerType(t.element_type if isinstance(t, ir.VectorType) else t).width
        return const(value - (1 << width if value >> (width - 1) else 0), t)

    def wide(v: V) -> V:
        return V(arith.extui(i64, v.value))

    b = bits(x)
    m = V(arith.ori(arith.shli((b & 0x7FFFFF).value, c(8, i32).value), c(1 << 31, i32).value))
    e = ((b >> 23) & 0xFF) - 126  # x in [2^(e-1), 2^e)
    word_index = V(arith.shrsi(e.value, c(5, i32).value))
    shift = wide(e & 31)
    # _INV_2PI_WORDS[word_index + k]: a select per possible index (e <= 128, so at most 4).
    words = []
    for k in range(4):
        word = c(_INV_2PI_WORDS[k], i32)
        for index in range(1, 5):
            word = select(eq(word_index, index), c(_INV_2PI_WORDS[index + k], i32), word)
        words.append(wide(word))

    def window(k: int) -> V:  # 32 bits of the shifted table from word k on
        pair = V(arith.ori(arith.shli(words[k].value, c(32, i64).value), words[k + 1].value))
        return V(arith.shli(pair.value, shift.value)) >> 32

    m64 = wide(m)
    high = V(arith.shli((m64 * window(0)).value, c(32, i64).value))  # its low 32 bits count
    p = high + m64 * window(1) + ((m64 * window(2)) >> 32)
    quadrant = V(arith.trunci(i32, ((p + c(1 << 61, i64)) >> 62).value))
    remainder = V(arith.shli(p.value, c(2, i64).value))  # the signed fraction, times 4
    # In fp64, the 62-bit remainder becomes an f32 in one rounding.
    f64 = ir.F64Type.get()
    pi_scale = V(arith.ConstantOp(f64, ir.FloatAttr.get(f64, 3.141592653589793 / 2.0**65)).result)
    if isinstance(x.type, ir.VectorType):
        f64, pi_scale = ir.VectorType.get(x.type.shape, f64), splat(pi_scale, x.width)
    scaled = arith.mulf(arith.sitofp(f64, remainder.value), pi_scale.value)
    return V(arith.truncf(x.type, scaled)), quadrant
