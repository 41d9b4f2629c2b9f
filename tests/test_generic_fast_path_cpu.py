"""Op.__call__'s fast path (kbuild/native/generic.h `call`): where an op's CUDA kernel is the
extension's generic one and every argument's check is a declaration, a positional call is
checked in C++ and run through the dispatcher with no Python check; a call the C++ check does
not take goes to the Python check, whose errors name the argument.

Held here, on CPU tensors with the launch hook set (the fast path takes them then, as it takes
CUDA tensors; the dispatcher runs the reference): every call the Python check refuses is
refused by the C++ check too, and raises the Python check's error through Op.__call__ (a
matrix of bad arguments of every kind, and random mixes of good and bad ones); every call the
C++ check takes, the Python check takes, and the reference gets the same values (an int for
a float made a float, defaults filled in); which ops take the fast path, and which calls
(keywords, CPU tensors without the hook, tensor subclasses, a torch function mode,
torch.compile) keep the Python one. Catches: a check the C++ side skips or weakens (a bound,
a device, a dtype, a shape, None where required), a refused call that raises another error,
a fast path for an op whose check is a Python function, a graph break under torch.compile.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kbuild import native
from kbuild.op import opdef
from kbuild.op.opdef import Feature, Ids, Launch, Like, Op, Out, Rows, Scalar, Tensors, eps
from kbuild.registry import Arg, KernelDef, Param

from .conftest import REPO_ROOT
from .examples import import_example

NATIVE = native.load(force=True)  # on a CPU too: the fast path runs under the launch hook
# not_interpreted: KBUILD_INTERPRET turns the extension off (the Python launch path runs)
pytestmark = [
    pytest.mark.skipif(NATIVE is None, reason="the C++ extension is unavailable"),
    pytest.mark.not_interpreted,
]

N = 8
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
I32, I64 = torch.int32, torch.int64

# A kernel reading every kind of argument an op declares (never compiled: the CPU reference
# runs under the hook).
KERNEL = KernelDef(
    "fast_path_test",
    "tests.nowhere:build",
    (
        Param("N", "int"),
        Param("dtype", "dtype"),
        Param("r_dtype", "dtype?"),
        Param("w_dtype", "dtype?"),
        Param("ids_dtype", "index"),
        Param("eps", "float"),
        Param("store", "bool"),
        Param("k", "int"),
        Param("y_dtype", "dtype"),
        Param("vectorize", "bool", True),
    ),
    (
        Arg("x"),
        Arg("r", when="r_dtype"),
        Arg("w", when="w_dtype"),
        Arg("ids"),
        Arg("y"),
        Arg("stats", when="store"),
        Arg("M", "i64"),
    ),
)
SEEN: list[tuple] = []  # the scalars each reference call got, as it got them


def _reference(x, r, w, ids, extra, eps, store, alpha, k, out_dtype):
    SEEN.append((eps, store, alpha, k, out_dtype))
    return x.to(out_dtype or x.dtype), x.float().mean(-1)


def _declare(name: str, **changes) -> Op:
    name = f"kbuild_fast_test::{name}"
    if name in opdef.DEFINED:
        return opdef.DEFINED[name]
    given = dict(
        args=(
            Rows("x"),
            Like("r", "x", or_fp32=True, optional=True),
            Feature("w"),
            Ids("ids", rows_of="x"),
            Tensors("extra", optional=True),
            eps(1e-6),
            Scalar("store", "bool", False),
            Scalar("alpha", "float", 1.0, bounds=(-2.0, 2.0)),
            Scalar("k", "int", 2, bounds=(1, 8)),
            Scalar("out_dtype", "dtype", None, optional=True),
        ),
        outputs=(Out("y", like="x", dtype="out_dtype"), Out("stats", rows="x", when="store")),
        launch=Launch(KERNEL),
        reference=_reference,
    )
    return Op(name, **{**given, **changes})


OP = _declare("checked")
NAMES = OP.arg_names


@pytest.fixture
def hooked():
    """The launch hook set: the fast path takes CPU tensors (as it takes CUDA ones)."""
    NATIVE.set_launch_hook(lambda name, grid, args: None)
    SEEN.clear()
    yield
    NATIVE.set_launch_hook(None)


def randn(shape, dtype=BF16, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def good(**changes) -> tuple:
    """A call the checks take, all arguments positional, with `changes` by name."""
    x = changes.get("x", randn((2, 3, N)))
    ids = torch.zeros(x.shape[:-1], dtype=I64) if isinstance(x, torch.Tensor) else None
    call = dict(x=x, r=None, w=None, ids=ids, extra=None, eps=1e-6, store=False, alpha=1.0,
                k=2, out_dtype=None)  # fmt: skip
    call.update(changes)
    return tuple(call[n] for n in NAMES)


def python_refusal(op: Op, args: tuple) -> BaseException | None:
    """What the Python check raises for this call (None: it takes it)."""
    try:
        op.check(op.bind(args, {}))
    except Exception as e:  # noqa: BLE001 (OverflowError too: what it raises is its answer)
        return e
    return None


def strided_w() -> torch.Tensor:
    return randn((N, 2))[:, 0]  # (N,) with stride 2: the Python check copies it


class Sub(torch.Tensor):
    """A tensor subclass (its __torch_function__ keeps the type): the Python path's."""


# One argument changed from a good call, each refused by the Python check.
BAD = {
    "x a float": dict(x=1.0),
    "x a string": dict(x="x"),
    "x None": dict(x=None),
    "x of ints": dict(x=torch.zeros(2, 3, N, dtype=I64)),
    "x a scalar": dict(x=torch.tensor(1.0), ids=torch.zeros((), dtype=I64)),
    "x on another device": dict(x=torch.zeros(2, 3, N, dtype=BF16, device="meta")),
    "r a list": dict(r=[1.0]),
    "r of another shape": dict(r=randn((2, 3, N - 1))),
    "r of another dtype": dict(r=randn((2, 3, N), F16)),
    "r of ints": dict(r=torch.zeros(2, 3, N, dtype=I32)),
    "r on another device": dict(r=torch.zeros(2, 3, N, dtype=BF16, device="meta")),
    "w a float": dict(w=1.0),
    "w of another shape": dict(w=randn(N - 1)),
    "w a matrix": dict(w=randn((1, N))),
    "w of another dtype": dict(w=randn(N, F16)),
    "w on another device": dict(w=torch.ones(N, device="meta")),
    "ids floats": dict(ids=torch.zeros(2, 3)),
    "ids one per element": dict(ids=torch.zeros(2, 3, N, dtype=I64)),
    "ids flattened": dict(ids=torch.zeros(6, dtype=I64)),
    "ids a list": dict(ids=[0, 1]),
    "ids None": dict(ids=None),
    "ids on another device": dict(ids=torch.zeros(2, 3, dtype=I64, device="meta")),
    "extra a list": dict(extra=[1]),
    "eps negative": dict(eps=-1e-6),
    "eps a negative int": dict(eps=-1),
    "eps NaN": dict(eps=math.nan),
    "eps infinite": dict(eps=math.inf),
    "eps a bool": dict(eps=True),
    "eps a string": dict(eps="1e-6"),
    "eps None": dict(eps=None),
    "eps past a double": dict(eps=10**400),
    "store an int": dict(store=1),
    "store None": dict(store=None),
    "alpha above its bounds": dict(alpha=2.5),
    "alpha an int below them": dict(alpha=-3),
    "alpha NaN": dict(alpha=math.nan),
    "alpha infinite": dict(alpha=-math.inf),
    "alpha a bool": dict(alpha=True),
    "alpha None": dict(alpha=None),
    "alpha a string": dict(alpha="1"),
    "alpha past a double": dict(alpha=-(10**400)),
    "k 0": dict(k=0),
    "k 9": dict(k=9),
    "k a float": dict(k=2.0),
    "k a bool": dict(k=True),
    "k None": dict(k=None),
    "k past int64": dict(k=2**63),
    "k far below": dict(k=-(2**70)),
    "out_dtype int32": dict(out_dtype=I32),
    "out_dtype float64": dict(out_dtype=torch.float64),
    "out_dtype a name": dict(out_dtype="bf16"),
    "out_dtype a list": dict(out_dtype=[BF16]),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_every_python_refusal_is_a_fast_path_refusal_with_its_message(hooked, case):
    """A bad argument the C++ check took would reach the kernels unchecked (a bound, a dtype,
    a device, a shape); one it refuses must raise the Python check's own error."""
    args = good(**BAD[case])
    refusal = python_refusal(OP, args)
    assert refusal is not None, "not a bad call"
    assert OP._fast(args) is None
    with pytest.raises(type(refusal)) as raised:
        OP(*args)
    assert str(raised.value) == str(refusal)
    assert SEEN == []  # nothing ran


def test_calls_binding_refuses_are_refused_too(hooked):
    """Too many arguments, a required one left out: Python's TypeError, by the same words."""
    for args in (good() + (1,), good()[:3]):
        refusal = python_refusal(OP, args)
        assert isinstance(refusal, TypeError)
        assert OP._fast(args) is None
        with pytest.raises(TypeError) as raised:
            OP(*args)
        assert str(raised.value) == str(refusal)


# Calls the fast path takes: each must give the reference what the Python path gives it.
GOOD = {
    "defaults": dict(),
    "r fp32, w fp32": dict(r=randn((2, 3, N), F32), w=randn(N, F32)),
    "r and w of x's dtype": dict(r=randn((2, 3, N)), w=randn(N)),
    "f32 x": dict(x=randn((2, 3, N), F32), r=randn((2, 3, N), F32)),
    "f16 x, int32 ids": dict(x=randn((4, N), F16), ids=torch.zeros(4, dtype=I32)),
    "one row": dict(x=randn(N), ids=torch.zeros((), dtype=I64)),
    "a strided x": dict(x=randn((2, N, 3)).transpose(1, 2)),
    "a parameter": dict(x=torch.nn.Parameter(randn((2, 3, N)), requires_grad=False)),
    "ints for floats": dict(eps=0, alpha=2),
    "the bounds' ends": dict(eps=0.0, alpha=-2.0, k=8),
    "k at 1, flags, a dtype": dict(k=1, store=True, out_dtype=F32),
    "extra any tensor": dict(extra=torch.zeros(5, dtype=torch.uint8)),
}  # fmt: skip


@pytest.mark.parametrize("case", GOOD)
def test_a_call_the_fast_path_takes_runs_as_the_python_path(hooked, case, monkeypatch):
    """No Python check runs, and the reference gets the values (and their types: 2 -> 2.0)
    the Python check and torch.ops call give it."""
    args = good(**GOOD[case])
    checks = []
    monkeypatch.setattr(OP, "check", lambda bound: checks.append(bound) or bound)
    fast = OP(*args)
    assert checks == []  # taken by the fast path
    monkeypatch.undo()
    slow = OP.overload(*OP.check(OP.bind(args, {})).values())
    assert len(SEEN) == 2 and SEEN[0] == SEEN[1]
    assert [type(v) for v in SEEN[0]] == [type(v) for v in SEEN[1]]
    for a, b in zip(fast, slow, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_defaults_left_out_are_the_declared_ones(hooked):
    x = randn((2, 3, N))
    ids = torch.zeros(2, 3, dtype=I64)
    assert OP._fast((x, None, None, ids)) is not None
    assert OP._fast((x, None, None, ids, None, 0.5, True)) is not None
    assert SEEN == [(1e-6, False, 1.0, 2, None), (0.5, True, 1.0, 2, None)]


# Values per argument the Python check takes, and values it refuses (or the fast path leaves
# to it: a subclass, a strided w, meta tensors), mixed at random below.
def _pools() -> dict[str, tuple[list, list]]:
    x = randn((2, 3, N))
    return {
        "x": ([x, randn((2, 3, N), F32), x.half()],
              [1.0, None, torch.zeros(2, 3, N, dtype=I64), x.to("meta"), x.as_subclass(Sub)]),
        "r": ([None, randn((2, 3, N)), randn((2, 3, N), F32)],
              [randn((2, 3, N), F16), randn((2, 3, N - 1)), [1.0], x.to("meta")]),
        "w": ([None, randn(N), randn(N, F32)],
              [randn(N, F16), randn(N - 1), strided_w(), randn((1, N)), "w"]),
        "ids": ([torch.zeros(2, 3, dtype=I64), torch.ones(2, 3, dtype=I32)],
                [torch.zeros(2, 3), torch.zeros(6, dtype=I64), None,
                 torch.zeros(2, 3, dtype=I64, device="meta")]),
        "extra": ([None, randn(3)], [[1], randn(3).to("meta")]),
        "eps": ([1e-6, 0, 0.0], [-1e-6, math.nan, math.inf, True, None, "x", 10**400]),
        "store": ([False, True], [1, None]),
        "alpha": ([1.0, 2, -2.0], [2.0000001, -3, math.nan, True, None]),
        "k": ([2, 1, 8], [0, 9, 2.0, False, 2**63]),
        "out_dtype": ([None, F32, BF16, F16], [I32, torch.float64, "bf16"]),
    }  # fmt: skip


def test_random_calls_the_fast_path_takes_are_calls_the_python_check_takes(hooked):
    """Mixes of good and bad arguments (each bad one time in ten): the fast path takes a call
    only where the Python check takes it (and runs it as the Python path does); it refuses
    every call the Python check refuses. Enough of both kinds that neither side of the claim
    is empty."""
    pools, rng = _pools(), random.Random(0)
    taken = refused = 0
    for _ in range(600):
        args = tuple(rng.choice(pools[n][rng.random() < 0.1]) for n in NAMES)
        refusal = python_refusal(OP, args)
        SEEN.clear()
        out = OP._fast(args)
        if refusal is not None:
            assert out is None, (args, refusal)
            refused += 1
            continue
        if out is None:
            continue  # the Python path's (a subclass, a strided w, meta tensors)
        taken += 1
        OP.overload(*OP.check(OP.bind(args, {})).values())
        assert len(SEEN) == 2 and SEEN[0] == SEEN[1], args
    assert taken >= 100 and refused >= 200, (taken, refused)


def test_which_ops_take_the_fast_path():
    """Only ops whose CUDA kernel is the generic one and whose every check is a declaration:
    a `check=` function, a scalar's check_value without bounds, `cuda=` or a launch value
    computed in Python keep Op.__call__ on the Python check."""
    ex = import_example(keep_kernels=False)
    assert ex.softmax._fast is not None and ex.softmax.backward._fast is not None
    assert OP._fast is not None and OP.native_program()["checks"] is not None
    own_check = _declare("own_check", check=lambda bound: None)
    assert not own_check.generic_native and own_check._fast is None
    scalar = Scalar("alpha", "float", 1.0, check_value=lambda value, bound: float(value))
    python_scalar = _declare("python_scalar", args=(*OP.args[:7], scalar, *OP.args[8:]))
    assert python_scalar.generic_native and python_scalar._fast is None
    assert python_scalar.native_program()["checks"] is None
    by_hand = _declare("by_hand", launch=None, cuda=lambda *args: None)
    assert not by_hand.generic_native and by_hand._fast is None
    computed = _declare("computed", launch=Launch(KERNEL, values={"k": lambda bound: 3}))
    assert not computed.generic_native and computed._fast is None


DECLARED_BEFORE_THE_LOAD = """
from kbuild import native
from tests.examples import import_example

example = import_example()  # declared at import, as users do: before any CUDA call
print("before", example.softmax._fast is None)
native.load(force=True)
print("after", example.softmax._fast is not None, example.softmax.backward._fast is not None)
"""


def test_ops_declared_before_the_load_take_the_fast_path_after_it(subprocess_env):
    """The extension loads at the first CUDA call, after the user's ops are declared: its
    generic kernels replace their Python ones then, and their calls must take the fast path
    from then on too (not only ops declared after the load)."""
    env = {k: v for k, v in subprocess_env.items() if k != "KBUILD_NATIVE"}
    result = subprocess.run([sys.executable, "-c", DECLARED_BEFORE_THE_LOAD], env=env,
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "before True" in result.stdout and "after True True" in result.stdout, result.stdout


def test_a_python_scalar_check_still_runs(hooked):
    """The op whose scalar check is a Python function: its refusal is raised, its
    normalisation reaches the reference."""

    def positive(value, bound):
        if value <= 0:
            raise ValueError(f"alpha must be positive; got {value}")
        return float(value)

    scalar = Scalar("alpha", "float", 1.0, check_value=positive)
    op = _declare("python_alpha", args=(*OP.args[:7], scalar, *OP.args[8:]))
    assert op._fast is None
    with pytest.raises(ValueError, match=r"^alpha must be positive; got -1$"):
        op(*good(alpha=-1))
    op(*good(alpha=3))
    assert SEEN[-1][2] == 3.0 and type(SEEN[-1][2]) is float


def test_calls_left_to_the_python_path(hooked, monkeypatch):
    """Keywords, CPU tensors without the launch hook (they run the reference from Python), a
    tensor subclass (its __torch_function__ must see the op) and a torch function mode (which
    sees torch.ops calls) keep the Python check and torch.ops call."""
    args = good()
    checks = []
    check = OP.check
    monkeypatch.setattr(OP, "check", lambda bound: checks.append(1) or check(bound))
    OP(*args[:4], eps=1e-6)
    assert checks == [1]
    sub = good(x=randn((2, 3, N)).as_subclass(Sub))
    assert OP._fast(sub) is None
    y, _ = OP(*sub)
    assert type(y) is Sub  # its __torch_function__ ran
    seen = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        assert OP._fast(args) is None
        OP(*args)
    assert OP.overload in seen
    NATIVE.set_launch_hook(None)
    assert OP._fast(args) is None  # CPU tensors, no hook: the reference, from Python
    checks.clear()
    OP(*args)
    assert checks == [1]


def test_autograd_runs_behind_the_fast_path(hooked, monkeypatch):
    """The example's softmax called with a tensor that wants a gradient: the fast path runs
    the op through the dispatcher's autograd (the generic C++ autograd kernel), whose
    gradient is torch's."""
    ex = import_example(keep_kernels=False)
    monkeypatch.setattr(ex.softmax, "check", lambda bound: pytest.fail("the Python check ran"))
    x = torch.randn(3, 16, dtype=torch.float64).float().requires_grad_()
    dy = torch.randn(3, 16)
    y = ex.softmax(x)
    assert y.grad_fn is not None and "Backward" in y.grad_fn.name()
    (dx,) = torch.autograd.grad(y, x, dy)
    xt = x.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(torch.softmax(xt, -1), xt, dy)
    torch.testing.assert_close(dx, want)


def test_an_error_past_the_checks_is_the_same_on_both_paths(hooked):
    """An error raised by the op itself (here its CPU kernel) reaches the caller with its type
    and words whether the fast path or torch.ops called it."""

    def failing(*args):
        raise ValueError("the reference refuses: boom")

    op = _declare("failing", reference=failing)
    args = good()
    assert python_refusal(op, args) is None
    with pytest.raises(ValueError) as fast:
        op(*args)
    with pytest.raises(ValueError) as slow:
        op.overload(*args)
    assert str(fast.value) == str(slow.value)
    assert "the reference refuses: boom" in str(fast.value)


def test_torch_compile_traces_the_python_path(hooked):
    """Under torch.compile the fast path (a C++ function dynamo cannot trace) is never
    reached: a whole graph, no break."""
    ex = import_example(keep_kernels=False)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: ex.softmax(x) * 2, backend="eager", fullgraph=True)
    x = torch.randn(4, 32)
    torch.testing.assert_close(compiled(x), torch.softmax(x, -1) * 2)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- bounds


def test_scalar_bounds_are_checked_and_named():
    k = Scalar("k", "int", bounds=(1, 8))
    assert k.check(8, {}) == 8
    with pytest.raises(ValueError, match=r"^k must be in \[1, 8\]; got 9$"):
        k.check(9, {})
    low = Scalar("alpha", "float", bounds=(0, None))
    assert low.check(0, {}) == 0.0 and type(low.check(0, {})) is float
    with pytest.raises(ValueError, match=r"^alpha must be >= 0; got -0.5$"):
        low.check(-0.5, {})
    with pytest.raises(ValueError, match=r"^alpha must be <= 1.5; got 2.0$"):
        Scalar("alpha", "float", bounds=(None, 1.5)).check(2, {})


@pytest.mark.parametrize(
    "kind, bounds",
    [("bool", (0, 1)), ("dtype", (None, None)), ("int", (0.5, 2)), ("int", (3, 1)),
     ("float", (math.nan, None)), ("float", (0.0,)), ("float", "0, 1"), ("int", (True, 3))],
)  # fmt: skip
def test_bounds_that_cannot_be_are_refused_when_declared(kind, bounds):
    with pytest.raises(ValueError, match=r"^s: bounds="):
        Scalar("s", kind, bounds=bounds)


def test_a_bound_cpp_cannot_hold_keeps_the_python_check():
    """An int bound past int64, a float bound no double holds: the C++ comparison would not
    be Python's, so the argument's check stays Python's (and the op off the fast path)."""
    assert Scalar("k", "int", bounds=(0, 2**63)).native_check({}) is None
    assert Scalar("a", "float", bounds=(2**53 + 1, None)).native_check({}) is None
    assert Scalar("a", "float", bounds=(0, 2**53)).native_check({}) is not None
    assert eps().native_check({}) == (5, False, -1, False, 0.0, None)
