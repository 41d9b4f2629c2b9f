"""kbuild.Op (kbuild/op/opdef.py) on CPU: what one description derives, each test naming the
bug it is there to catch.

An Op derives an operator's torch.library schema, its argument checks, its fake and CPU
kernels, its CUDA kernel (a Launch binding a KernelDef's parameters and arguments by name)
and its autograd formula (by names). Here:
- the norms' six schemas are the literal strings torch had before they were derived (a
  compiled graph or a saved program names them);
- ops declared in this file (namespace kbuild_test_opdef: an op name is defined once per
  process) check their arguments, agree fake with CPU, refuse bad declarations, and route
  gradients by name;
- the CUDA launch path runs on CPU tensors against a fake launcher whose kernels are CPU
  stand-ins reading and writing the memory their pointer arguments name, so a launch bound
  to the wrong tensor, or to a strided one, computes the wrong values;
- the softmax example (examples/custom_softmax.py) differentiates like fp64 torch.softmax
  and warms exactly the kernels its launches ask for.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import re
import sys
from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kbuild import native
from kbuild.kernels.norms import custom_ops  # custom_ops: the kbuild::* operators
from kbuild.op import binding as op_launch  # custom_ops: the kbuild::* operators
from kbuild.op import opdef
from kbuild.op.opdef import Feature, Launch, Like, Op, Out, Rows, Scalar, Tensors, eps
from kbuild.registry import Arg, KernelDef, Param
from kbuild.spec import KernelSpec

from .examples import import_example
from .gpu_utils import GRAD_TOL
from .reference import assert_close_rel
from .value_checks import assert_forward

# The Op machinery with stand-in kernels no builder makes (their CPU references are the point):
# under KBUILD_INTERPRET their CUDA path would look for those kernels.
pytestmark = pytest.mark.not_interpreted

NS = "kbuild_test_opdef"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = (F32, F16, BF16)
TORCH = {"f32": F32, "f16": F16, "bf16": BF16}
N = 8
STREAM = 7  # what the fake stream_of returns: the launches must pass it on
_unique = itertools.count()


def fresh(tag: str) -> str:
    """An op name no other test declared (a name is defined once per process)."""
    return f"{NS}::{tag}_{next(_unique)}"


def randn(shape, dtype=F32, seed=0, scale=1.0, offset=0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + offset).to(dtype)


def misaligned(shape, dtype) -> torch.Tensor:
    """A dense tensor one element into its storage: its address is not 16-byte aligned."""
    return randn(math.prod(shape) + 1, dtype, seed=5)[1:].view(shape)


def kernel(name: str, params, args) -> KernelDef:
    """A table entry of a kernel that is never built (the CPU tests load nothing)."""
    return KernelDef(f"{NS}_{name}", "tests.test_opdef_cpu:never_built", tuple(params), tuple(args))


def never_runs(*args):
    """The CUDA kernel (or reference) of an op that is only declared or checked here."""
    raise AssertionError("a kernel the CPU tests never run ran")


def fake_outputs(op: Op, *args):
    """The op's outputs under FakeTensorMode (what tracing sees), as a tuple."""
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = op.overload(*fakes)
    return out if isinstance(out, tuple) else (out,)


def meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.device


# ----------------------------------------------------------------------------- a CPU "device"


# address -> the bytes from it to the end of its storage, for every data_ptr() taken while the
# `device` fixture is on: how far a stand-in kernel may reach from a pointer it is given.
EXTENTS: dict[int, int] = {}


def at(address: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """The dense tensor a kernel sees at `address` (read and written in place). Refused past
    the storage of the tensor that gave the address: a pointer or a row count bound wrongly
    must fail the test, not write over the heap."""
    size = math.prod(shape) * dtype.itemsize
    if size > EXTENTS.get(address, 0):
        raise AssertionError(
            f"a kernel would reach {size} bytes from {address:#x}, past its tensor"
        )
    return torch.frombuffer((ctypes.c_char * size).from_address(address), dtype=dtype).view(shape)


@dataclass
class Launched:
    kernel: str
    values: tuple
    spec: KernelSpec
    grid: object
    stream: int
    args: tuple


class FakeLauncher:
    """What _Binding.run reads of a loaded kernel (runtime.cuda.Launcher): `names` (the
    table's arguments of its spec, in order), `meta` and the launch shape. A call records the
    launch and runs the kernel's CPU stand-in (BODIES) on the memory its pointers name."""

    def __init__(self, device: FakeDevice, kernel: KernelDef, values: tuple) -> None:
        self.device, self.kernel, self.values = device, kernel, values
        self.spec = kernel.spec(*values)
        self.names = kernel.arg_names(self.spec)
        self.meta = dict(device.meta)
        self.rows_per_block = device.rows_per_block
        self.cluster = device.cluster
        self.resident_clusters = device.resident_clusters

    def __call__(self, grid, stream, *args) -> None:
        launched = Launched(self.kernel.name, self.values, self.spec, grid, stream, args)
        self.device.launches.append(launched)
        body = BODIES.get(self.kernel.name)
        if body is not None:
            named = dict(zip(self.names, args, strict=True))
            pointers = [a for n, a in named.items() if n not in ("M", "cols")]
            assert len(set(pointers)) == len(pointers), "two arguments at one address"
            body(self.spec.kwargs, named)


class FakeDevice:
    """Stands in for opdef's launcher_for / device_guard / stream_of (see the fixture)."""

    def __init__(self) -> None:
        self.launches: list[Launched] = []
        self.guarded: list[torch.device] = []
        self.meta: dict = {}
        self.rows_per_block, self.cluster, self.resident_clusters = 2, 2, 2

    def launcher_for(self, kernel: KernelDef, device: int, values: tuple) -> FakeLauncher:
        assert device == -1, device  # a CPU tensor's get_device(), as the launch passes it on
        return FakeLauncher(self, kernel, values)

    def guard(self, t: torch.Tensor):
        self.guarded.append(t.device)
        return contextlib.nullcontext()


@pytest.fixture
def device(monkeypatch) -> FakeDevice:
    """Every launch of opdef goes to a FakeDevice: nothing touches CUDA. Every address a
    tensor hands out is noted with its extent (EXTENTS), for `at`."""
    fake = FakeDevice()
    real_data_ptr = torch.Tensor.data_ptr

    def data_ptr(t: torch.Tensor) -> int:
        address, storage = real_data_ptr(t), t.untyped_storage()
        EXTENTS[address] = storage.data_ptr() + storage.nbytes() - address
        return address

    EXTENTS.clear()
    monkeypatch.setattr(torch.Tensor, "data_ptr", data_ptr)
    monkeypatch.setattr(op_launch, "launcher_for", fake.launcher_for)
    monkeypatch.setattr(opdef, "device_guard", fake.guard)
    monkeypatch.setattr(op_launch, "stream_of", lambda index: STREAM)
    return fake


# ----------------------------------------------------------------------------- the test ops
# MUL: y = alpha * x * w and, when store_ms, ms = mean(x^2) per row; two outputs, so a
# gradient handed to the wrong one shows. Its forward and backward each launch one kernel
# whose stand-in computes with the same functions as the CPU reference, bit for bit.


def mul_values(x32, w32, alpha):
    y = alpha * x32 * (1.0 if w32 is None else w32)
    return y, x32.square().mean(-1)


def mul_grads(dy32, dms32, x32, w32, alpha, need_dx, need_dw):
    """(dx, dw) in fp32, None where not wanted; dms32 (rows, 1) or None."""
    dx = dw = None
    if need_dx:
        dx = alpha * dy32 * (1.0 if w32 is None else w32)
        if dms32 is not None:
            dx = dx + (2.0 / x32.shape[-1]) * x32 * dms32
    if need_dw and w32 is not None:
        dw = (alpha * dy32 * x32).reshape(-1, x32.shape[-1]).sum(0)
    return dx, dw


def mul_reference(x, w, alpha, store_ms):
    y, ms = mul_values(x.float(), None if w is None else w.float(), alpha)
    return y.to(x.dtype), ms


BACKWARD_FLAGS: list[tuple[bool, bool]] = []  # (need_dx, need_dw) as MUL_BWD's CPU kernel got them


def mul_backward_reference(dy, dms, x, w, alpha, need_dx, need_dw):
    BACKWARD_FLAGS.append((need_dx, need_dw))
    dms32 = dms.reshape(*x.shape[:-1], 1) if dms.numel() else None
    w32 = None if w is None else w.float()
    dx, dw = mul_grads(dy.float(), dms32, x.float(), w32, alpha, need_dx, need_dw)
    return (None if dx is None else dx.to(x.dtype)), (None if dw is None else dw.to(w.dtype))


ROW_PARAMS = (Param("N", "int"), Param("dtype", "dtype"), Param("w_dtype", "dtype?"))
VECTORIZE = Param("vectorize", "bool", True, vectors_of=("dtype",))
MUL_FWD_KERNEL = kernel(
    "mul_fwd",
    (*ROW_PARAMS, Param("alpha", "float"), Param("store_ms", "bool"), VECTORIZE),
    (Arg("x"), Arg("w", when="w_dtype"), Arg("y"), Arg("ms", when="store_ms"), Arg("M", "i64"),
     Arg("cols", "i64")),
)  # fmt: skip
MUL_BWD_KERNEL = kernel(
    "mul_bwd",
    (*ROW_PARAMS, Param("alpha", "float"), Param("with_dms", "bool"), Param("need_dx", "bool"),
     Param("need_dw", "bool", needs="w_dtype"), VECTORIZE),
    (Arg("dy"), Arg("dms", when="with_dms"), Arg("x"), Arg("w", when="w_dtype"),
     Arg("dx", when="need_dx"), Arg("dw", when="need_dw"), Arg("M", "i64")),
)  # fmt: skip


def _mul_fwd_body(p, a) -> None:
    M, N_, dtype = a["M"], p["N"], TORCH[p["dtype"]]
    assert a["cols"] == N_
    x = at(a["x"], (M, N_), dtype).float()
    w = at(a["w"], (N_,), TORCH[p["w_dtype"]]).float() if p["w_dtype"] else None
    y, ms = mul_values(x, w, p["alpha"])
    at(a["y"], (M, N_), dtype).copy_(y)
    if p["store_ms"]:
        at(a["ms"], (M,), F32).copy_(ms)


def _mul_bwd_body(p, a) -> None:
    M, N_, dtype = a["M"], p["N"], TORCH[p["dtype"]]
    w = at(a["w"], (N_,), TORCH[p["w_dtype"]]).float() if p["w_dtype"] else None
    dms = at(a["dms"], (M, 1), F32) if p["with_dms"] else None
    dy, x = at(a["dy"], (M, N_), dtype).float(), at(a["x"], (M, N_), dtype).float()
    dx, dw = mul_grads(dy, dms, x, w, p["alpha"], p["need_dx"], p["need_dw"])
    if dx is not None:
        at(a["dx"], (M, N_), dtype).copy_(dx)
    if dw is not None:
        at(a["dw"], (N_,), TORCH[p["w_dtype"]]).copy_(dw)


BODIES = {MUL_FWD_KERNEL.name: _mul_fwd_body, MUL_BWD_KERNEL.name: _mul_bwd_body}

ALPHA = 0.75
MUL_BWD = Op(
    f"{NS}::mul_backward",
    args=(Rows("dy"), Tensors("dms"), Rows("x"), Feature("w"), Scalar("alpha", "float"),
          Scalar("need_dx", "bool"), Scalar("need_dw", "bool")),
    outputs=(Out("dx", like="x", when="need_dx"), Out("dw", like="w", when=("need_dw", "w"))),
    launch=Launch(MUL_BWD_KERNEL, values={"with_dms": lambda bound: bound["dms"].numel() > 0}),
    reference=mul_backward_reference,
)  # fmt: skip
MUL = Op(
    f"{NS}::mul",
    args=(
        Rows("x"),
        Feature("w"),
        Scalar("alpha", "float", 1.0),
        Scalar("store_ms", "bool", False),
    ),
    outputs=(Out("y", like="x"), Out("ms", rows="x", when="store_ms")),
    launch=Launch(MUL_FWD_KERNEL, ints={"cols": lambda bound: bound["x"].shape[-1]}),
    reference=mul_reference,
    backward=MUL_BWD,
)


def _declared_without_the_extension(op: Op, name: str) -> Op:
    """`op` declared again under `name` as where the C++ extension does not load: its autograd
    the Python formula (torch.library's), not the C++ generic autograd kernel."""
    saved, opdef.NATIVE[0] = opdef.NATIVE[0], None
    try:
        return opdef.DEFINED.get(name) or Op(
            name, args=op.args, outputs=op.outputs, launch=op.launches,
            reference=op.reference, backward=op.backward,
        )  # fmt: skip
    finally:
        opdef.NATIVE[0] = saved


MUL_PY = _declared_without_the_extension(MUL, f"{NS}::mul_python_autograd")


def _formula(grad_fn, *grads):
    """What an op's autograd formula returns, input by input, called outside the engine: a
    Python formula's `apply`, or the C++ node called."""
    apply = getattr(grad_fn, "apply", None)
    return apply(*grads) if apply is not None else grad_fn(*grads)


AUTOGRAD_ROUTES = pytest.mark.parametrize("mul", [MUL, MUL_PY], ids=["cpp", "python"])


# CHECKED: every kind of argument and output, for the checks and the fake kernel (CPU only).
def checked_reference(x, r, w, eps, store, out_dtype, alpha, k):
    xf = x.float() if r is None else x.float() + r.float()
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    y = xf * rstd.unsqueeze(-1) * (alpha * k)
    y = y if w is None else y * w.float()
    return y.to(x.dtype), rstd, (None if out_dtype is None else y.to(out_dtype)), xf


CHECKED = Op(
    f"{NS}::checked",
    args=(Rows("x"), Like("r", "x", or_fp32=True, optional=True), Feature("w"), eps(),
          Scalar("store", "bool"), Scalar("out_dtype", "dtype", None, optional=True),
          Scalar("alpha", "float", 1.0), Scalar("k", "int", 1)),
    outputs=(Out("y", like="x"), Out("stat", rows="x", when="store"),
             Out("z", like="x", dtype="out_dtype", when="out_dtype"),
             Out("r32", like="r", dtype="float32", when="r")),
    reference=checked_reference,
    cuda=never_runs,
)  # fmt: skip


def checked_args(**change) -> dict:
    args = dict(x=randn((2, 3, N), BF16), r=None, w=randn(N, F32, seed=1), eps=1e-6, store=True)
    return {**args, **change}


# ============================================================================ 1. schemas

NORM_SCHEMAS = {
    "rmsnorm_fwd": "(Tensor x, Tensor? weight, float eps, bool store_rstd, float offset=0.0) "
    "-> (Tensor, Tensor)",
    "rmsnorm_bwd": "(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, bool need_dx, "
    "bool need_dw, float offset=0.0) -> (Tensor, Tensor)",
    "fused_add_rmsnorm_fwd": "(Tensor x, Tensor residual, Tensor? weight, float eps, "
    "ScalarType residual_dtype, bool store_rstd, float offset=0.0) -> (Tensor, Tensor, Tensor)",
    "fused_add_rmsnorm_bwd": "(Tensor dy, Tensor? dresidual_out, Tensor residual_out, "
    "Tensor? weight, Tensor rstd, bool need_dw, float offset=0.0, "
    "ScalarType? residual_dtype=None) -> (Tensor, Tensor, Tensor)",
    "layernorm_fwd": "(Tensor x, Tensor? weight, Tensor? bias, float eps, bool store_stats) "
    "-> (Tensor, Tensor, Tensor)",
    "layernorm_bwd": "(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, "
    "Tensor rstd, bool need_dx, bool need_dw, bool need_db) -> (Tensor, Tensor, Tensor)",
}


@pytest.mark.parametrize("name", NORM_SCHEMAS)
def test_the_norms_schemas_are_the_ones_torch_had(name):
    """A derived schema that reorders, renames, retypes or drops a default of any argument
    (compiled graphs and saved programs call the ops by it): the derived text and what torch
    registered both equal the literal schema of before."""
    op = opdef.DEFINED[f"kbuild::{name}"]
    assert op in custom_ops.NORM_OPS
    assert op.schema == NORM_SCHEMAS[name]
    registered = getattr(torch.ops.kbuild, name).default._schema
    assert registered == torch._C.parse_schema(f"kbuild::{name}{NORM_SCHEMAS[name]}")


def test_schema_defaults_of_every_kind_parse_and_reach_the_kernels():
    """A default written in a form torch's schema parser refuses (a dtype as "torch.float32")
    or that parses to another value: every kind of default declares, torch reads it back, and
    a call leaving them out gets them."""
    got = []

    def reference(x, e, flag, count, to, maybe):
        got.append((e, flag, count, to, maybe))
        return x.to(to)

    op = Op(
        fresh("defaults"),
        args=(Rows("x"), Scalar("e", "float", 1e-6), Scalar("flag", "bool", True),
              Scalar("count", "int", 3), Scalar("to", "dtype", F16),
              Scalar("maybe", "dtype", None, optional=True)),
        outputs=(Out("y", like="x", dtype="to"),),
        reference=reference,
        cuda=never_runs,
    )  # fmt: skip
    assert op.schema == (
        "(Tensor x, float e=1e-06, bool flag=True, int count=3, ScalarType to=float16, "
        "ScalarType? maybe=None) -> Tensor"
    )
    assert op.overload._schema == torch._C.parse_schema(op.name + op.schema)
    defaults = [a.default_value for a in op.overload._schema.arguments[1:]]
    assert defaults == [1e-6, True, 3, 5, None]  # a ScalarType reads back as c10's enum: 5 Half
    x = randn((2, N))
    assert op(x).dtype == F16 and op.overload(x).dtype == F16
    assert got == [(1e-6, True, 3, F16, None)] * 2
    assert fake_outputs(op, x)[0].dtype == F16


# ============================================================================ 2. checks

CHECK_ERRORS = {
    "x a float": (dict(x=1.0), TypeError, "x must be a torch.Tensor, got float"),
    "x of ints": (dict(x=torch.zeros(2, N, dtype=torch.int64)), TypeError,
                  "x must be torch.float32, torch.float16 or torch.bfloat16; got torch.int64"),
    "x a scalar": (dict(x=torch.tensor(1.0)), ValueError,
                   "x must have at least one dimension (..., N); got a scalar"),
    "r a list": (dict(r=[1.0]), TypeError, "r must be a torch.Tensor, got list"),
    "r of another shape": (dict(r=torch.zeros(2, 3, N - 1, dtype=BF16)), ValueError,
                           f"r must have the shape of x (2, 3, {N}); got (2, 3, {N - 1})"),
    "r of another dtype": (dict(r=torch.zeros(2, 3, N, dtype=F16)), TypeError,
                           "r must have the dtype of x (torch.bfloat16) or float32; got "
                           "torch.float16"),
    "r on another device": (dict(r=torch.zeros(2, 3, N, dtype=BF16, device="meta")), ValueError,
                            "r must be on x's device cpu; got meta"),
    "w a float": (dict(w=1.0), TypeError, "w must be a torch.Tensor or None, got float"),
    "w of another shape": (dict(w=torch.ones(N - 1)), ValueError,
                           f"w must have shape ({N},) to match x's last dimension; got ({N - 1},)"),
    "w a matrix": (dict(w=torch.ones(1, N)), ValueError,
                   f"w must have shape ({N},) to match x's last dimension; got (1, {N})"),
    "w of another dtype": (dict(w=torch.ones(N, dtype=F16)), TypeError,
                           "w must have x's dtype (torch.bfloat16) or torch.float32; got "
                           "torch.float16"),
    "w on another device": (dict(w=torch.ones(N, device="meta")), ValueError,
                            "w must be on x's device cpu; got meta"),
    "eps negative": (dict(eps=-1e-6), ValueError, "eps must be a finite number >= 0; got -1e-06"),
    "eps NaN": (dict(eps=math.nan), ValueError, "eps must be a finite number >= 0; got nan"),
    "eps infinite": (dict(eps=math.inf), ValueError, "eps must be a finite number >= 0; got inf"),
    "eps a bool": (dict(eps=True), TypeError, "eps must be a float, got bool"),
    "eps a string": (dict(eps="1e-6"), TypeError, "eps must be a float, got str"),
    "store an int": (dict(store=1), TypeError, "store must be a bool, got 1"),
    "store None": (dict(store=None), TypeError, "store must be a bool, got None"),
    "alpha a bool": (dict(alpha=True), TypeError, "alpha must be a float, got True"),
    "alpha NaN": (dict(alpha=math.nan), ValueError, "alpha must be a finite number; got nan"),
    "k a float": (dict(k=2.0), TypeError, "k must be an int, got 2.0"),
    "k a bool": (dict(k=False), TypeError, "k must be an int, got False"),
    "out_dtype a name": (dict(out_dtype="bf16"), TypeError,
                         "out_dtype must be a torch float dtype, got 'bf16'"),
    "out_dtype int32": (dict(out_dtype=torch.int32), TypeError,
                        "out_dtype must be a torch float dtype, got torch.int32"),
    "out_dtype a list": (dict(out_dtype=[BF16]), TypeError,
                         "out_dtype must be a torch float dtype, got [torch.bfloat16]"),
}  # fmt: skip


@pytest.mark.parametrize("case", CHECK_ERRORS)
def test_each_bad_argument_is_refused_by_name(case):
    """A check that lets a bad argument through to a kernel, or raises something other than
    TypeError/ValueError naming the argument (an unhashable dtype once raised 'unhashable
    type'; an int given for an int scalar read 'a int'): the exact message, through Op.__call__."""
    change, error, message = CHECK_ERRORS[case]
    with pytest.raises(error) as raised:
        CHECKED(**checked_args(**change))
    assert str(raised.value) == message


def test_checks_accept_what_the_kernels_take_and_normalise_it():
    """Checks that refuse a valid call: ints for floats, fp32 r and w beside 16-bit x,
    optional tensors left out; a float given as an int reaches the reference as a float."""
    seen = []
    op = Op(fresh("normalise"), args=(Rows("x"), Scalar("alpha", "float")),
            outputs=(Out("y", like="x"),), reference=lambda x, alpha: seen.append(alpha) or x * 1,
            cuda=never_runs)  # fmt: skip
    op(randn(N), 2)
    assert seen == [2.0] and type(seen[0]) is float
    x = randn((2, 3, N), BF16)
    for r, w in itertools.product((None, randn(x.shape, F32)), (None, randn(N, F32))):
        y, stat, z, r32 = CHECKED(x, r, w, eps=0, store=True, alpha=1, k=2)
        assert y.shape == x.shape and stat.shape == (6,)


def test_a_size_scalar_is_checked_as_an_int():
    """A SymInt scalar (kbuild::encoder_bwd's vocab and positions) had no check: Op.__call__
    raised KeyError('SymInt') for every call; now an int passes and anything else is refused
    by name."""
    from kbuild.kernels.llmc import op as llmc

    dout, tokens = randn((2, 3, N), F32), torch.tensor([[0, 4, 4], [1, 0, 2]])
    dwte, dwpe = llmc.ENCODER_BWD(dout, tokens, 5, 3, True, True)
    assert dwte.shape == (5, N) and dwpe.shape == (3, N)
    torch.testing.assert_close(dwte[4], dout[0, 1] + dout[0, 2], rtol=0, atol=0)
    for bad in (5.0, True, None):
        with pytest.raises(TypeError, match=f"^vocab must be an int, got {bad}$"):
            llmc.ENCODER_BWD(dout, tokens, bad, 3, True, True)


def test_misbound_calls_are_type_errors():
    """Op.__call__ binding its arguments wrongly: too many, an unknown keyword, a required
    one missing, one given twice, each a TypeError as Python's own would be."""
    x = randn((2, N))
    with pytest.raises(TypeError, match=rf"^{NS}::checked takes 8 arguments, got 9$"):
        CHECKED(x, None, None, 1e-6, True, None, 1.0, 1, "one too many")
    with pytest.raises(TypeError, match=rf"^{NS}::checked has no argument 'gamma'"):
        CHECKED(x, eps=1e-6, store=True, gamma=1.0)
    with pytest.raises(TypeError, match=rf"^{NS}::checked: missing argument 'eps'$"):
        CHECKED(x, store=True)
    with pytest.raises(TypeError, match=rf"^{NS}::checked: x given twice$"):
        CHECKED(x, x=x, eps=1e-6, store=True)
    # keywords in any order bind by name
    y1 = CHECKED(x, None, None, 0.5, True, None, 2.0)
    y2 = CHECKED(alpha=2.0, store=True, eps=0.5, x=x)
    assert all(torch.equal(a, b) for a, b in zip(y1, y2, strict=True))


WHEN = list(itertools.product((True, False), (None, F16), (None, "same", "f32")))


@pytest.mark.parametrize("store, out_dtype, r_kind", WHEN, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", (BF16, F32))
def test_fake_outputs_are_the_cpu_outputs(dtype, store, out_dtype, r_kind):
    """A fake kernel that disagrees with the real one in shape, dtype or device (tracing then
    plans for tensors the op does not return), for every `when` combination; an unwanted
    output is empty, float32 for a statistic and the op's first tensor's dtype otherwise."""
    x = randn((2, 3, N), dtype)
    r = None if r_kind is None else randn(x.shape, dtype if r_kind == "same" else F32, seed=2)
    args = (x, r, randn(N, F32, seed=1), 1e-6, store, out_dtype, 1.5, 2)
    cpu = CHECKED.overload(*args)
    fake = fake_outputs(CHECKED, *args)
    assert [meta(t) for t in fake] == [meta(t) for t in cpu]
    y, stat, z, r32 = cpu
    assert meta(y) == ((2, 3, N), dtype, x.device)
    assert meta(stat) == (((6,) if store else (0,)), F32, x.device)
    assert meta(z) == (((2, 3, N), out_dtype, x.device) if out_dtype else ((0,), dtype, x.device))
    assert meta(r32) == (((2, 3, N), F32, x.device) if r is not None else ((0,), dtype, x.device))
    assert all(t.is_contiguous() for t in cpu)


@pytest.mark.parametrize("store_ms", (True, False))
def test_opcheck_passes_on_the_declared_ops(store_ms):
    """torch.library.opcheck: the derived schema (no aliasing), fake kernel, autograd
    registration and AOT dispatch of an op with a backward, and of one without."""
    x, w = randn((2, 3, N), BF16).requires_grad_(), randn(N, F32, seed=1).requires_grad_()
    torch.library.opcheck(MUL.overload, (x, w, ALPHA, store_ms))
    torch.library.opcheck(CHECKED.overload, (x.detach(), None, w.detach(), 1e-6, store_ms))


def test_a_reference_returning_its_input_does_not_alias_it():
    """A CPU kernel returning a reference's output that is its input (x.float() of fp32 x,
    x.to(x.dtype)): the schema says no output aliases an input, so an in-place update of one
    changed the other, and opcheck failed 'Argument x is not defined to alias output'."""
    op = Op(fresh("identity"), args=(Rows("x"), Rows("u")),
            outputs=(Out("y", like="x"), Out("v", like="u"), Out("w", like="u")),
            reference=lambda x, u: (x.float(), u.contiguous(), u.to(u.dtype)),
            cuda=never_runs)  # fmt: skip
    x, u = randn((3, N)), randn((3, N), seed=1)
    y, v, w = op(x, u)
    storages = {t.untyped_storage().data_ptr() for t in (x, u, y, v, w)}
    assert len(storages) == 5
    assert torch.equal(y, x) and torch.equal(v, u) and torch.equal(w, u)
    torch.library.opcheck(op.overload, (x, u))


# ============================================================================ 3. declarations


ROWS_ARGS = (Arg("x"), Arg("y"), Arg("M", "i64"))


def _kernel_with(*params: Param, args=ROWS_ARGS) -> KernelDef:
    """A kernel of N, dtype and `params` taking x, y, M (or `args`)."""
    return kernel(f"decl_{next(_unique)}", (Param("N", "int"), Param("dtype", "dtype"), *params),
                  args)  # fmt: skip


def _rows_op(name: str, launch: Launch, *more) -> Op:
    return Op(name, args=(Rows("x"), *more), outputs=(Out("y", like="x"),), launch=launch,
              reference=lambda x, *rest: x * 1)  # fmt: skip


def _backward(name: str, args, outputs) -> Op:
    return Op(name, args=args, outputs=outputs, reference=never_runs, cuda=never_runs)


def _forward(name: str, backward: Op) -> Op:
    return Op(name, args=(Rows("x"), Feature("w")), outputs=(Out("y", like="x"),),
              reference=never_runs, cuda=never_runs, backward=backward)  # fmt: skip


DECLARATION_ERRORS = {
    "a kernel parameter with no source": (
        lambda n: _rows_op(n, Launch(_kernel_with(Param("gamma", "float")))),
        "kernel kbuild_test_opdef_decl_\\d+'s parameter 'gamma' has no source",
    ),
    "a kernel argument with no source": (
        lambda n: _rows_op(n, Launch(_kernel_with(args=(Arg("x"), Arg("q"), Arg("M", "i64"))))),
        "argument 'q' is none of the op's tensors \\['x', 'y'\\], M or the launch's ints",
    ),
    "a launch without rows": (
        lambda n: Op(n, args=(Tensors("t"),), outputs=(Out("y", like="t"),),
                     launch=Launch(_kernel_with()), reference=never_runs),
        "a Launch needs a Rows argument",
    ),
    "a scalar and a tensor's dtype for one parameter": (
        lambda n: _rows_op(n, Launch(_kernel_with(Param("x_dtype", "dtype?"))),
                           Scalar("x_dtype", "dtype")),
        "parameter 'x_dtype' is derived from the call and is also the op's scalar x_dtype",
    ),
    "a backward argument with no source": (
        lambda n: _forward(n, _backward(n + "_bwd", (Rows("dq"),), (Out("dx", like="dq"),))),
        "argument 'dq' is none of .*'s tensors, scalars, d<output> or need_d<input>",
    ),
    "a backward output that is no input's gradient": (
        lambda n: _forward(n, _backward(n + "_bwd", (Rows("dy"),), (Out("dq", like="dy"),))),
        "output 'dq' is the gradient of none of .*'s tensors \\('x', 'w'\\)",
    ),
    "a backward output not named d<input>": (
        lambda n: _forward(n, _backward(n + "_bwd", (Rows("dy"),), (Out("gx", like="dy"),))),
        "output 'gx' is the gradient of none of",
    ),
    "two backward outputs for one input": (
        lambda n: _forward(n, _backward(n + "_bwd", (Rows("dy"),), (
            Out("dx", like="dy"), Out("dx2", like="dy", grad_of="x")))),
        "outputs 'dx' and 'dx2' are both the gradient of x",
    ),
    "a Like of an unknown tensor": (
        lambda n: Op(n, args=(Rows("x"), Like("r", "q")), outputs=(Out("y", like="x"),),
                     reference=never_runs, cuda=never_runs),
        "r is checked against q, which is not a tensor argument before it",
    ),
    "a Like of a later tensor": (
        lambda n: Op(n, args=(Like("r", "x"), Rows("x")), outputs=(Out("y", like="x"),),
                     reference=never_runs, cuda=never_runs),
        "r is checked against x, which is not a tensor argument before it",
    ),
    "a Feature of an optional tensor": (
        lambda n: Op(n, args=(Rows("x"), Rows("u", optional=True), Feature("w", of="u")),
                     outputs=(Out("y", like="x"),), reference=never_runs, cuda=never_runs),
        "w is checked against u, which is optional",
    ),
    "an output like an unknown tensor": (
        lambda n: Op(n, args=(Rows("x"),), outputs=(Out("y", like="q"),), reference=never_runs,
                     cuda=never_runs),
        "output y: like='q' is not a tensor argument",
    ),
    "an output like an optional tensor, wanted without it": (
        lambda n: Op(n, args=(Rows("x"), Feature("w")), outputs=(Out("dw", like="w"),),
                     reference=never_runs, cuda=never_runs),
        "output dw is like w, which is optional: add 'w' to its when=",
    ),
    "an output of an unknown dtype": (
        lambda n: Op(n, args=(Rows("x"),), outputs=(Out("y", like="x", dtype="to"),),
                     reference=never_runs, cuda=never_runs),
        "output y: dtype='to' is neither 'float32' nor a dtype scalar",
    ),
    "an output wanted when an unknown name": (
        lambda n: Op(n, args=(Rows("x"),), outputs=(Out("y", like="x", when="store"),),
                     reference=never_runs, cuda=never_runs),
        "output y: when='store' is not a bool or dtype scalar or a tensor argument",
    ),
    "a required argument after a defaulted one": (
        lambda n: Op(n, args=(Rows("x"), Scalar("alpha", "float", 1.0), Scalar("flag", "bool")),
                     outputs=(Out("y", like="x"),), reference=never_runs, cuda=never_runs),
        "flag has no default but follows alpha, which has one",
    ),
    "no CUDA kernel": (
        lambda n: Op(n, args=(Rows("x"),), outputs=(Out("y", like="x"),), reference=never_runs),
        "give launch= or cuda=",
    ),
    "both CUDA kernels": (
        lambda n: Op(n, args=(Rows("x"),), outputs=(Out("y", like="x"),), reference=never_runs,
                     cuda=never_runs, launch=Launch(_kernel_with())),
        "give launch= or cuda=, not both",
    ),
    "both autograd forms": (
        lambda n: Op(n, args=(Rows("x"),), outputs=(Out("y", like="x"),), reference=never_runs,
                     cuda=never_runs, autograd=(never_runs, never_runs),
                     backward=_backward(n + "_bwd", (Rows("dy"),), (Out("dx", like="dy"),))),
        "give backward= \\(by names\\) or autograd=, not both",
    ),
    "a name without a namespace": (
        lambda n: Op(n.replace("::", "_"), args=(Rows("x"),), outputs=(Out("y", like="x"),),
                     reference=never_runs, cuda=never_runs),
        "op name must be 'namespace::name'",
    ),
    "two arguments of one name": (
        lambda n: Op(n, args=(Rows("x"), Rows("x")), outputs=(Out("y", like="x"),),
                     reference=never_runs, cuda=never_runs),
        "argument names must be unique",
    ),
    "a name declared already": (
        lambda n: Op(MUL.name, args=(Rows("x"),), outputs=(Out("y", like="x"),),
                     reference=never_runs, cuda=never_runs),
        f"{NS}::mul is declared already \\(as {re.escape(MUL.schema)}\\)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", DECLARATION_ERRORS)
def test_a_bad_declaration_is_refused_before_anything_is_registered(case):
    """A declaration whose launch, backward or outputs cannot be bound by names (it would
    fail at the first call, or silently route a gradient or a dtype to the wrong place): a
    ValueError naming what is missing, raised before torch defines the op, so the name stays
    free for the corrected declaration (a declaration without a CUDA kernel once took it)."""
    declare, message = DECLARATION_ERRORS[case]
    name = fresh("declared")
    with pytest.raises(ValueError, match=message):
        declare(name)
    assert name not in opdef.DEFINED
    assert not hasattr(getattr(torch.ops, NS), name.split("::")[1])  # torch has no such op
    fixed = Op(name, args=(Rows("x"),), outputs=(Out("y", like="x"),), reference=lambda x: x * 1,
               cuda=never_runs)  # fmt: skip
    assert opdef.DEFINED[name] is fixed


def test_a_parameter_with_a_default_needs_no_source_and_values_override():
    """The launch's table values: a parameter with a default takes it, Launch(values=) wins
    over what the call would give; kernel_values names them in table order."""
    k = _kernel_with(Param("beta", "float", 0.5), VECTORIZE)
    op = _rows_op(
        fresh("defaulted"), Launch(k, values={"N": lambda bound: 2 * bound["x"].shape[-1]})
    )
    x = randn((3, N), F16)
    assert op.kernel_values(x) == [(k, (2 * N, "f16", 0.5, True))]
    assert op.kernel_values(x, aligned=False) == [(k, (2 * N, "f16", 0.5, False))]


# ============================================================================ 4. autograd


def _mul_truth(x, w, gy, gms):
    """fp64 autograd of y = alpha * x * w, ms = mean(x^2): (y, ms, dx, dw)."""
    xd = x.detach().double().requires_grad_()
    wd = None if w is None else w.detach().double().requires_grad_()
    y = ALPHA * xd * (1.0 if wd is None else wd)
    ms = xd.square().mean(-1).reshape(-1)
    loss = (y * gy.double()).sum() + (ms * gms.double()).sum()
    grads = torch.autograd.grad(loss, [t for t in (xd, wd) if t is not None])
    return y.detach(), ms.detach(), grads[0], (grads[1] if wd is not None else None)


@pytest.mark.parametrize(
    "x_grad, w_grad", [(True, False), (False, True), (True, True), (True, None)]
)
@pytest.mark.parametrize("dtype", DTYPES)
@AUTOGRAD_ROUTES
def test_gradients_go_by_name_to_the_inputs_that_want_them(mul, dtype, x_grad, w_grad):
    """The derived autograd: need_dx / need_dw reach the backward op as the inputs' own
    requires_grad (a flag taken from the wrong input, or always True, computes a gradient no
    one wants, or none that is wanted); a gradient handed to the wrong output's d<output>
    (dy and dms are distinct here) or to the wrong input fails the values; an input that
    wants no gradient gets None from the formula."""
    x = randn((2, 3, N), dtype, seed=3).requires_grad_(x_grad)
    w = None if w_grad is None else randn(N, F32, seed=4, offset=0.5).requires_grad_(w_grad)
    y, ms = mul(x, w, ALPHA, True)
    gy, gms = randn(y.shape, dtype, seed=6), randn(ms.shape, F32, seed=7)
    wanted = [t for t in (x, w) if t is not None and t.requires_grad]
    BACKWARD_FLAGS.clear()
    grads = torch.autograd.grad((y, ms), wanted, (gy, gms), retain_graph=True)
    assert BACKWARD_FLAGS == [(x_grad, bool(w_grad))]
    y_ref, ms_ref, dx_ref, dw_ref = _mul_truth(x, w, gy, gms)
    assert_forward(y, y_ref, x, "y")
    assert_close_rel(ms, ms_ref, GRAD_TOL[F32], "ms")
    by_input = dict(zip([id(t) for t in wanted], grads, strict=True))
    if x_grad:
        assert_close_rel(by_input[id(x)], dx_ref, GRAD_TOL[dtype], "dx")
        assert by_input[id(x)].dtype == dtype
    if w_grad:
        assert_close_rel(by_input[id(w)], dw_ref, GRAD_TOL[F32], "dw")
    with torch.no_grad():
        dx, dw = _formula(y.grad_fn, gy, gms)[:2]  # what the formula returns, input by input
    assert (dx is None) == (not x_grad) and (dw is None) == (not w_grad)


def test_an_input_that_wants_no_gradient_gets_none_even_if_computed():
    """The derived formula returns None for an input that wants no gradient even where the
    backward op computes one regardless (no `when` on its outputs): the formula's own filter,
    not the backward op's flags, decides what reaches autograd."""
    both = Op(fresh("add_backward"), args=(Rows("dy"),),
              outputs=(Out("dx", like="dy"), Out("du", like="dy")),
              reference=lambda dy: (dy * 1, dy * 2), cuda=never_runs)  # fmt: skip
    add = Op(fresh("add"), args=(Rows("x"), Rows("u")), outputs=(Out("y", like="x"),),
             reference=lambda x, u: x + 2 * u, cuda=never_runs, backward=both)  # fmt: skip
    x, u = randn((3, N), seed=1), randn((3, N), seed=2).requires_grad_()
    y = add(x, u)
    gy = randn(y.shape, seed=3)
    with torch.no_grad():
        dx, du = _formula(y.grad_fn, gy)[:2]
    assert dx is None and torch.equal(du, 2 * gy)


def test_an_unused_statistic_gets_no_gradient_term():
    """The gradient of an output left empty (ms not stored): its d<output> is empty and the
    backward adds no term for it (dx = alpha * dy * w exactly)."""
    x = randn((4, N), F32, seed=3).requires_grad_()
    w = randn(N, F32, seed=4)
    y, ms = MUL(x, w, ALPHA)
    assert ms.shape == (0,)
    gy = randn(y.shape, seed=6)
    (dx,) = torch.autograd.grad(y, x, gy)
    torch.testing.assert_close(dx, ALPHA * gy * w, rtol=0, atol=0)


@pytest.fixture(scope="module")
def softmax_example():
    """The example, its kernels dropped from the registry again at once (tests/examples.py)."""
    return import_example(keep_kernels=False)


# Rows of spread-out logits (some y near 1) and upstream gradients of nonzero mean: sum(y * dy)
# is far from 0, so the term a wrong formula drops is as large as the gradient.
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_gradient_is_the_fp64_one(softmax_example, dtype):
    """The softmax example's derived autograd (dy the gradient of y, y saved, dx that of x)
    against fp64 torch.softmax's, at the project's per-dtype gradient tolerance, which the two
    likely wrong formulas fail: y * dy (the - sum(y * dy) term missing) and dy * (y - sum)
    (the backward handed y and dy the wrong way round)."""
    x = randn((4, 3, 64), dtype, seed=8, scale=3.0).requires_grad_()
    dy = randn(x.shape, dtype, seed=9, offset=1.0)
    y = softmax_example.softmax(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    xd = x.detach().double().requires_grad_()
    yd = torch.softmax(xd, -1)
    (dx_ref,) = torch.autograd.grad(yd, xd, dy.double())
    assert_forward(y, yd, x, "y")
    assert dx.dtype == dtype
    assert_close_rel(dx, dx_ref, GRAD_TOL[dtype], "dx")
    yd, dyd = yd.detach(), dy.double()
    weighted = (yd * dyd).sum(-1, keepdim=True)
    for wrong in (yd * dyd, dyd * (yd - weighted)):
        with pytest.raises(AssertionError):
            assert_close_rel(wrong.to(dtype), dx_ref, GRAD_TOL[dtype], "a wrong formula")


# ============================================================================ 5. CUDA launches


def _mul_args(dtype=BF16, shape=(2, 3, N), w_dtype=F32, store_ms=True):
    x = randn(shape, dtype, seed=3)
    w = None if w_dtype is None else randn(shape[-1], w_dtype, seed=4, offset=0.5)
    return x, w, ALPHA, store_ms


@pytest.mark.parametrize("w_dtype", (F32, BF16, None))
@pytest.mark.parametrize("store_ms", (True, False))
def test_a_launch_binds_values_and_pointers_by_the_tables_names(device, w_dtype, store_ms):
    """The forward launch: values in table order (N, dtype, w_dtype: None without w, the
    scalars by name, vectorize), pointers of x, [w], y, [ms] in table order then M and the
    launch's ints, the fake stream, one guard for x's device; the kernel's stand-in,
    reading those addresses, computes the CPU reference bit for bit (a pointer of the wrong
    tensor would not)."""
    args = x, w, _, _ = _mul_args(w_dtype=w_dtype, store_ms=store_ms)
    y, ms = MUL._launch_cuda(*args)
    (launch,) = device.launches
    w_name = None if w is None else {F32: "f32", BF16: "bf16"}[w.dtype]
    assert launch.values == (N, "bf16", w_name, ALPHA, store_ms, True)
    pointers = [x.data_ptr()] + ([w.data_ptr()] if w is not None else []) + [y.data_ptr()]
    pointers += [ms.data_ptr()] if store_ms else []
    assert launch.args == (*pointers, 6, N)
    assert launch.stream == STREAM and device.guarded == [x.device]
    assert launch.kernel == MUL_FWD_KERNEL.name
    cpu = MUL.overload(*args)
    assert torch.equal(y, cpu[0]) and meta(ms) == meta(cpu[1])
    assert torch.equal(ms, cpu[1])


def test_the_backward_launch_binds_need_flags_and_computed_values(device):
    """The backward launch: need_dx / need_dw are table values that drop dx / dw from the
    arguments, need_dw is off without w (the table's needs=), with_dms comes from
    Launch(values=) and drops dms when it is empty; every case computes the CPU reference."""
    dy, x, w = randn((5, N), F16, seed=1), randn((5, N), F16, seed=2), randn(N, F32, seed=3)
    dms = randn(5, F32, seed=4)
    for given_dms, w_, need_dx, need_dw in itertools.product(
        (dms, dms[:0]), (w, None), (True, False), (True, False)
    ):
        device.launches.clear()
        args = (dy, given_dms, x, w_, ALPHA, need_dx, need_dw)
        dx, dw = MUL_BWD._launch_cuda(*args)
        (launch,) = device.launches
        has_dw = need_dw and w_ is not None
        w_name = None if w_ is None else "f32"
        with_dms = given_dms.numel() > 0
        assert launch.values == (N, "f16", w_name, ALPHA, with_dms, need_dx, need_dw, True)
        assert launch.spec.kwargs["need_dw"] == has_dw
        expected = [dy] + [given_dms] * with_dms + [x] + ([w_] if w_ is not None else [])
        expected += [dx] * need_dx + [dw] * has_dw
        assert launch.args == (*(t.data_ptr() for t in expected), 5)
        cpu = MUL_BWD.overload(*args)
        assert all(torch.equal(a, b) for a, b in zip((dx, dw), cpu, strict=True)), args[1:]


@pytest.mark.parametrize(
    "where", ["x", "w", "none"], ids=["x misaligned", "w misaligned", "all aligned"]
)
def test_vectorize_is_whether_every_pointer_is_16_byte_aligned(device, where):
    """128-bit accesses at an address that is not 16-byte aligned fault on the GPU: a tensor
    viewed one element into its storage (x or w) makes vectorize False, aligned ones True."""
    x, w, alpha, store = _mul_args(dtype=F32, shape=(4, N))
    x = misaligned(x.shape, F32) if where == "x" else x
    w = misaligned(w.shape, F32) if where == "w" else w
    assert (x.data_ptr() | w.data_ptr()) & 15 != 0 or where == "none"
    y, ms = MUL._launch_cuda(x, w, alpha, store)
    (launch,) = device.launches
    assert launch.values[-1] is (where == "none")
    assert launch.args[:2] == (x.data_ptr(), w.data_ptr())  # read in place: dense already
    assert torch.equal(y, MUL.overload(x, w, alpha, store)[0])


@pytest.mark.parametrize(
    "M, grid, persistent",
    [(5, 3 * 2, False), (1, 1 * 2, False), (4, 2 * 2, False), (5, 2 * 2, True), (1, 1 * 2, True)],
)
def test_the_grid_is_one_cluster_per_row_group_or_the_persistent_one(device, M, grid, persistent):
    """grid = ceil(M / rows_per_block) * cluster blocks (2 rows a block, clusters of 2): a
    grid one short leaves rows unwritten, one long reads past x; the persistent form (meta
    grid "persistent") is capped at the resident clusters (2), and never more than the row
    groups."""
    device.meta = {"grid": "persistent"} if persistent else {}
    MUL._launch_cuda(*_mul_args(shape=(M, N)))
    assert [launch.grid for launch in device.launches] == [grid]


@pytest.mark.parametrize("shape", [(0, N), (2, 0, N), (3, 0), (0, 0)])
def test_no_rows_or_no_columns_launch_nothing(device, shape):
    """A grid of no blocks is a driver error: M == 0 or N == 0 launches nothing; the outputs
    are still the CPU kernel's in shape, row statistics of empty rows NaN."""
    x, w, alpha, store = _mul_args(shape=shape)
    y, ms = MUL._launch_cuda(x, w, alpha, store)
    assert device.launches == []
    cpu_y, cpu_ms = MUL.overload(x, w, alpha, store)
    assert meta(y) == meta(cpu_y) and meta(ms) == meta(cpu_ms)
    assert torch.equal(ms.isnan(), cpu_ms.isnan()) and bool(ms.isnan().all())


def test_no_rows_give_zero_parameter_gradients(device):
    """dw over no rows: nothing launches, yet dw has N elements; they must be the CPU
    kernel's zeros (a sum over no rows), not whatever the allocator handed out (here NaN:
    deterministic mode fills uninitialised memory)."""
    dy, x, w = randn((0, N), BF16), randn((0, N), BF16), randn(N, F32)
    torch.use_deterministic_algorithms(True)
    try:
        dx, dw = MUL_BWD._launch_cuda(dy, dy.new_empty(0, dtype=F32), x, w, ALPHA, True, True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert device.launches == []
    cpu_dx, cpu_dw = MUL_BWD.overload(dy, dy.new_empty(0, dtype=F32), x, w, ALPHA, True, True)
    assert meta(dx) == meta(cpu_dx) and torch.equal(dw, cpu_dw) and torch.equal(dw, torch.zeros(N))


def test_strided_inputs_are_passed_as_dense_copies(device):
    """The kernels read dense rows: a transposed x and a w taken every other element are
    passed as contiguous copies (their own pointers), which the stand-in reads as dense
    memory to the CPU reference's values; passed in place they would read other elements."""
    x = randn((N, 5), BF16, seed=3).t()
    w = randn(2 * N, F32, seed=4)[::2]
    assert not x.is_contiguous() and not w.is_contiguous()
    y, ms = MUL._launch_cuda(x, w, ALPHA, True)
    (launch,) = device.launches
    assert x.data_ptr() not in launch.args and w.data_ptr() not in launch.args
    assert y.is_contiguous() and torch.equal(y, MUL.overload(x, w, ALPHA, True)[0])


def test_the_cuda_kernel_runs_the_ops_own_check(device):
    """An op's `check=` (a rule across arguments) guards its CPU and fake kernels; the launch
    path skipped it, so torch.ops called directly on CUDA launched with arguments the kernel
    cannot take."""

    def same_dtype(bound):
        if bound["w"] is not None and bound["w"].dtype != bound["x"].dtype:
            raise TypeError("w must have x's dtype here")

    op = Op(fresh("checked_launch"), args=(Rows("x"), Feature("w")), outputs=(Out("y", like="x"),),
            launch=Launch(_kernel_with(Param("w_dtype", "dtype?"))), reference=never_runs,
            check=same_dtype)  # fmt: skip
    x, w = randn((2, N), BF16), randn(N, F32)
    for kernel_of in (op._launch_cuda, op._fake, op._cpu):
        with pytest.raises(TypeError, match="w must have x's dtype here"):
            kernel_of(x, w)
    assert device.launches == []


def test_a_feature_of_dy_is_checked_against_dy():
    """kbuild::fused_add_rmsnorm_bwd has no x: its weight, checked against "x", raised
    KeyError('x') from Op.__call__ instead of checking; now it is checked against dy, and the
    message names dy."""
    dy, res = randn((2, N), BF16), randn((2, N), BF16, seed=1)
    rstd = torch.ones(2)
    with pytest.raises(ValueError, match=rf"^weight must have shape \({N},\) to match dy's last"):
        custom_ops.FUSED_ADD_RMSNORM_BWD(dy, None, res, torch.ones(N - 1), rstd, True)
    dsum, dres, dw = custom_ops.FUSED_ADD_RMSNORM_BWD(dy, None, res, torch.ones(N), rstd, True)
    assert dsum.shape == dy.shape and dres.shape == (0,) and dw.shape == (N,)


@pytest.mark.parametrize("width, dtype", [(4096, "bf16"), (1000, "f32"), (4095, "bf16")])
def test_warm_specs_are_the_specs_the_launches_ask_for(device, softmax_example, width, dtype):
    """`kbuild warmup --ops` compiles Op.warm_specs: a spec that differs from what a call
    asks for (forward and backward) is a cache miss on the offline GPU machine. Aligned
    tensors ask for the 16-byte kernels, odd widths too (peeled rows); a misaligned view
    (x starting one element into its storage) asks for the scalar ones, warmed as well."""
    softmax = softmax_example.softmax
    warmed = softmax.warm_specs(width, dtype)
    assert warmed == softmax.warm_specs(width, TORCH[dtype])
    x = randn((4, width), TORCH[dtype], seed=1)
    view = randn((4 * width + 1,), TORCH[dtype], seed=3)[1:].view(4, width)
    for rows in (x, view):
        device.launches.clear()
        y = softmax._launch_cuda(rows)
        softmax.backward._launch_cuda(y, randn(y.shape, TORCH[dtype], seed=2))
        asked = [launch.spec for launch in device.launches]
        assert [s.kernel for s in asked] == ["user_softmax_fwd", "user_softmax_bwd"]
        # the view's forward takes the scalar kernel; its backward's tensors are new, aligned
        assert [s.kwargs["vectorize"] for s in asked] == [rows is x, True], asked
        assert set(asked) <= set(warmed), (asked, warmed)
        assert [launch.args[-1] for launch in device.launches] == [4, 4]
    assert len(warmed) == 4


def test_warm_specs_refuse_an_unknown_dtype_by_name(softmax_example):
    """A dtype name warm_specs does not know raised KeyError (the CLI's --ops catches only
    TypeError and ValueError, so it printed a traceback)."""
    with pytest.raises(ValueError, match="dtype must be a torch float dtype or one of"):
        softmax_example.softmax.warm_specs(4096, "float16")


_TWICE = """
import sys
import torch
import kbuild
from kbuild import Arg, Launch, Op, Out, Param, Rows


@kbuild.kernel("twice_scale", params=(Param("N", "int"), Param("dtype", "dtype")),
               args=(Arg("x"), Arg("y"), Arg("M", "i64")))
def build_scale(N, dtype, target):
    raise NotImplementedError


def reference(x):
    return x * 2


scale = Op("twice::scale", args=(Rows("x"),), outputs=(Out("y", like="x"),),
           launch=Launch(build_scale), reference=reference)

if __name__ == "__main__":
    import twice  # what `kbuild warmup --module twice.py` (import_user_module) does here

    x = torch.ones(2, 4)
    assert torch.equal(twice.scale(x), scale(x) ) and twice.scale is not scale
    try:
        Op("twice::scale", args=(Rows("x"),), outputs=(Out("y", like="x"),),
           launch=Launch(build_scale), reference=lambda x: x * 3)
    except ValueError as err:
        print("refused:", err)
"""


def test_a_script_declaring_an_op_imports_itself_by_name(tmp_path, subprocess_env):
    """A script run as __main__ and then imported by its name (its own main, or `kbuild
    warmup --module` in the same process) declares its ops twice: the second, the same
    declaration, must use the operator registered by the first (its kernels are taken back
    alike, registry.py register), not raise "declared already"; another declaration
    under a taken name is still refused."""
    import subprocess

    (tmp_path / "twice.py").write_text(_TWICE)
    run = subprocess.run(
        [sys.executable, str(tmp_path / "twice.py")],
        env=subprocess_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused: twice::scale is declared already" in run.stdout


NEEDS_NATIVE = pytest.mark.skipif(
    native.load(force=True) is None,  # (loaded on a CPU too; MUL, declared before, upgraded)
    reason="the C++ extension is unavailable (its autograd kernel)",
)


@NEEDS_NATIVE
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cpp_autograd_is_the_python_formula(dtype):
    """Where the extension loads, the derived formula runs as the C++ generic autograd kernel
    (no Python per call): its gradients are the Python formula's bit for bit (both call the
    same backward op), its node is the C++ one, and an unused output's gradient is zeros
    as torch.library materializes it (a missing zeros would hand the backward None)."""
    assert MUL.native_autograd and not MUL_PY.native_autograd
    x = randn((2, 3, N), dtype, seed=3).requires_grad_()
    w = randn(N, F32, seed=4, offset=0.5).requires_grad_()
    gy = randn((2, 3, N), dtype, seed=6)
    got = {}
    for op in (MUL, MUL_PY):
        y, ms = op(x, w, ALPHA, True)
        got[op.name] = torch.autograd.grad(y, [x, w], gy)  # ms unused: its gradient is zeros
        assert ("CppFunction" in type(y.grad_fn).__name__) == (op is MUL)
    for a, b in zip(*got.values(), strict=True):
        assert torch.equal(a, b)


@AUTOGRAD_ROUTES
def test_an_input_changed_in_place_after_the_forward_fails_the_backward(mul):
    """A saved input modified in place before the backward would give a wrong gradient: both
    routes refuse it (the saved tensor's version counter)."""
    x = randn((3, N), F32, seed=1).requires_grad_()
    w = randn(N, F32, seed=2)
    h = x * 1  # a non-leaf the op saves
    y, _ = mul(h, w, ALPHA, True)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y.sum(), x)


@AUTOGRAD_ROUTES
def test_dynamic_compile_traces_the_backward_once_for_every_row_count(mul):
    """torch.compile(dynamic=True) of a forward + backward: the zeros materialized for an
    unused output's gradient take the output's symbolic sizes (concrete sizes() would
    specialise the row count: one recompile per shape), so one graph serves every M."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, dynamic=True, fullgraph=True)
    def loss(x, w):
        y, _ = mul.overload(x, w, ALPHA, True)  # ms unused: its gradient is zeros
        return y.sin().sum()

    try:
        compiled = []  # frames compiled so far, after each call
        for M in (3, 5, 7):
            x = randn((M, N), F32, seed=M).requires_grad_()
            w = randn(N, F32, seed=4)
            (dx,) = torch.autograd.grad(loss(x, w), x)
            expected = ALPHA * torch.cos(ALPHA * x.detach() * w) * w
            torch.testing.assert_close(dx, expected)
            compiled.append(counter.frame_count)
        assert compiled[1:] == compiled[:1] * 2, compiled
    finally:
        torch._dynamo.reset()


@NEEDS_NATIVE
def test_forward_mode_ad_is_refused_not_silently_zero():
    """The C++ autograd kernel has no forward-mode formula: a dual input (forward_ad,
    torch.func.jvp) is refused, as torch's own kernels without one refuse it, instead of an
    output whose tangent is silently missing (zeros)."""
    import torch.autograd.forward_ad as fwAD

    x, w = randn((3, N), F32, seed=1), randn(N, F32, seed=2)
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward AD"):
        MUL(fwAD.make_dual(x, torch.ones_like(x)), w, ALPHA, True)
    with pytest.raises(NotImplementedError, match="forward AD"):
        torch.func.jvp(lambda x: MUL(x, w, ALPHA, True)[0], (x,), (torch.ones_like(x),))


def test_warm_specs_cover_the_backwards_need_flags():
    """A backward's need flags have no default: warm_specs compiles the kernel for each
    combination a training step can ask for (it once refused to warm such an op at all)."""
    specs = [s for s in MUL.warm_specs(64, "f16") if s.kwargs["vectorize"]]  # aligned tensors
    bwd = [s for s in specs if s.kernel == MUL_BWD_KERNEL.name]
    flags = sorted((s.kwargs["need_dx"], s.kwargs["need_dw"]) for s in bwd)
    assert flags == [(False, False), (False, True), (True, False), (True, True)]
    assert all(s.kwargs["alpha"] == 1.0 for s in bwd)  # the forward's default, forwarded
    assert [s.kernel for s in specs if s not in bwd] == [MUL_FWD_KERNEL.name]
