"""The DSL's f32 math (dsl/math.py, dsl/trig.py; maximum, minimum, select) run on the CPU, and
lowered for both GPU targets.

Values: each function is compiled by MLIR's ExecutionEngine and run over ~1.3M inputs (every
4099th f32 bit pattern: every binade of both signs, subnormals included; a dense grid where the
function varies; its edge values) and held to the bound its docstring states, in ulps of the
fp64 result rounded to f32 (ulps of 2^-149 for subnormal results), and to exact results at
zeros (sign included), infinities and NaN. The host's exp2f stands in for the GPU's 2^x, so
this checks the formulation; `test_a_wrong_formulation_fails` shows the plausible mistakes
failing these same checks. Vectors and scalars give the same bits.

Lowering: each function in a kernel, scalar and vector, through the NVIDIA pipeline to PTX
(ptxas assembles it for sm_90) and the AMD pipeline to a gfx942 code object: no function is
left external (a libdevice `__nv_*` call links only where gpu-module-to-binary finds CUDA's
libdevice, an ocml `__ocml_*` call nowhere), and the instructions are the expected ones.
"""

from __future__ import annotations

import ctypes
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

pytest.importorskip("mlir")

from mlir import execution_engine, ir, passmanager  # noqa: E402
from mlir.dialects import arith, func, memref, scf, vector  # noqa: E402
from mlir.runtime import get_ranked_memref_descriptor  # noqa: E402

from kbuild import dsl  # noqa: E402
from kbuild.dsl import V, get_llvm_ptr, load, store  # noqa: E402
from kbuild.dsl import math as dsl_math  # noqa: E402
from kbuild.dsl import trig as dsl_trig  # noqa: E402
from kbuild.targets import amd, target_for_arch  # noqa: E402
from kbuild.targets.nvidia import module_to_ptx, ptx_to_cubin, ptxas_path  # noqa: E402

_LOWER = (
    "builtin.module(convert-scf-to-cf,convert-vector-to-llvm,finalize-memref-to-llvm,"
    "convert-func-to-llvm,convert-arith-to-llvm,convert-cf-to-llvm,reconcile-unrealized-casts)"
)
INF, NAN = math.inf, math.nan


def _compile(body: Callable[..., V], n_in: int = 1, width: int = 8):
    """A host function mapping `body` over n_in f32 arrays, `width` lanes at a time (1:
    scalars); returns a numpy-level callable."""
    ctx = ir.Context()
    with ctx, ir.Location.unknown(ctx):
        module = ir.Module.create()
        f32 = ir.F32Type.get()
        array = ir.MemRefType.get([ir.ShapedType.get_dynamic_size()], f32)
        with ir.InsertionPoint(module.body):
            fn = func.FuncOp("f", ([array] * (n_in + 1), []))
            fn.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()
            with ir.InsertionPoint(fn.add_entry_block()):
                *sources, out = fn.arguments
                index = ir.IndexType.get()
                zero = arith.ConstantOp(index, 0).result
                step = arith.ConstantOp(index, width).result
                loop = scf.ForOp(zero, memref.dim(out, zero), step)
                with ir.InsertionPoint(loop.body):
                    i = loop.induction_variable
                    if width == 1:
                        args = [V(memref.load(s, [i])) for s in sources]
                        memref.store(body(*args).value, out, [i])
                    else:
                        lanes = ir.VectorType.get([width], f32)
                        args = [V(vector.load(lanes, s, [i])) for s in sources]
                        vector.store(body(*args).value, out, [i])
                    scf.YieldOp([])
                func.ReturnOp([])
        passmanager.PassManager.parse(_LOWER).run(module.operation)
        engine = execution_engine.ExecutionEngine(module, opt_level=2)

    def call(*arrays: np.ndarray) -> np.ndarray:
        n = len(arrays[0])
        pad = np.zeros(-n % width, np.float32)
        args = [np.concatenate([np.asarray(a, np.float32), pad]) for a in arrays]
        args.append(np.zeros(n + len(pad), np.float32))
        pointers = [ctypes.pointer(ctypes.pointer(get_ranked_memref_descriptor(a))) for a in args]
        engine.invoke("f", *pointers)
        return args[-1][:n]

    call.keep = (ctx, engine)  # the engine's code lives as long as the callable
    return call


_compiled = functools.cache(_compile)


def _ulp_error(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|got - ref| in ulps of ref rounded to f32 (2^-149 for subnormal results): 0 where got
    is ref's f32 infinity or both are NaN; inf where only one is NaN."""
    with np.errstate(over="ignore", invalid="ignore"):
        ref32 = ref.astype(np.float32)
        magnitude = np.minimum(np.abs(ref32.astype(np.float64)), np.finfo(np.float32).max)
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(magnitude, 2.0**-126))) - 23)
        err = np.abs(got.astype(np.float64) - ref) / ulp
    err[(np.isnan(got) & np.isnan(ref)) | (np.isinf(ref32) & (got == ref32))] = 0.0
    err[np.isnan(got) != np.isnan(ref)] = INF
    return err


def _f32(values) -> np.ndarray:
    return np.asarray(values, np.float64).astype(np.float32)


_PATTERNS = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
_EDGES = _f32([0.0, -0.0, INF, -INF, NAN, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
_EDGES = np.concatenate([_EDGES, _f32([3.4028235e38, 2.0**-126, 2.0**-149, 1e-30, 1e-7])])
_EDGES = np.concatenate([_EDGES, -_EDGES[-5:]])
# f32s next to multiples of pi/2 (r tiny: the reduction's hard cases), on to 2^26 * pi/2
# (Payne-Hanek's range from 2^19 on)
_QUARTERS = _f32(
    np.concatenate([np.arange(1, 2**20, 7), np.arange(2**20, 2**26, 4099)]) * math.pi / 2
)


@dataclass(frozen=True)
class Spec:
    function: Callable[[V], V]
    reference: Callable[[np.ndarray], np.ndarray]  # fp64
    ulps: float  # the docstring's bound on the CPU
    domain: tuple[float, float]  # a dense linear grid here
    exact: tuple[tuple[float, float], ...]  # (input, result), bit for bit; NaN: any NaN
    edges: tuple[float, ...] | np.ndarray = field(default=())

    def inputs(self) -> np.ndarray:
        dense = np.linspace(*self.domain, 2**18)
        return np.concatenate([_PATTERNS, _EDGES, _f32(dense), _f32(self.edges)])


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


SPECS = {
    "exp": Spec(
        dsl.exp,
        np.exp,
        1.04,
        (-105.0, 89.0),
        ((0.0, 1.0), (-INF, 0.0), (INF, INF), (NAN, NAN), (88.73, INF), (1e30, INF), (-104.0, 0.0)),
        (88.72283, 88.72284, -87.33654, -87.33655, -103.27893, -103.97208, -1e30),
    ),
    "exp2": Spec(
        dsl.exp2,
        np.exp2,
        1.0,  # the host's exp2f (glibc's: 0.502)
        (-151.0, 129.0),
        (
            (0.0, 1.0),
            (-INF, 0.0),
            (INF, INF),
            (NAN, NAN),
            (128.0, INF),
            (-149.0, 2.0**-149),
            (-151.0, 0.0),
        ),
    ),
    "log": Spec(
        dsl.log,
        np.log,
        0.94,
        (0.0, 4.0),
        ((1.0, 0.0), (0.0, -INF), (-0.0, -INF), (INF, INF), (-1.0, NAN), (-INF, NAN), (NAN, NAN)),
        (2.0**-149, 2.0**-140, 0.99999994, 1.0000001, 2 / 3, 4 / 3),
    ),
    "log2": Spec(
        dsl.log2,
        np.log2,
        1.71,
        (0.0, 4.0),
        (
            (1.0, 0.0),
            (0.0, -INF),
            (INF, INF),
            (-1.0, NAN),
            (NAN, NAN),
            (2.0**-149, -149.0),
            (2.0**100, 100.0),
        ),
        (2.0**-149, 3 * 2.0**-149, 0.99999994, 1.0000001, 2 / 3, 4 / 3),
    ),
    "tanh": Spec(
        dsl.tanh,
        np.tanh,
        1.02,
        (-10.0, 10.0),
        (
            (0.0, 0.0),
            (-0.0, -0.0),
            (INF, 1.0),
            (-INF, -1.0),
            (100.0, 1.0),
            (-100.0, -1.0),
            (NAN, NAN),
        ),
        (0.875, -0.875, 0.87499994, 44.0, 45.0, 1e-20),
    ),
    "sigmoid": Spec(
        dsl.sigmoid,
        _sigmoid,
        2.41,
        (-20.0, 20.0),
        ((0.0, 0.5), (-0.0, 0.5), (INF, 1.0), (-INF, 0.0), (200.0, 1.0), (-200.0, 0.0), (NAN, NAN)),
        (-100.0, -88.0, -87.0, -103.0, -103.9, 17.0, 89.0, -89.0),
    ),
    "erf": Spec(
        dsl.erf,
        np.vectorize(math.erf, otypes=[np.float64]),
        1.08,
        (-5.0, 5.0),
        (
            (0.0, 0.0),
            (-0.0, -0.0),
            (INF, 1.0),
            (-INF, -1.0),
            (10.0, 1.0),
            (-1e30, -1.0),
            (NAN, NAN),
        ),
        (0.875, -0.875, 0.87499994, 3.83, 3.9, 4.0, 4.1, 1e-30),
    ),
    "sin": Spec(
        dsl.sin,
        np.sin,
        1.57,
        (-1e4, 1e4),
        ((0.0, 0.0), (-0.0, -0.0), (INF, NAN), (-INF, NAN), (NAN, NAN)),
        np.concatenate([_QUARTERS, -_QUARTERS, _f32(np.linspace(5.2e5, 5.3e5, 2**16))]),
    ),
    "cos": Spec(
        dsl.cos,
        np.cos,
        1.57,
        (-1e4, 1e4),
        ((0.0, 1.0), (-0.0, 1.0), (INF, NAN), (-INF, NAN), (NAN, NAN)),
        np.concatenate([_QUARTERS, -_QUARTERS, _f32(np.linspace(5.2e5, 5.3e5, 2**16))]),
    ),
}


def _check(name: str, function: Callable[[V], V], compile_=_compiled) -> None:
    """Raise AssertionError unless `function` meets SPECS[name] (its ulps and exact values)."""
    spec = SPECS[name]
    run = compile_(function)
    x = spec.inputs()
    got = run(x)
    with np.errstate(all="ignore"):
        ref = spec.reference(x.astype(np.float64))
    err = _ulp_error(got, ref)
    k = int(np.argmax(err))
    assert err[k] <= spec.ulps, (
        f"{name}({x[k]!r}) = {got[k]!r}; fp64 says {ref[k]!r}: {err[k]:.3g} ulp > {spec.ulps}"
    )
    inputs, wanted = _f32([x for x, _ in spec.exact]), _f32([y for _, y in spec.exact])
    got = run(inputs)
    same = (got.view(np.uint32) == wanted.view(np.uint32)) | (np.isnan(got) & np.isnan(wanted))
    assert same.all(), f"{name}{inputs[~same]} = {got[~same]}, not {wanted[~same]}"


@pytest.mark.parametrize("name", list(SPECS))
def test_values_within_the_documented_error(name):
    _check(name, SPECS[name].function)


@pytest.mark.parametrize("name", list(SPECS))
def test_vector_and_scalar_give_the_same_bits(name):
    x = SPECS[name].inputs()[::7]
    vector_bits = _compiled(SPECS[name].function)(x).view(np.uint32)
    scalar_bits = _compiled(SPECS[name].function, 1, 1)(x).view(np.uint32)
    np.testing.assert_array_equal(vector_bits, scalar_bits)


def _exp_product_rounded(x: V) -> V:
    return dsl.exp2(x * 1.4426950408889634)


def _sigmoid_ratio(x: V) -> V:
    e = dsl.exp(-x)
    return e / (e + 1.0)


def _tanh_ratio(x: V) -> V:
    e = dsl.exp(x + x)
    return (e - 1.0) / (e + 1.0)


# mistake: (the function whose checks it must fail, the wrong form, module constants it sets)
WRONG = {
    "exp as exp2(x * log2e), the product rounded": ("exp", _exp_product_rounded, {}),
    "exp as exp2(x)": ("exp", dsl.exp2, {}),
    # (a low part of 1e-30, not 0: inf * 0 would fail it for another reason)
    "exp without log2(e)'s low part": ("exp", dsl.exp, {"LOG2E": (dsl_math.LOG2E[0], 1e-30)}),
    "sigmoid as e^-x / (1 + e^-x): inf / inf": ("sigmoid", _sigmoid_ratio, {}),
    "sigmoid as 1 / (1 + e^-x): no subnormals": (
        "sigmoid",
        lambda x: 1.0 / (dsl.exp(-x) + 1.0),
        {},
    ),
    "tanh as (e^2x - 1) / (e^2x + 1)": ("tanh", _tanh_ratio, {}),
    "tanh without its polynomial near 0": ("tanh", dsl.tanh, {"_TANH_SMALL": 0.0}),
    "erf without its polynomial near 0": ("erf", dsl.erf, {"_ERF_SMALL": 0.0}),
    "erf's near-0 polynomial stretched to 2": ("erf", dsl.erf, {"_ERF_SMALL": 2.0}),
    "log without scaling subnormals": ("log", dsl.log, {"_SMALLEST_NORMAL": 0.0}),
    "log2 without scaling subnormals": ("log2", dsl.log2, {"_SMALLEST_NORMAL": 0.0}),
    "sin without Payne-Hanek": ("sin", dsl.sin, {"_FAST_BELOW": INF}),
    "cos with pi/2 in two parts": ("cos", dsl.cos, {"_PIO2": (*dsl_trig._PIO2[:2], 0.0)}),
}


@pytest.mark.parametrize("mistake", list(WRONG))
def test_a_wrong_formulation_fails(mistake, monkeypatch):
    name, function, constants = WRONG[mistake]
    for constant, value in constants.items():
        module = dsl_trig if hasattr(dsl_trig, constant) else dsl_math
        monkeypatch.setattr(module, constant, value)
    with pytest.raises(AssertionError):
        _check(name, function, compile_=_compile)  # built with the constants as set


# ----------------------------------------------------------------------------- max, min, select

_PAIRS = _f32([[NAN, 1.0], [1.0, NAN], [-0.0, 0.0], [0.0, -0.0], [-INF, 5.0], [3.0, -INF]])


@pytest.mark.parametrize("width", [8, 1])
def test_maximum_and_minimum_propagate_nan_and_order_signed_zeros(width):
    a, b = _PAIRS[:, 0], _PAIRS[:, 1]
    got_max = _compiled(dsl.maximum, 2, width)(a, b)
    got_min = _compiled(dsl.minimum, 2, width)(a, b)
    np.testing.assert_array_equal(
        got_max.view(np.uint32), _f32([NAN, NAN, 0.0, 0.0, 5.0, 3.0]).view(np.uint32)
    )
    np.testing.assert_array_equal(
        got_min.view(np.uint32), _f32([NAN, NAN, -0.0, -0.0, -INF, -INF]).view(np.uint32)
    )


def test_maximum_of_numbers_and_negative_infinity_padding():
    x = SPECS["exp"].inputs()[::5]
    np.testing.assert_array_equal(_compiled(lambda v: dsl.maximum(v, dsl.NEG_INF))(x), x)
    np.testing.assert_array_equal(_compiled(lambda v: dsl.minimum(v, dsl.POS_INF))(x), x)
    np.testing.assert_array_equal(_compiled(lambda v: dsl.maximum(v, 0.5))(x), np.maximum(x, 0.5))


def _like(v: V, element: ir.Type) -> ir.Type:
    return ir.VectorType.get([v.width], element) if v.width > 1 else element


def _as_i32(v: V) -> V:
    return V(arith.fptosi(_like(v, ir.IntegerType.get_signless(32)), v.value))


def _as_f32(v: V) -> V:
    return V(arith.sitofp(_like(v, ir.F32Type.get()), v.value))


@pytest.mark.parametrize("width", [8, 1])
def test_integer_maximum_minimum_absolute_are_signed(width):
    # -3 against 2: unsigned comparisons would take -3 (0xfffffffd) as the larger.
    a, b = _f32([-3, 2, -7, 0]), _f32([2, -3, -8, 0])
    for name, want in (("maximum", np.maximum(a, b)), ("minimum", np.minimum(a, b))):
        op = getattr(dsl, name)
        got = _compiled(lambda x, y, op=op: _as_f32(op(_as_i32(x), _as_i32(y))), 2, width)(a, b)
        np.testing.assert_array_equal(got, want, err_msg=name)
    got = _compiled(lambda x: _as_f32(dsl.absolute(_as_i32(x))), 1, width)(a)
    np.testing.assert_array_equal(got, np.abs(a))


def test_absolute_and_copysign_are_exact():
    x = SPECS["sin"].inputs()[::3]
    np.testing.assert_array_equal(
        _compiled(dsl.absolute)(x).view(np.uint32), np.abs(x).view(np.uint32)
    )
    flipped = _compiled(lambda v: dsl.copysign(v, -v))(x)
    np.testing.assert_array_equal(flipped.view(np.uint32), (-x).view(np.uint32))


def test_select_broadcasts_scalars_and_takes_numbers_on_either_side():
    x = _f32([-2.0, -0.5, 0.0, 1.5, 3.0, -1.0, 2.0, NAN])

    def lane_flags(v: V) -> V:
        return dsl.select(v > 0.0, v, -1.0)  # the existing form: a number for b

    def number_first(v: V) -> V:
        return dsl.select(v > 0.0, 7.0, v)

    def scalar_value_in_vector(v: V) -> V:
        first = V(vector.extract(v.value, [], [0]))  # a scalar V against a vector of flags
        return dsl.select(v > 0.0, first, v)

    def scalar_flag(v: V) -> V:
        first = V(vector.extract(v.value, [], [3]))
        return dsl.select(first > 0.0, v * 2.0, v)  # one flag picks a whole vector

    np.testing.assert_array_equal(_compiled(lane_flags)(x), np.where(x > 0, x, -1))
    np.testing.assert_array_equal(_compiled(number_first)(x), np.where(x > 0, 7, x))
    np.testing.assert_array_equal(_compiled(scalar_value_in_vector)(x), np.where(x > 0, -2, x))
    np.testing.assert_array_equal(_compiled(scalar_flag)(x), x * 2)
    with pytest.raises(TypeError, match="select"):
        _compiled(lambda v: dsl.select(v > 0.0, 1.0, 2.0))


# ----------------------------------------------------------------------------- lowering

SM90, GFX942 = target_for_arch("sm_90"), target_for_arch("gfx942")
# function: (PTX it must hold, gfx942 instruction it must hold: a regex; gfx942 pairs vector
# lanes into packed v_pk_fma_f32 / v_pk_mul_f32)
LOWERED = {
    "exp2": ("ex2.approx.f32", "v_exp_f32"),
    "exp": ("ex2.approx.f32", "v_exp_f32"),
    "tanh": ("ex2.approx.f32", "v_exp_f32"),
    "sigmoid": ("ex2.approx.f32", "v_exp_f32"),
    "erf": ("ex2.approx.f32", "v_exp_f32"),
    "log": ("fma.rn.f32", r"v_(pk_)?fma_f32"),
    "log2": ("fma.rn.f32", r"v_(pk_)?fma_f32"),
    "sin": ("fma.rn.f32", r"v_(pk_)?fma_f32"),
    "cos": ("fma.rn.f32", r"v_(pk_)?fma_f32"),
    "absolute": ("abs.f32", "v_and_b32"),
    "maximum": ("max.NaN.f32", "v_max_f32"),
    "minimum": ("min.NaN.f32", "v_min_f32"),
}
# Approximations past the one 2^x (ex2.approx.ftz would flush subnormal results) and calls.
_NOT_IN_PTX = re.compile(
    r"\b(call|sin\.approx|cos\.approx|lg2\.approx|ex2\.approx\.ftz|rcp\.approx)"
)
_NOT_IN_GFX = re.compile(r"\b(s_swappc_b64|s_setpc_b64|v_sin_f32|v_cos_f32|v_log_f32)")
_BINARY_STEP = ", gpu-module-to-binary{format=isa}"


def _kernel(name: str, target, width: int) -> dsl.Kernel:
    function = getattr(dsl, name)
    n_in = 2 if name in ("maximum", "minimum") else 1
    with dsl.Kernel(f"math_{name}", target, 64) as k:
        sources = [k.ptr(f"x{j}") for j in range(n_in)]
        out = k.ptr("y")
        i = k.thread_id() * width
        args = [load(get_llvm_ptr(s, i, "f32"), "f32", width) for s in sources]
        store(function(*args), get_llvm_ptr(out, i, "f32"))
    return k


def _lowered(name: str, target, width: int) -> str:
    """The kernel after the target's conversions, before any binary: what the backend sees."""
    k = _kernel(name, target, width)
    pipeline = target.pipeline.replace(_BINARY_STEP, "")
    assert target.vendor == "amd" or pipeline != target.pipeline  # the step is still there
    with k.context:
        passmanager.PassManager.parse(pipeline).run(k.module.operation)
        return str(k.module)


@pytest.mark.parametrize("width", [4, 1])
@pytest.mark.parametrize("name", list(LOWERED))
def test_lowers_for_sm90_without_libdevice(name, width):
    declared = re.findall(r"llvm\.func @(\w+)\(", _lowered(name, SM90, width))
    assert declared == [f"math_{name}"], f"external functions {declared}: libdevice calls"
    k = _kernel(name, SM90, width)
    ptx = module_to_ptx(k.module, SM90).decode()
    assert LOWERED[name][0] in ptx
    assert not _NOT_IN_PTX.search(ptx), _NOT_IN_PTX.search(ptx).group(0)
    if ptxas_path() is not None:
        ptx_to_cubin(ptx.encode(), "sm_90")  # raises on PTX that does not assemble


@pytest.mark.parametrize("width", [4, 1])
@pytest.mark.parametrize("name", list(LOWERED))
def test_lowers_for_gfx942_without_ocml(name, width):
    pytest.importorskip("llvmlite")
    ir_text = amd.module_to_llvm_ir(_lowered(name, GFX942, width))
    declared = [
        d for d in re.findall(r"declare .*?@([\w.$]+)\(", ir_text) if not d.startswith("llvm.")
    ]
    assert declared == [], f"external functions {declared}: device-library calls"
    assembly = amd.llvm_ir_to_assembly(ir_text, "gfx942")
    assert re.search(LOWERED[name][1], assembly)
    assert not _NOT_IN_GFX.search(assembly), _NOT_IN_GFX.search(assembly).group(0)
    try:
        binary = amd.llvm_ir_to_hsaco(ir_text, "gfx942")
    except amd.AmdToolchainMissing:
        return
    symbols = amd.read_code_object(binary)["symbols"]
    assert f"math_{name}.kd" in symbols
    assert not [s for s in symbols if s.startswith(("__ocml", "__ockl"))]
