"""Misuse of the kernel DSL as a kernel author meets it: a Python TypeError / ValueError that
names the function and the operand types, raised before MLIR sees the op, never an LLVM
assertion that kills the process; IR that still fails to verify names the builder's file and
line (each op carries it as its location), and so does a CompileError.

The legal side is held too: the implicit conversions V has always made (a Python number
beside a value, a scalar beside a vector) still build, and so does a scalar beside a 1-lane
vector, which used to reach the verifier. kbuild's own kernels build bit for bit as before
(checked by hashing every manifest kernel's MLIR and PTX before and after; bench/ptx_hashes.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mlir")

from mlir import ir  # noqa: E402
from mlir.dialects import arith  # noqa: E402

from kbuild import Arg, Param, compiler, dsl, kernel  # noqa: E402
from kbuild.dsl import V  # noqa: E402
from kbuild.dsl.kernel import VerifyError, where  # noqa: E402
from kbuild.registry import KERNELS  # noqa: E402
from kbuild.targets import target_for_arch  # noqa: E402
from kbuild.targets.nvidia import module_to_ptx  # noqa: E402

SM90 = target_for_arch("sm_90")
HERE = Path(__file__).resolve()


def _line_of(marker: str) -> int:
    """The line of this file that holds `marker` (in a comment), other than this lookup."""
    lines = HERE.read_text().splitlines()
    found = [i for i, text in enumerate(lines, 1) if marker in text and "_line_of(" not in text]
    assert len(found) == 1, (marker, found)
    return found[0]


class Values:
    """Values of each kind, loaded in a kernel under construction."""

    def __init__(self, k: dsl.Kernel):
        self.k = k
        self.x = k.ptr("x")
        self.n = k.i64("n")
        self.f32 = dsl.load(dsl.get_llvm_ptr(self.x, 0, "f32"), "f32")
        self.bf16 = dsl.load(dsl.get_llvm_ptr(self.x, 0, "bf16"), "bf16")
        self.i32 = dsl.load(dsl.get_llvm_ptr(self.x, 0, "i32"), "i32")
        self.flag = self.f32 < 1.0
        self.v1 = dsl.splat(self.f32, 1)
        self.v4 = dsl.load(self.x, "f32", 4)
        self.v8 = dsl.load(self.x, "f32", 8)
        self.v4bf16 = dsl.load(self.x, "bf16", 4)
        self.flags4 = self.v4 < 0.0


def _in_kernel(body):
    """Run `body(Values)` while a kernel is built; returns the kernel."""
    with dsl.Kernel("errors", SM90, 128) as k:
        body(Values(k))
    return k


# (id, misuse, error type, the message or parts of it)
MISUSES = [
    # vectors and scalars of other shapes or types
    (
        "join of scalars",
        lambda v: dsl.join([v.f32, v.f32]),
        TypeError,
        "dsl.join: expects vectors of one element type, got f32 and f32 (scalars)",
    ),
    (
        "join of f32 and bf16 vectors",
        lambda v: dsl.join([v.v4, v.v4bf16]),
        TypeError,
        "dsl.join: expects vectors of one element type, got vector<4xf32> and vector<4xbf16>",
    ),
    ("join of nothing", lambda v: dsl.join([]), ValueError, "dsl.join: takes at least one"),
    ("join of a V", lambda v: dsl.join(v.v4), TypeError, "dsl.join: takes a list of V pieces"),
    (
        "split into uneven pieces",
        lambda v: dsl.split(v.v8, 3),
        ValueError,
        "dsl.split: vector<8xf32> does not split into pieces of 3 lanes",
    ),
    ("split by 0", lambda v: dsl.split(v.v8, 0), ValueError, "dsl.split: width must be"),
    (
        "splat of a vector",
        lambda v: dsl.splat(v.v4, 8),
        ValueError,
        "dsl.splat: broadcasts a scalar or a 1-lane vector, got vector<4xf32>",
    ),
    # V operators
    (
        "f32 - bf16",
        lambda v: v.f32 - v.bf16,
        TypeError,
        "V.__sub__ (a - b): operands of different element types, f32 and bf16",
    ),
    (
        "vector f32 * vector bf16",
        lambda v: v.v4 * v.v4bf16,
        TypeError,
        "V.__mul__ (a * b): operands of different element types, vector<4xf32> and vector<4xbf16>",
    ),
    (
        "int + float",
        lambda v: v.i32 + v.f32,
        TypeError,
        ("V.__add__", "i32 and f32", "integers and floats do not mix"),
    ),
    (
        "i64 + i32",
        lambda v: v.n + v.i32,
        TypeError,
        ("V.__add__", "i64 and i32", "dsl.cast"),
    ),
    (
        "int * a Python float",
        lambda v: v.n * 1.5,
        TypeError,
        "V.__mul__ (a * b): a float (1.5) beside the integer operand i64",
    ),
    (
        "a Python float - int",
        lambda v: 0.5 - v.n,
        TypeError,
        "V.__rsub__ (b - a): a float (0.5) beside the integer operand i64",
    ),
    (
        "vectors of different widths",
        lambda v: v.v4 + v.v8,
        ValueError,
        "V.__add__ (a + b): vectors of different widths, vector<4xf32> and vector<8xf32>",
    ),
    ("V + str", lambda v: v.f32 + "1", TypeError, ("V.__add__", "got str beside f32")),
    (
        "float & flag",
        lambda v: v.f32 & v.flag,
        TypeError,
        "V.__and__ (a & b): takes integers or flags (i1), got f32",
    ),
    ("~float", lambda v: ~v.f32, TypeError, "V.__invert__ (~a): takes integers or flags"),
    (
        "pointer arithmetic",
        lambda v: v.x + 1,
        TypeError,
        ("V.__add__", "!llvm.ptr<1>", "dsl.get_llvm_ptr"),
    ),
    (
        "a constant out of range",
        lambda v: v.i32 + 2**40,
        ValueError,
        "V.__add__ (a + b): 1099511627776 does not fit in i32",
    ),
    ("if on a V", lambda v: bool(v.flag), TypeError, ("has no Python truth value", "dsl.select")),
    ("V of a number", lambda v: V(1.0), TypeError, ("V wraps an ir.Value", "dsl.const")),
    # conversions and constants
    (
        "cast to an unknown dtype",
        lambda v: dsl.cast(v.f32, "f8"),
        ValueError,
        "dsl.cast: unknown dtype 'f8'; one of f32, f16, bf16, i8, i32, i64, i1, index",
    ),
    (
        "cast a float to an integer",
        lambda v: dsl.cast(v.f32, "i32"),
        TypeError,
        ("dsl.cast", "not f32 to i32"),
    ),
    ("cast a number", lambda v: dsl.cast(1.0, "f32"), TypeError, "dsl.cast: the value must be a V"),
    ("to_f32 of an int", lambda v: dsl.to_f32(v.i32), TypeError, "dsl.to_f32"),
    ("rewiden an int", lambda v: dsl.rewiden(v.i32), TypeError, "dsl.rewiden"),
    ("i64 of a float", lambda v: dsl.i64(v.f32), TypeError, "dsl.i64: converts integers"),
    (
        "a fraction as an integer constant",
        lambda v: dsl.const(1.5, "i32"),
        ValueError,
        "dsl.const: 1.5 is not a whole number, for i32",
    ),
    ("const of a string", lambda v: dsl.const("1", "f32"), TypeError, "dsl.const"),
    ("const of a bad dtype", lambda v: dsl.const(1, "float"), ValueError, "dsl.const: unknown"),
    (
        "opaque of a flag",
        lambda v: dsl.opaque(v.flag),
        ValueError,
        "dsl.opaque: takes values of whole 32-bit words, not i1",
    ),
    # select, min / max, fma, dot
    (
        "select between f32 and bf16",
        lambda v: dsl.select(v.flag, v.f32, v.bf16),
        TypeError,
        "dsl.select: the two values have different element types, f32 and bf16",
    ),
    (
        "select on a float",
        lambda v: dsl.select(v.f32, v.f32, 0.0),
        TypeError,
        "dsl.select: cond must be an i1 flag or a vector of flags, such as a comparison, got f32",
    ),
    (
        "select of two numbers",
        lambda v: dsl.select(v.flag, 1.0, 0.0),
        TypeError,
        "dsl.select: a or b must be a V",
    ),
    (
        "select with flags of another width",
        lambda v: dsl.select(v.flags4, v.v8, 0.0),
        ValueError,
        "dsl.select: vectors of different widths, cond vector<4xi1>",
    ),
    ("maximum of f32 and i32", lambda v: dsl.maximum(v.f32, v.i32), TypeError, "dsl.maximum"),
    ("fma of integers", lambda v: dsl.fma(v.i32, v.i32, v.i32), TypeError, "dsl.fma: a must"),
    (
        "fma of f32 and bf16",
        lambda v: dsl.fma(v.f32, v.bf16, 1.0),
        TypeError,
        "dsl.fma: operands of different element types, f32 and bf16",
    ),
    (
        "dot of a vector and a scalar",
        lambda v: dsl.dot(v.v4, v.f32),
        TypeError,
        "dsl.dot: a and b must have one type, got vector<4xf32> and f32",
    ),
    # math
    ("exp of bf16", lambda v: dsl.exp(v.bf16), TypeError, "dsl.exp: x must be an f32 scalar"),
    ("tanh of an int", lambda v: dsl.tanh(v.i32), TypeError, "dsl.tanh: x must be an f32"),
    ("sin of a number", lambda v: dsl.sin(1.0), TypeError, "dsl.sin: x must be an f32"),
    ("rsqrt of an int", lambda v: dsl.rsqrt(v.n), TypeError, "dsl.rsqrt"),
    ("copysign of bf16", lambda v: dsl.copysign(v.f32, v.bf16), TypeError, "dsl.copysign: sign"),
    # memory
    (
        "load of an unknown dtype",
        lambda v: dsl.load(v.x, "f64"),
        ValueError,
        "dsl.load: unknown dtype 'f64'; one of f32, f16, bf16, i8, i32, i64",
    ),
    ("load of width 0", lambda v: dsl.load(v.x, "f32", 0), ValueError, "dsl.load: width must"),
    ("load of width 2.0", lambda v: dsl.load(v.x, "f32", 2.0), TypeError, "dsl.load: width"),
    (
        "load from a value",
        lambda v: dsl.load(v.f32, "f32"),
        TypeError,
        "dsl.load: ptr must be a pointer (k.ptr, dsl.get_llvm_ptr, k.shared), got f32",
    ),
    (
        "store of a flag",
        lambda v: dsl.store(v.flag, v.x),
        TypeError,
        ("dsl.store", "got i1"),
    ),
    (
        "store with its arguments swapped",
        lambda v: dsl.store(v.x, v.f32),
        TypeError,
        "dsl.store: value must be a float or integer value, got !llvm.ptr<1>",
    ),
    (
        "an address at a float offset",
        lambda v: dsl.get_llvm_ptr(v.x, v.f32, "f32"),
        TypeError,
        "dsl.get_llvm_ptr: offset must be an integer scalar, got f32",
    ),
    (
        "atomic add of a vector",
        lambda v: dsl.atomic_add(v.x, v.v4),
        TypeError,
        "dsl.atomic_add: adds an f32 scalar, got vector<4xf32>",
    ),
    (
        "an async copy from shared memory",
        lambda v: dsl.copy_async(v.x, v.x),
        TypeError,
        "dsl.copy_async: shared_dst must point to shared memory (3), got !llvm.ptr<1>",
    ),
    (
        "a shared array of an unknown dtype",
        lambda v: v.k.shared(16, "f8"),
        ValueError,
        "Kernel.shared_array: unknown dtype 'f8'",
    ),
    (
        "thread-shared slots given another type",
        lambda v: dsl.ThreadShared(v.k, 2, "bf16", 4).put(0, v.v4),
        TypeError,
        "ThreadShared.put: value must be a vector<4xbf16> (the slots' type), got vector<4xf32>",
    ),
    # control flow
    (
        "if_else branches of different types",
        lambda v: dsl.if_else(v.flag, lambda: v.f32, lambda: v.bf16),
        TypeError,
        "dsl.if_else: the branches return different types, then() f32 and otherwise() bf16",
    ),
    (
        "if_else branch without a value",
        lambda v: dsl.if_else(v.flag, lambda: v.f32, lambda: None),
        TypeError,
        "dsl.if_else: otherwise() must return a V or a list of them, got None",
    ),
    (
        "if_else branches of different lists",
        lambda v: dsl.if_else(v.flag, lambda: [v.f32, v.f32], lambda: [v.f32, v.bf16]),
        TypeError,
        "dsl.if_else: the branches return different types, then() (f32, f32) and "
        "otherwise() (f32, bf16)",
    ),
    (
        "if_then on vector flags",
        lambda v: dsl.if_then(v.flags4, lambda: None),
        TypeError,
        "dsl.if_then: cond must be an i1 flag (a scalar), such as a comparison, got vector<4xi1>",
    ),
    (
        "a loop whose carried value changes type",
        lambda v: dsl.loop(0, v.n, 1, [v.f32], lambda i, c: [dsl.cast(c[0], "bf16")]),
        TypeError,
        "dsl.loop: carried value 0 changes type in the body: f32 in, bf16 out",
    ),
    (
        "a loop body returning too few values",
        lambda v: dsl.loop(0, v.n, 1, [v.f32, v.f32], lambda i, c: [c[0]]),
        ValueError,
        "dsl.loop: the body returned 1 values for 2 carried ones",
    ),
    (
        "a loop over float bounds",
        lambda v: dsl.loop(v.f32, v.n, 1, [], lambda i, c: []),
        TypeError,
        "dsl.loop: start must be an integer scalar, got f32",
    ),
    (
        "a while loop whose carried value changes type",
        lambda v: dsl.while_loop([v.n], lambda c: c[0] < 8, lambda c: [dsl.i32(c[0])]),
        TypeError,
        "dsl.while_loop: carried value 0 changes type in the body: i64 in, i32 out",
    ),
    (
        "a while loop on a float condition",
        lambda v: dsl.while_loop([v.f32], lambda c: c[0], lambda c: c),
        TypeError,
        "dsl.while_loop: cond(carried) must be an i1 flag",
    ),
    # reductions and the kernel
    (
        "merging states of other lengths",
        lambda v: dsl.add([v.f32], [v.f32, v.f32]),
        ValueError,
        "dsl.add: merges states of one length, got 1 and 2",
    ),
    ("thread_sum of nothing", lambda v: dsl.thread_sum([]), ValueError, "dsl.thread_sum"),
    (
        "a group that is not a power of two",
        lambda v: dsl.group_reduce(v.k, [v.f32], 6),
        ValueError,
        "dsl.group_reduce: group must be a power of two up to the warp size (32), got 6",
    ),
    (
        "a grid stride over a float count",
        lambda v: v.k.grid_stride(v.f32, lambda i, c: []),
        TypeError,
        "Kernel.grid_stride: n must be an integer scalar, got f32",
    ),
    (
        "an argument declared twice",
        lambda v: v.k.ptr("x"),
        ValueError,
        "Kernel.ptr: argument 'x' is declared twice",
    ),
    ("element_bytes of a bad dtype", lambda v: dsl.element_bytes("i1"), ValueError, "dsl.element"),
]


@pytest.mark.parametrize(
    ("misuse", "error", "message"),
    [pytest.param(*case[1:], id=case[0]) for case in MISUSES],
)
def test_a_misuse_raises_an_error_naming_the_function_and_types(misuse, error, message):
    with pytest.raises(error) as info:
        _in_kernel(misuse)
    text = str(info.value)
    for part in (message,) if isinstance(message, str) else message:
        assert part in text, (part, text)
    assert info.type is error  # not a subclass standing in (an MLIRError, a KeyError)


def test_implicit_conversions_still_build_and_verify():
    """What V has converted (numbers take the value's type, a scalar broadcasts over a
    vector) builds, as does a scalar beside a 1-lane vector (it reached the verifier as
    `'arith.subf' op requires the same type for all operands`) and f16 to bf16."""

    def body(v: Values) -> None:
        out = [
            v.v1 - v.f32,  # the scalar becomes a 1-lane vector
            v.f32 * v.v1,
            v.v4 * v.f32 + 1,  # an int beside a float value is a float constant
            2.0 - v.v4,
            dsl.select(v.flag, v.v4, 0.0),
            dsl.select(v.flags4, v.f32, v.v4),
            dsl.maximum(v.v4, v.f32),
            dsl.fma(v.f32, v.v4, 1.0),
            dsl.fma(v.f32, v.f32, v.v4),  # a and b broadcast over c
            dsl.copysign(v.v4, v.f32),
            dsl.join([v.v4, v.v4, v.v8]),  # any count, any widths
            dsl.join([v.f32]),
            dsl.cast(dsl.cast(v.f32, "f16"), "bf16"),
            dsl.sin(v.v1),
            dsl.loop(0, v.n, 1, [v.f32], lambda i, c: [c[0] + 1.0])[0],
            dsl.if_else(v.flag, lambda: v.v4, lambda: v.v4 * 2),
        ]
        for i, value in enumerate(out):
            dsl.store(value, dsl.get_llvm_ptr(v.x, 64 * i, "f32" if value.is_float else "i32"))
        dsl.store(dsl.select(v.flag & (v.f32 > 0.0) | ~v.flag, (v.n + 1) * 2 >> 1, 0), v.x)

    kernel_ = _in_kernel(body)
    kernel_.verify()


def test_no_misuse_aborts_the_process(tmp_path):
    """The LLVM assertion `join` of two scalars hit (exit 134, no traceback): now a
    TypeError a script can catch or print. Run in a child so an abort fails only this test."""
    script = tmp_path / "join_scalars.py"
    script.write_text(
        textwrap.dedent(
            """
            from kbuild import dsl
            from kbuild.targets import target_for_arch

            with dsl.Kernel("k", target_for_arch("sm_90"), 128) as k:
                x = k.ptr("x")
                a = dsl.load(x, "f32")
                dsl.join([a, a])
            """
        )
    )
    root = str(HERE.parents[1])  # this checkout's kbuild, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.returncode == 1, (run.returncode, run.stderr)
    assert "Assertion" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last == (
        "TypeError: dsl.join: expects vectors of one element type, got f32 and f32 (scalars)"
    )
    assert f'{script}", line 8' in run.stderr  # the traceback shows the author's line


def _walk(op: ir.Operation, out: list) -> list:
    out.append(op)
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                _walk(inner.operation, out)
    return out


def test_every_op_is_located_at_the_builders_line():
    def build() -> dsl.Kernel:
        with dsl.Kernel("located", SM90, 128) as k:  # located: the kernel
            x = k.ptr("x")
            shared = k.shared(128)  # located: shared
            value = dsl.exp(dsl.load(dsl.get_llvm_ptr(x, 0, "f32"), "f32"))  # located: exp
            dsl.store(value, dsl.get_llvm_ptr(shared, k.thread_id(), "f32"))  # located: store
        return k

    k = build()
    by_line: dict[int, set[str]] = {}
    for op in _walk(k.module.operation, []):
        at = where(op.location)
        assert at.startswith(f"{HERE}:"), (op.name, at)
        by_line.setdefault(int(re.match(r".*:(\d+)", at).group(1)), set()).add(op.name)
    assert "llvm.call_intrinsic" in by_line[_line_of("# located: exp")]
    assert "llvm.mlir.global" in by_line[_line_of("# located: shared")]
    assert "llvm.store" in by_line[_line_of("# located: store")]
    assert {"gpu.func", "gpu.return"} <= by_line[_line_of("# located: the kernel")]
    with k.context:
        assert HERE.name in k.module.operation.get_asm(enable_debug_info=True)
        assert HERE.name not in str(k.module)  # the printed IR (dumps, tests) is as before


def test_locations_stay_out_of_the_ptx():
    """Without debug-info scopes the NVVM lowering emits no line info: the PTX of a kernel
    built here is that of one built with no locations (no .loc / .file, no path)."""
    with dsl.Kernel("no_line_info", SM90, 128) as k:
        x = k.ptr("x")
        dsl.store(dsl.exp(dsl.load(x, "f32", 4)), x)
    ptx = module_to_ptx(k.module, SM90).decode()
    assert ".loc" not in ptx and ".file" not in ptx and HERE.name not in ptx


def test_locations_are_switched_off_after_a_kernel():
    from mlir._mlir_libs._mlir import globals as mlir_globals

    assert not mlir_globals.loc_tracebacks_enabled()
    with pytest.raises(TypeError):
        _in_kernel(lambda v: v.f32 - v.bf16)
    assert not mlir_globals.loc_tracebacks_enabled()
    _in_kernel(lambda v: None)
    assert not mlir_globals.loc_tracebacks_enabled()


def build_bad_kernel(N, target):
    """A kernel whose IR does not verify: an op built through the raw bindings."""
    with dsl.Kernel("dsl_errors_bad", target, 128) as k:
        x = k.ptr("x")
        a = dsl.load(x, "f32", N)
        arith.subf(a.value, dsl.load(x, "f32").value)  # the bad op: vector - scalar
    return k


def build_misused_kernel(N, target):
    with dsl.Kernel("dsl_errors_misused", target, 128) as k:
        x = k.ptr("x")
        dsl.store(dsl.load(x, "f32", N) - dsl.load(x, "bf16"), x)  # the misuse
    return k


def test_a_verifier_error_names_the_builders_file_and_line():
    with pytest.raises(VerifyError) as info:
        build_bad_kernel(4, SM90).verify()
    text = str(info.value)
    line = _line_of("# the bad op")
    assert text.startswith("kernel dsl_errors_bad: IR does not verify:"), text
    assert f"{HERE}:{line} (build_bad_kernel): 'arith.subf' op requires the same type" in text


@pytest.fixture
def declared():
    """Declares this file's two builders as kernels for the test; forgets them after."""
    params, args = (Param("N", "int"),), (Arg("x"),)
    definitions = [
        kernel("dsl_errors_bad", params=params, args=args)(build_bad_kernel),
        kernel("dsl_errors_misused", params=params, args=args)(build_misused_kernel),
    ]
    yield definitions
    for d in definitions:
        KERNELS.pop(d.name, None)


def test_a_compile_error_names_the_kernel_and_the_line(declared):
    bad, misused = declared
    with pytest.raises(compiler.CompileError) as info:
        compiler.build(bad.spec(N=4), SM90)
    text = str(info.value)
    assert "dsl_errors_bad(N=4) for sm_90: kernel dsl_errors_bad: IR does not verify" in text
    assert f"{HERE}:{_line_of('# the bad op')} (build_bad_kernel)" in text
    with pytest.raises(compiler.CompileError) as info:
        compiler.build(misused.spec(N=4), SM90)
    text = str(info.value)
    assert f"(at {HERE}:{_line_of('# the misuse')}): TypeError: V.__sub__ (a - b)" in text
    assert "vector<4xf32> and bf16" in text
