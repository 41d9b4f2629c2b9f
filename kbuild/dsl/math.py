"""f32 transcendentals for kernels: exp, exp2, log, log2, tanh, sigmoid, erf, absolute.

Scalars and vectors (`V`) alike, elementwise. Everything lowers to plain instructions on every
target, with no call into a vendor library: convert-gpu-to-nvvm turns the math dialect's ops
(math.exp, log, tanh, absf, ...) into `__nv_*` calls that resolve only where
gpu-module-to-binary happens to find CUDA's libdevice, and convert-gpu-to-rocdl turns
math.exp2 / log2 into `__ocml_*` calls nothing links and math.tanh into an llvm.tanh the AMDGPU
backend cannot select (an LLVM fatal error: the process dies). So these are built from arith's
IEEE operations (add, mul, div: correctly rounded on both targets), fma, rint and one hardware
approximation, 2^x (`llvm.exp2`: `ex2.approx.f32` on NVIDIA, `v_exp_f32` on AMD). LLVM
intrinsics are emitted as `llvm.call_intrinsic`: convert-gpu-to-nvvm declares the llvm
dialect's own exp2/fabs/copysign ops illegal (to send them to libdevice).

Accuracy: the largest error in ulps of the f32 result (ulps of 2^-149 for subnormal
results) against fp64, measured over every third f32 bit pattern (1.43e9 inputs, every binade
of both signs) with the code run by MLIR's ExecutionEngine on the CPU, where glibc's exp2f
(0.502 ulp) computes 2^x. Functions without 2^x (log, log2, dsl.trig) give these bits on every
target. Those with it add the GPU's 2^x error: CUDA documents exp2f, which is
`ex2.approx.f32`, at 2 ulp; with 2^x off by 2 ulp on every input (a simulated worst case; not
yet measured on a GPU) the bounds become exp 3.5, tanh 1.6, sigmoid 6.4 (3.8e-7 relative),
erf 1.5 ulp. tests/test_dsl_math_prims_cpu.py holds the CPU bounds.

Polynomial coefficients are minimax fits (Lawson's iteration) with the coefficients rounded to
f32 one at a time, low order first, refitting the rest.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, llvm

from .values import V, _element_type, const, describe, eq, select

LOG2E = (1.4426950216293335, 1.925963033500011e-08)  # log2(e) as f32 hi + lo
LN2 = (0.6931471824645996, -1.9046542121259336e-09)  # ln(2) as f32 hi + lo
# 1.5 * 2^23: adding it rounds a float of magnitude < 2^22 to an integer held in the low
# mantissa bits (round to nearest even), so the integer's bits need no conversion.
_ROUNDER = 12582912.0


# ----------------------------------------------------------------------------- building blocks


def _f32(x: V, fn: str, what: str = "x") -> V:
    """`x` if it is an f32 scalar or vector V, else a TypeError naming `fn`."""
    if not isinstance(x, V) or not isinstance(_element_type(x.type), ir.F32Type):
        raise TypeError(f"{fn}: {what} must be an f32 scalar or vector V, got {describe(x)}")
    return x


def intrinsic(name: str, *args: V) -> V:
    """`llvm.<name>` on f32 operands of the first one's shape (name mangled: f32, v8f32)."""
    t = args[0].type
    suffix = f"v{t.shape[0]}f32" if isinstance(t, ir.VectorType) else "f32"
    return V(llvm.call_intrinsic(t, f"llvm.{name}.{suffix}", [a.value for a in args], [], []))


def fused(a: V, b: V | float, c: V | float) -> V:
    """a * b + c rounded once, as `llvm.fma` (dsl.fma's math.fma is a libdevice call on
    NVIDIA; this one is an fma on every target). Numbers broadcast over a."""
    a_, b_ = a._coerce(b, "fused (fma)")
    wide, c_ = V(a_)._coerce(c, "fused (fma)")
    if wide is not a_:  # c was the only vector: b broadcasts too
        _, b_ = V(wide)._coerce(V(b_), "fused (fma)")
    return V(llvm.intr_fma(wide, b_, c_))


def polynomial(x: V, coefficients: tuple[float, ...]) -> V:
    """c0 + c1 x + c2 x^2 + ... by Horner's rule, one fma a step."""
    result = const(coefficients[-1], x.type)
    for c in coefficients[-2::-1]:
        result = fused(result, x, c)
    return result


def _int_type(t: ir.Type) -> ir.Type:
    i32 = ir.IntegerType.get_signless(32)
    return ir.VectorType.get(t.shape, i32) if isinstance(t, ir.VectorType) else i32


def bits(x: V) -> V:
    """The i32 bit pattern of an f32 (lane by lane)."""
    return V(arith.bitcast(_int_type(x.type), x.value))


def from_bits(i: V) -> V:
    """The f32 whose bit pattern is the i32 `i`."""
    t = ir.F32Type.get()
    if isinstance(i.type, ir.VectorType):
        t = ir.VectorType.get(i.type.shape, t)
    return V(arith.bitcast(t, i.value))


def _shl(i: V, n: int) -> V:
    return V(arith.shli(i.value, const(n, i.type).value))


def absolute(x: V) -> V:
    """|x|: the sign bit cleared for floats (exact; NaN stays NaN); for integers the two's
    complement magnitude (the most negative value maps to itself)."""
    if not isinstance(x, V):
        raise TypeError(f"dsl.absolute: x must be a V, got {describe(x)}")
    if x.is_float:
        return intrinsic("fabs", x)
    return select(x < 0, -x, x)


def copysign(magnitude: V, sign: V) -> V:
    """|magnitude| with the sign bit of `sign` (exact); a scalar or number `sign` broadcasts."""
    _f32(magnitude, "dsl.copysign", "magnitude")
    if isinstance(sign, V):
        _f32(sign, "dsl.copysign", "sign")
    a, b = magnitude._coerce(sign, "dsl.copysign")
    return intrinsic("copysign", V(a), V(b))


# ----------------------------------------------------------------------------- exp


def exp2(x: V) -> V:
    """2^x, the hardware's: `ex2.approx.f32` on NVIDIA (not .ftz: subnormal results kept;
    CUDA documents exp2f, this instruction, at 2 ulp), `v_exp_f32` on AMD (LLVM scales inputs
    below -126 so subnormal results are kept). exp2(-inf) = 0, exp2(inf) = inf, NaN stays
    NaN."""
    return intrinsic("exp2", _f32(x, "dsl.exp2"))


def exp(x: V) -> V:
    """e^x: at most 1.04 ulp (CPU; see the module docstring for NVIDIA's 2^x). exp(-inf) = 0,
    exp(x > 88.72) = inf, NaN stays NaN; results below 2^-126 are subnormal, not flushed.

    x * log2(e) = j + f with j an integer and |f| <= 1/2: f comes from an fma against log2(e)
    split in two f32s (x * log2(e) rounded to f32 first costs up to 63 ulp near |x| = 88, and
    log2(e) as one f32 20 ulp), 2^f from the hardware, 2^j built from its bits. j is
    held to [-126, 127] so 2^j is a normal float; past that f grows instead, and 2^f
    overflows, underflows or rounds into the subnormals by itself."""
    x = _f32(x, "dsl.exp")
    t = x * LOG2E[0]
    # maxnum/minnum ignore NaN: j stays an integer (its bits are used) and f carries the NaN.
    t = intrinsic("minnum", intrinsic("maxnum", t, const(-126.0, x.type)), const(127.0, x.type))
    shifted = t + _ROUNDER
    j = shifted - _ROUNDER
    f = fused(x, LOG2E[0], -j)
    f = fused(x, LOG2E[1], f)
    scale = from_bits(_shl(bits(shifted) + 127, 23))  # the rounder's bits shift out
    return exp2(f) * scale


# ----------------------------------------------------------------------------- log

_SMALLEST_NORMAL = 2.0**-126
# log(1 + f) = f + f^2 * P(f) on f in [-1/3, 1/3]: 0.74 ulp alone.
_LOG1P = (
    -0.5,
    0.3333321511745453,
    -0.2499980479478836,
    0.20010429620742798,
    -0.16680249571800232,
    0.14005665481090546,
    -0.12186851352453232,
    0.13984978199005127,
    -0.1288244128227234,
)


def _log_parts(x: V) -> tuple[V, V]:
    """x = 2^k * (1 + f) with 1 + f in [2/3, 4/3): (k as f32, log(1 + f))."""
    tiny = x < _SMALLEST_NORMAL  # subnormal: scale into the normal range first
    x = select(tiny, x * 2.0**23, x)
    k_offset = select(tiny, const(-23.0, x.type), 0.0)
    # Subtracting the bits of 2/3 makes the exponent field k for mantissas in [2/3, 4/3).
    k_bits = (bits(x) - 0x3F2AAAAB) & -0x800000
    mantissa = from_bits(bits(x) - k_bits)
    k = fused(V(arith.sitofp(x.type, k_bits.value)), 2.0**-23, k_offset)
    f = mantissa - 1.0
    return k, fused(f * f, polynomial(f, _LOG1P), f)


def _log_special(x: V, result: V) -> V:
    """log's values where x is not a positive finite float: log(0) = -inf, log(inf) = inf,
    log(x < 0) = NaN, NaN stays NaN."""
    special = select(x < 0.0, const(float("nan"), x.type), x + x)
    special = select(eq(x, 0.0), const(float("-inf"), x.type), special)
    return select((x > 0.0) & (x < float("inf")), result, special)


def log(x: V) -> V:
    """Natural logarithm: at most 0.94 ulp, subnormal inputs included; no hardware
    approximation, so the same bits on the CPU, NVIDIA and AMD. log(+-0) = -inf,
    log(inf) = inf, log(x < 0) = NaN, NaN stays NaN.

    log(2^k * m) = k * ln2 + log1p(m - 1), m in [2/3, 4/3), log1p by a degree-10 polynomial;
    k * ln2 with ln2 split in two f32s."""
    k, log1p = _log_parts(_f32(x, "dsl.log"))
    return _log_special(x, fused(k, LN2[0], fused(k, LN2[1], log1p)))


def log2(x: V) -> V:
    """Base-2 logarithm: at most 1.71 ulp, the same bits on every target; exact for powers
    of two. log2(+-0) = -inf, log2(inf) = inf, log2(x < 0) = NaN, NaN stays NaN.

    k + log1p(m - 1) * log2(e), the product against log2(e) split in two f32s. The worst
    case is k = 1 with m near 2/3 (x just above 4/3): 1 - 0.58 cancels, and log1p's 0.74 ulp
    of 0.4 is 1.4 ulp of the 0.42 left."""
    k, log1p = _log_parts(_f32(x, "dsl.log2"))
    return _log_special(x, fused(log1p, LOG2E[0], fused(log1p, LOG2E[1], k)))


# ----------------------------------------------------------------------------- tanh, sigmoid

# tanh(x) = x + x^3 * P(x^2) on |x| < 7/8: 0.85 ulp alone.
_TANH_SMALL = 0.875
_TANH = (
    -0.33333325386047363,
    0.13333064317703247,
    -0.05393711104989052,
    0.021695835515856743,
    -0.008331559598445892,
    0.002650658832862973,
    -0.00048229037201963365,
)


def tanh(x: V) -> V:
    """Hyperbolic tangent: at most 1.02 ulp (CPU; see the module docstring for NVIDIA's 2^x).
    tanh(+-inf) = +-1 (no NaN from exp's overflow), tanh(-0) = -0, NaN stays NaN.

    |x| < 7/8: an odd polynomial (1 - 2/(e^2x + 1) cancels there). Beyond,
    1 - 2 / (e^(2|x|) + 1) with its sign restored: the error of e^(2|x|) reaches the result
    scaled by (1 - tanh)/tanh < 0.43, and e^(2|x|) = inf gives 1."""
    x = _f32(x, "dsl.tanh")
    s = x * x
    small = fused(x * s, polynomial(s, _TANH), x)
    a = absolute(x)
    big = fused(1.0 / (exp(a + a) + 1.0), -2.0, 1.0)
    # copysign also gives tanh(-0) = -0: x + x^3 * P is +0 there (P < 0).
    return copysign(select(a < _TANH_SMALL, small, big), x)


def sigmoid(x: V) -> V:
    """1 / (1 + e^-x): at most 2.41 ulp (CPU; see the module docstring for NVIDIA's 2^x),
    subnormal results included (sigmoid(-100) = 3.7e-44, not 0). sigmoid(-inf) = 0,
    sigmoid(inf) = 1, NaN stays NaN. The worst cases are just below a power of two, where an
    ulp halves: e / (1 + e) keeps e^-|x|'s relative error, which there counts double.

    With e = e^-|x| (at most 1, so never inf): 1 / (1 + e) for x >= 0, e / (1 + e) below
    (the form 1 / (1 + e^-x) there loses the subnormals; e^-x / (1 + e^-x) is inf / inf)."""
    x = _f32(x, "dsl.sigmoid")
    e = exp(-absolute(x))
    return select(x >= 0.0, const(1.0, x.type), e) / (e + 1.0)


# ----------------------------------------------------------------------------- erf

# erf(x) = x + x * P(x^2) on |x| < 7/8: 0.80 ulp alone.
_ERF_SMALL = 0.875
_ERF = (
    0.12837916612625122,
    -0.3761262893676758,
    0.11283621937036514,
    -0.026855282485485077,
    0.0051906355656683445,
    -0.0008021723479032516,
    7.842241757316515e-05,
)
# log(erfc(t)) = Q(t) on t in [7/8, 4] (erf(t) rounds to 1 from t = 3.83 on): fitted to the
# absolute error of erf, 1.06 ulp with a correctly rounded exp.
_ERF_TAIL = (
    0.00016202463302761316,
    -1.129453182220459,
    -0.6334733963012695,
    -0.10813912749290466,
    0.025027191266417503,
    -0.004135645925998688,
    0.00042707647662609816,
    -2.0449911971809343e-05,
)


def erf(x: V) -> V:
    """The error function: at most 1.08 ulp (CPU; see the module docstring for NVIDIA's
    2^x): an absolute error below 6.5e-8 (GELU's erf(x / sqrt 2) included).
    erf(+-inf) = +-1, erf(-0) = -0, NaN stays NaN.

    |x| < 7/8: x + x * P(x^2). Beyond: 1 - e^Q(|x|) with Q a polynomial fit of log(erfc)
    on [7/8, 4]; past 4 it keeps falling (below Q(4) = -18, to -inf: checked to 2000, and
    its leading term is negative), so 1 - e^Q rounds to 1 there as erf does."""
    x = _f32(x, "dsl.erf")
    small = fused(x, polynomial(x * x, _ERF), x)
    a = absolute(x)
    big = 1.0 - exp(polynomial(a, _ERF_TAIL))
    return select(a < _ERF_SMALL, small, copysign(big, x))
