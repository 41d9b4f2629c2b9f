"""Declarations checked when made (kbuild.Op, kbuild.kernel / KernelDef / Param / Arg,
Launch, kbuild.launch), and a reference held to its declared outputs when called.

Each refused declaration used to be accepted and to fail later, far from the mistake (the
first call: "'NoneType' object is not callable", "'KernelDef' object is not iterable"), or
never: an unknown Param kind is a KeyError at the first spec, a name declared twice binds
one tensor for another, int32 ids bound to no "index" parameter are read as int64, a
reference of another shape or dtype than its Out is returned to CPU callers as is (and a
graph traced on the fake, which follows the declaration, reads it as the declared one).
Each test names what it refuses and the message the user sees: the op's qualified name (or
the kernel's), the argument, what was expected.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kbuild
from kbuild import registry as table
from kbuild.op import opdef
from kbuild.op.opdef import Ids, Launch, Op, Out, Rows, Scalar, Tensors
from kbuild.registry import ARG_KINDS, Arg, KernelDef, Param

NS = "kbuild_test_decl"
_unique = itertools.count()


def fresh(tag: str) -> str:
    """An op name no other test declared (a name is defined once per process)."""
    return f"{NS}::{tag}_{next(_unique)}"


def never_runs(*args):
    raise AssertionError("a kernel these tests never run ran")


ROW_ARGS = (Arg("x"), Arg("y"), Arg("M", "i64"))


def kernel(params=(), args=ROW_ARGS) -> KernelDef:
    """A row kernel's table entry (never built, never registered): N, dtype, `params`."""
    name = f"{NS}_k{next(_unique)}"
    return KernelDef(name, "tests.nowhere:build", (Param("N", "int"), Param("dtype", "dtype"),
                                                   *params), tuple(args))  # fmt: skip


def rows_op(name: str, **given) -> Op:
    """Rows x -> Out y like x, with the declaration's other parts from `given`."""
    declared = dict(args=(Rows("x"),), outputs=(Out("y", like="x"),), reference=lambda x: x * 2,
                    cuda=never_runs)  # fmt: skip
    declared.update(given)
    return Op(name, **declared)


def ids_op(name: str, k: KernelDef, **launch) -> Op:
    """Rows logits and their per-row Ids targets -> a statistic, launched by `k`."""
    return Op(name, args=(Rows("logits"), Ids("targets", rows_of="logits")),
              outputs=(Out("loss", rows="logits"),), launch=Launch(k, **launch),
              reference=never_runs)  # fmt: skip


ROW_KERNEL = kernel()
IDS_ARGS = (Arg("logits"), Arg("targets"), Arg("loss"), Arg("M", "i64"))

# case -> (declare(name), error type, message (a regex))
OP_ERRORS = {
    "reference=None": (
        lambda n: rows_op(n, reference=None), TypeError,
        r"{name}: reference= must be a function \(the CPU kernel, called with the op's "
        r"arguments in order\), got None",
    ),
    "reference=42": (
        lambda n: rows_op(n, reference=42), TypeError,
        r"{name}: reference= must be a function .*, got 42",
    ),
    "a reference not taking the op's arguments": (
        lambda n: rows_op(n, args=(Rows("x"), Scalar("alpha", "float")), reference=lambda x: x),
        TypeError,
        r"{name}: reference= must take the op's 2 arguments \(x, alpha\) in order; it takes "
        r"\(x\)",
    ),
    "cuda= not a function": (
        lambda n: rows_op(n, cuda="fast"), TypeError,
        r"{name}: cuda= must be a function \(the CUDA kernel, .*\), got 'fast'",
    ),
    "check= not a function": (
        lambda n: rows_op(n, check=True), TypeError,
        r"{name}: check= must be a function \(called with the arguments by name\), got True",
    ),
    "autograd= not two functions": (
        lambda n: rows_op(n, autograd=(never_runs,)), TypeError,
        r"{name}: autograd= must be \(setup_context, backward\), two functions",
    ),
    "backward= not an Op": (
        lambda n: rows_op(n, backward=never_runs), TypeError,
        r"{name}: backward= must be an Op .*; a hand-written formula is autograd=",
    ),
    "launch= a KernelDef": (
        lambda n: rows_op(n, cuda=None, launch=ROW_KERNEL), TypeError,
        r"{name}: launch= takes Launch\(...\), got the kernel kbuild_test_decl_k\d+: wrap the "
        r"kernel in Launch\(...\)",
    ),
    "launch= a KernelDef among Launches": (
        lambda n: rows_op(n, cuda=None, launch=[Launch(ROW_KERNEL), ROW_KERNEL]), TypeError,
        r"{name}: .*wrap the kernel in Launch\(...\)",
    ),
    "launch= a kernel's name": (
        lambda n: rows_op(n, cuda=None, launch="rmsnorm_fwd"), TypeError,
        r"{name}: launch= must be a Launch or a sequence of them, got 'rmsnorm_fwd'",
    ),
    "two arguments of one name": (
        lambda n: rows_op(n, args=(Rows("x"), Tensors("w"), Tensors("w"))), ValueError,
        r"{name}: argument names must be unique; 'w' declared twice",
    ),
    "two outputs of one name": (
        lambda n: rows_op(n, outputs=(Out("y", like="x"), Out("y", rows="x"))), ValueError,
        r"{name}: output names must be unique; 'y' declared twice",
    ),
    "an output named as an argument": (
        lambda n: rows_op(n, args=(Rows("x"), Rows("y")), outputs=(Out("y", like="x"),)),
        ValueError,
        r"{name}: 'y' is both an argument and an output \(names must be unique among the "
        r"arguments and the outputs\)",
    ),
    "args= one argument, not a tuple": (
        lambda n: rows_op(n, args=Rows("x")), TypeError,
        r"{name}: args= must be a tuple of Rows, Like, Feature, ..., got Rows\(name='x'",
    ),
    "args= holding a name": (
        lambda n: rows_op(n, args=(Rows("x"), "w")), TypeError,
        r"{name}: args= must be Rows, Like, Feature, ..., got 'w'",
    ),
    "outputs= holding a tensor's name": (
        lambda n: rows_op(n, outputs=("y",)), TypeError,
        r"{name}: outputs= must be Out, got 'y'",
    ),
    "Ids read by a kernel without an index parameter": (
        lambda n: ids_op(n, kernel(args=IDS_ARGS)), ValueError,
        r"{name}: the Ids argument 'targets' is read by kernel kbuild_test_decl_k\d+, which "
        r"needs an \"index\" parameter targets_dtype to bind its dtype to \(i32 or i64: "
        r"without it int32 ids would be read as int64\), and has none: add "
        r"Param\('targets_dtype', \"index\"\) to the kernel",
    ),
    "Ids whose dtype parameter is not an index": (
        lambda n: ids_op(n, kernel((Param("targets_dtype", "dtype?"),), IDS_ARGS)),
        ValueError,
        r"{name}: the Ids argument 'targets' is read by kernel .*, and has one of kind "
        r"'dtype\?'",
    ),
    "Launch(values=) naming no parameter": (
        lambda n: rows_op(n, cuda=None, launch=Launch(ROW_KERNEL, values={"eps": float})),
        ValueError,
        r"{name}: Launch\(values=\) names \['eps'\], which are not parameters of kernel "
        r"kbuild_test_decl_k\d+ \['N', 'dtype'\]",
    ),
    "Launch(ints=) naming a pointer": (
        lambda n: rows_op(n, cuda=None, launch=Launch(ROW_KERNEL, ints={"y": len})), ValueError,
        r"{name}: Launch\(ints=\) names 'y', which is not a scalar argument of kernel "
        r"kbuild_test_decl_k\d+ \['x', 'y', 'M'\]",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", OP_ERRORS)
def test_a_bad_op_declaration_is_refused_by_name_before_it_registers(case):
    """Each declaration error names the op, the argument and what it takes, when the Op is
    made, before torch defines it: the name stays free for the corrected declaration."""
    declare, error, message = OP_ERRORS[case]
    name = fresh("refused")
    with pytest.raises(error, match=message.replace("{name}", re.escape(name))):
        declare(name)
    assert name not in opdef.DEFINED
    assert not hasattr(getattr(torch.ops, NS), name.split("::")[1])
    fixed = rows_op(name)
    assert opdef.DEFINED[name] is fixed


def test_ids_with_an_index_parameter_are_accepted():
    """The refusal is only for ids a kernel reads without its dtype: an "index" parameter
    <ids>_dtype, or one the launch computes (values=), binds it; a kernel not reading the
    ids needs none."""
    index = Param("targets_dtype", "index")
    ids_op(fresh("ids"), kernel((index,), IDS_ARGS))
    computed = kernel((Param("index_dtype", "index"),), IDS_ARGS)
    ids_op(fresh("ids"), computed, values={"index_dtype": lambda b: "i32"})
    ids_op(fresh("ids"), kernel(args=(Arg("logits"), Arg("loss"), Arg("M", "i64"))))


LAUNCH_ERRORS = {
    "a kernel's name": (
        lambda: Launch("rmsnorm_fwd"),
        r"Launch takes a kernel definition \(a KernelDef\), not 'rmsnorm_fwd': the builder "
        r"decorated with @kbuild.kernel is one, .*kernel_def\(name\) finds one by its name",
    ),
    "a value that is no function": (
        lambda: Launch(ROW_KERNEL, values={"N": 8}),
        r"Launch\(kbuild_test_decl_k\d+\): values\['N'\] must be a function of the call",
    ),
    "ints that are no mapping": (
        lambda: Launch(ROW_KERNEL, ints=[len]),
        r"Launch\(kbuild_test_decl_k\d+\): ints= must be a dict of name: function",
    ),
}


@pytest.mark.parametrize("case", LAUNCH_ERRORS)
def test_a_bad_launch_is_refused_when_made(case):
    make, message = LAUNCH_ERRORS[case]
    with pytest.raises(TypeError, match=message):
        make()


# ----------------------------------------------------------------------------- kernels


KERNEL_ERRORS = {
    "an unknown Param kind": (
        lambda: Param("N", "integer"), ValueError,
        r"parameter 'N': unknown kind 'integer'; the kinds are bool, dtype, dtype\?, float, "
        r"index, int",
    ),
    "an unknown Arg kind (a dtype for a kind)": (
        lambda: Arg("x", "f16"), ValueError,
        r"argument 'x': unknown kind 'f16'; the kinds are ptr, i64, f32 \(a tensor is a ptr\)",
    ),
    "two parameters of one name": (
        lambda: kernel((Param("N", "int"),)), ValueError,
        r"kbuild_test_decl_k\d+: parameter 'N' declared twice",
    ),
    "two arguments of one name": (
        lambda: kernel(args=(Arg("x"), Arg("x"), Arg("M", "i64"))), ValueError,
        r"kbuild_test_decl_k\d+: argument 'x' declared twice",
    ),
    "a parameter that is no Param": (
        lambda: kernel((("eps", "float"),)), TypeError,
        r"kbuild_test_decl_k\d+: params must be Params, got \('eps', 'float'\)",
    ),
    "params= one Param, not a tuple": (
        lambda: kbuild.kernel("k", params=Param("N", "int"), args=()), TypeError,
        r"kernel k: params must be a tuple of Params, got Param\(name='N'",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", KERNEL_ERRORS)
def test_a_bad_kernel_declaration_is_refused_when_made(case):
    make, error, message = KERNEL_ERRORS[case]
    with pytest.raises(error, match=message):
        make()


def build_dupes(N, target):
    raise AssertionError("never built")


def test_a_kernel_declared_with_a_name_twice_is_not_registered():
    """The kernel decorator: the definition is refused before it joins the registry."""
    declare = kbuild.kernel("user_dupes", params=(Param("N", "int"),),
                            args=(Arg("y"), Arg("y"), Arg("M", "i64")))  # fmt: skip
    with pytest.raises(ValueError, match=r"user_dupes: argument 'y' declared twice"):
        declare(build_dupes)
    assert "user_dupes" not in table.KERNELS


def test_the_argument_kinds_are_the_ones_kernels_and_launches_have():
    """An Arg kind the DSL can declare (dsl.Kernel ptr / i64 / f32 arguments) and the launch
    can pack (runtime/prepared.py FORMATS) is known; refusing one would leave a builder's
    signature undeclarable, accepting another fails only at compile."""
    from kbuild.runtime.prepared import FORMATS

    assert set(ARG_KINDS) == set(FORMATS)
    for kind in ARG_KINDS:
        Arg("x", kind)


def test_kbuild_launch_takes_a_definition_not_a_name():
    """kbuild.launch("name", ...) was an AttributeError ('str' object has no attribute
    'name'); the error now says what it takes and where to get one."""
    with pytest.raises(TypeError, match=(
        r"kbuild.launch takes a kernel definition \(a KernelDef\), not 'rmsnorm_fwd': the "
        r"builder decorated with @kbuild.kernel is one \(kbuild.launch\(build_scale, grid, "
        r"...\)\), and kbuild.registry.kernel_def\(name\) finds one by its name"
    )):  # fmt: skip
        kbuild.launch("rmsnorm_fwd", 1, torch.zeros(1), N=8)


# ----------------------------------------------------------------------------- on call


Y, XS = (Out("y", like="x"),), (Rows("x"),)


def held_op(reference, outputs=Y, args=XS) -> Op:
    return Op(fresh("held"), args=args, outputs=outputs, reference=reference, cuda=never_runs)


X = torch.randn(3, 8)

# case -> (op, error type, message): a reference returning other than it declares
CALL_ERRORS = {
    "another shape": (
        lambda: held_op(lambda x: x[:, :2] * 1), ValueError,
        r"{name}: the reference's output y has shape \(3, 2\) and dtype torch.float32; "
        r"Out\('y', like='x'\) declares shape \(3, 8\) and dtype torch.float32",
    ),
    "another dtype": (
        lambda: held_op(lambda x: x.double()), TypeError,
        r"{name}: the reference's output y has shape \(3, 8\) and dtype torch.float64; "
        r"Out\('y', like='x'\) declares shape \(3, 8\) and dtype torch.float32",
    ),
    "another dtype than the declared float32": (
        lambda: held_op(lambda x: x.half(), (Out("y", like="x", dtype="float32"),)), TypeError,
        r"{name}: the reference's output y has shape \(3, 8\) and dtype torch.float16; "
        r"Out\('y', like='x', dtype='float32'\) declares shape \(3, 8\) and dtype "
        r"torch.float32",
    ),
    "a statistic of another row count": (
        lambda: held_op(lambda x: (x * 1, x.sum()), (Out("y", like="x"), Out("s", rows="x"))),
        ValueError,
        r"{name}: the reference's output s has shape \(\) and dtype torch.float32; "
        r"Out\('s', rows='x'\) declares shape \(3,\) and dtype torch.float32",
    ),
    "another shape than the computed one": (
        lambda: held_op(lambda x: x.T * 1, (Out("y", like="x", shape=lambda b: (2, 12)),)),
        ValueError,
        r"{name}: the reference's output y has shape \(8, 3\) .*; Out\('y', like='x', "
        r"shape=...\) declares shape \(2, 12\)",
    ),
    "fewer outputs": (
        lambda: held_op(lambda x: x * 1, (Out("y", like="x"), Out("s", rows="x"))),
        ValueError,
        r"{name}: the reference must return the op's 2 outputs \(y, s\); it returned a "
        r"tensor of shape \(3, 8\) and dtype torch.float32",
    ),
    "None for a wanted output": (
        lambda: held_op(lambda x: (x * 1, None), (Out("y", like="x"), Out("s", rows="x"))),
        TypeError,
        r"{name}: the reference's output s must be a tensor of shape \(3,\) and dtype "
        r"torch.float32 \(Out\('s', rows='x'\)\), got None",
    ),
}  # fmt: skip


@pytest.mark.not_interpreted
@pytest.mark.parametrize("case", CALL_ERRORS)
def test_the_cpu_kernel_refuses_a_reference_returning_other_than_declared(case):
    """The CPU kernel (Op.__call__, and torch.ops called directly) holds each output of the
    reference to its Out's shape and dtype, which the fake and the launches allocate."""
    make, error, message = CALL_ERRORS[case]
    op = make()
    message = message.replace("{name}", re.escape(op.name))
    with pytest.raises(error, match=message):
        op(X)
    with pytest.raises(error, match=message):
        op.overload(X)


@pytest.mark.not_interpreted
def test_the_fake_is_the_declaration_the_cpu_kernel_is_held_to():
    """The fake (FakeTensorMode, meta tensors) makes the outputs from the declaration and
    never runs the reference, so it cannot follow a reference of another shape: a graph
    traced on it (torch.compile) reads the declared shape. The CPU kernel is held to it, so
    the compiled call refuses the reference too, rather than handing on a (3, 2) tensor
    described as (3, 8)."""
    op = held_op(lambda x: x[:, :2] * 1)
    with FakeTensorMode() as mode:
        fake = op.overload(mode.from_tensor(X))
    assert tuple(fake.shape) == (3, 8) and fake.dtype == torch.float32
    assert tuple(op.overload(X.to("meta")).shape) == (3, 8)

    compiled = torch.compile(lambda x: op(x) + 1, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"the reference's output y has shape \(3, 2\)"):
        compiled(X)


@pytest.mark.not_interpreted
def test_a_reference_as_declared_passes_and_unwanted_outputs_are_not_held():
    """What the check must not refuse: a statistic of any layout of M values (flattened),
    a reference's value (or None) for an output not wanted (an empty tensor either way)."""
    op = held_op(
        lambda x, store: (x * 2, x.float().mean(-1, keepdim=True) if store else None),
        (Out("y", like="x"), Out("s", rows="x", when="store")),
        (Rows("x"), Scalar("store", "bool")),
    )
    y, s = op(X, True)
    assert torch.equal(y, X * 2) and s.shape == (3,)
    y, s = op(X, False)
    assert s.numel() == 0
    ignored = held_op(
        lambda x, store: (x * 2, x.double()),  # not wanted: never looked at
        (Out("y", like="x"), Out("s", rows="x", when="store")),
        (Rows("x"), Scalar("store", "bool")),
    )
    assert ignored(X, False)[1].numel() == 0
