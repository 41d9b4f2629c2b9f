"""DSL arithmetic run on the CPU: small MLIR functions built with kbuild.dsl, lowered to LLVM
and executed by MLIR's ExecutionEngine, so the exact bits of what the kernels compute are
checked without a GPU (dsl.rewiden both ways, dsl.fma's single rounding, dsl.dot's order)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytest.importorskip("mlir")

from mlir import execution_engine, ir, passmanager  # noqa: E402
from mlir.dialects import arith, func, vector  # noqa: E402
from mlir.runtime import get_ranked_memref_descriptor  # noqa: E402

from kbuild.dsl import V, dot, fma, rewiden  # noqa: E402

_LOWER = (
    "builtin.module(convert-vector-to-llvm,convert-math-to-llvm,finalize-memref-to-llvm,"
    "convert-func-to-llvm,convert-arith-to-llvm,reconcile-unrealized-casts)"
)


def _jit(in_type: str, n_in: int, n_out: int, body):
    """A function f(in: memref<n_in x in_type>, out: memref<n_out x f32>) whose body maps the
    input vector to the output vector (`body(V) -> V`); returns a numpy-level callable."""
    ctx = ir.Context()
    with ctx, ir.Location.unknown(ctx):
        module = ir.Module.create()
        element = {"i32": ir.IntegerType.get_signless(32), "f32": ir.F32Type.get()}[in_type]
        f32 = ir.F32Type.get()
        types = [ir.MemRefType.get([n_in], element), ir.MemRefType.get([n_out], f32)]
        with ir.InsertionPoint(module.body):
            fn = func.FuncOp("f", (types, []))
            fn.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()
            with ir.InsertionPoint(fn.add_entry_block()):
                source, out = fn.arguments
                zero = arith.ConstantOp(ir.IndexType.get(), 0).result
                value = vector.load(ir.VectorType.get([n_in], element), source, [zero])
                result = body(V(value)).value
                if not isinstance(result.type, ir.VectorType):
                    result = vector.broadcast(ir.VectorType.get([1], f32), result)
                vector.store(result, out, [zero])
                func.ReturnOp([])
        passmanager.PassManager.parse(_LOWER).run(module.operation)
        engine = execution_engine.ExecutionEngine(module, opt_level=2)

    def call(values: np.ndarray) -> np.ndarray:
        out = np.zeros(n_out, np.float32)
        args = [np.ascontiguousarray(values), out]
        pointers = [ctypes.pointer(ctypes.pointer(get_ranked_memref_descriptor(a))) for a in args]
        engine.invoke("f", *pointers)
        return out

    call.keep = (ctx, engine)  # the engine's code lives as long as the callable
    return call


def _widened(width: int, by_words: bool):
    """rewiden over `width` bf16 values packed two to an i32 word (element 2i: the low half
    of word i, as a little-endian bitcast lays them)."""

    def body(words: V) -> V:
        bf16 = ir.VectorType.get([width], ir.BF16Type.get())
        return rewiden(V(vector.bitcast(bf16, words.value)), by_words)

    return _jit("i32", width // 2, width, body)


@pytest.mark.parametrize("width", [8, 16])
@pytest.mark.parametrize("by_words", [False, True])
def test_rewiden_is_exact_for_every_bf16_pattern(width, by_words):
    # Every one of the 65536 bf16 bit patterns (NaNs, infinities, subnormals, -0) widens to
    # the fp32 with those bits on top: a lane order swapped by the word form's shuffle, or a
    # sign-extended half, shows as a mismatch.
    widen = _widened(width, by_words)
    patterns = np.arange(65536, dtype=np.uint32)
    words = (patterns[0::2] | (patterns[1::2] << 16)).view(np.int32)
    per_call = width // 2
    got = np.concatenate(
        [widen(words[i : i + per_call]) for i in range(0, len(words), per_call)]
    ).view(np.uint32)
    np.testing.assert_array_equal(got, patterns << 16)


def test_fma_rounds_once():
    # a * b + c with a * b = 1 - 2^-46 exactly: rounded on its own the product is 1.0 and the
    # sum 0; fused, the sum keeps -2^-46.
    a = np.float32(1 + 2.0**-23)
    b = np.float32(1 - 2.0**-23)
    fused = _jit("f32", 3, 1, lambda v: fma(*_lanes(v, 3)))
    separate = _jit("f32", 3, 1, lambda v: (lambda x, y, z: x * y + z)(*_lanes(v, 3)))
    values = np.array([a, b, -1.0], np.float32)
    assert fused(values)[0] == np.float32(-(2.0**-46))
    assert separate(values)[0] == 0.0


def test_dot_adds_start_then_lanes_in_order():
    # start + a0 * b0 + a1 * b1 + ..., each step one fma: with start = 2^24 and unit products
    # each 1 added to 2^24 is lost (ties to even), so the result stays 2^24; a tree or a
    # products-first order would keep them (2^24 + 4).
    def body(v: V) -> V:
        lanes = _lanes(v, 9)
        a = V(
            vector.from_elements(
                ir.VectorType.get([4], ir.F32Type.get()), [x.value for x in lanes[1:5]]
            )
        )
        b = V(
            vector.from_elements(
                ir.VectorType.get([4], ir.F32Type.get()), [x.value for x in lanes[5:9]]
            )
        )
        return dot(a, b, lanes[0])

    run = _jit("f32", 9, 1, body)
    assert run(np.array([2.0**24] + [1.0] * 8, np.float32))[0] == np.float32(2.0**24)
    assert run(np.array([0.0, 1, 2, 3, 4, 5, 6, 7, 8], np.float32))[0] == 70.0


def _lanes(v: V, n: int) -> list[V]:
    return [V(vector.extract(v.value, [], [i])) for i in range(n)]
