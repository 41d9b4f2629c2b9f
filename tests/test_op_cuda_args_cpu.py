"""What an Op's Python CUDA kernel is handed, on CPU: every argument, and Ids bound to an
"index" parameter of each kernel reading them.

The dispatcher leaves out trailing arguments equal to their schema defaults before it calls a
Python kernel: `kbuild.cross_entropy` raised `TypeError: _fwd_cuda() missing 5 required
positional arguments` on every CUDA call (found on an H100) because its `cuda=` function was
registered as it was. These tests register an op's CUDA kernel on the CPU key (the same
registration, `Op.register_python(key="CPU")`) and call it through torch.ops as the dispatcher
does. The Ids check: int32 ids a kernel reads without an "index" parameter set to their dtype
are read as int64; a `cuda=` op's launches and a Launch whose index parameter the op computes
were let through unchecked.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import re
import warnings

import pytest
import torch

import kbuild.kernels.activations.op
import kbuild.kernels.llmc.op
import kbuild.kernels.loss.cross_entropy
import kbuild.kernels.norms.custom_ops
import kbuild.kernels.rope.op
import kbuild.kernels.rope.qk_norm  # noqa: F401  (each declares ops with cuda= kernels)
from kbuild.op import opdef
from kbuild.op.launch import launch_kernel
from kbuild.op.opdef import Ids, Launch, Op, Out, Rows, Scalar
from kbuild.registry import Arg, KernelDef, Param

NS = "kbuild_test_cuda_args"
_unique = itertools.count()
_LIBS = []  # kept alive: a dropped Library takes its registrations with it


def fresh(tag: str) -> str:
    return f"{NS}::{tag}_{next(_unique)}"


def on_cpu(op: Op) -> None:
    """Register the op's Python CUDA kernel on the CPU key, as register_cuda_and_autograd
    registers it on CUDA (over the CPU reference: the override warning is expected)."""
    lib = torch.library.Library(op.namespace, "IMPL")
    _LIBS.append(lib)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        op.register_python(lib, "cuda", key="CPU")


# ----------------------------------------------------------------------------- defaults


def test_a_cuda_kernel_gets_the_defaults_the_dispatcher_leaves_out():
    """Catches a `cuda=` function registered as it is: called through torch.ops with its
    trailing defaults left out (or given equal to them, which the dispatcher drops too), it
    got only the arguments before them (TypeError, or a short argument list)."""
    calls = []

    def cuda(x, n, flag, scale, dtype):
        calls.append((n, flag, scale, dtype))
        return x.clone()

    op = Op(fresh("defaults"),
            args=(Rows("x"), Scalar("n", "int", 3), Scalar("flag", "bool", False),
                  Scalar("scale", "float", 0.5), Scalar("dtype", "dtype", None, optional=True)),
            outputs=(Out("y", like="x"),), reference=lambda x, n, flag, scale, dtype: x * 2,
            cuda=cuda)  # fmt: skip
    on_cpu(op)
    x = torch.ones(2, 4)
    run = getattr(torch.ops.kbuild_test_cuda_args, op.op_name)
    run(x)
    run(x, 4)
    run(x, 3, True)
    run(x, 3, False, 0.5, torch.float32)
    run(x, 3, False, 0.5, None)  # every trailing one equal to its default
    op(x, scale=2.0)
    assert calls == [(3, False, 0.5, None), (4, False, 0.5, None), (3, True, 0.5, None),
                     (3, False, 0.5, torch.float32), (3, False, 0.5, None),
                     (3, False, 2.0, None)]  # fmt: skip


def _ops_with_cuda_functions() -> list[Op]:
    seen, ops = set(), []
    for op in opdef.DEFINED.values():
        if op._cuda is not None and op.namespace == "kbuild" and id(op) not in seen:
            seen.add(id(op))
            ops.append(op)
    return ops


def test_every_kbuild_op_with_a_cuda_function_is_covered():
    names = {op.name for op in _ops_with_cuda_functions()}
    assert {"kbuild::cross_entropy_fwd", "kbuild::rope", "kbuild::qk_norm_rope"} <= names, names


class _Recorder:
    """A torch.library stand-in: what register_python registers, by key."""

    def __init__(self):
        self.kernels = {}

    def impl(self, name, kernel, key):
        self.kernels[key] = kernel


class _Dense:
    """A stand-in argument that says it is dense (the kernel makes rows contiguous first)."""

    def is_contiguous(self) -> bool:
        return True


@pytest.mark.parametrize("op", _ops_with_cuda_functions(), ids=lambda op: op.name)
def test_every_cuda_function_gets_the_full_argument_list(op, monkeypatch):
    """For each kbuild op whose CUDA kernel is a Python function: that function takes the
    op's arguments, and the registered kernel, called with its trailing defaults left out as
    the dispatcher calls it, hands it every one of them, defaults filled in, in order."""
    signature = inspect.signature(op._cuda)
    signature.bind(*op.arg_names)  # takes the op's full argument list
    given, defaults = [], []
    for a in op.args:
        default = getattr(a, "default", opdef._REQUIRED)
        if default is opdef._REQUIRED:
            tensor = not isinstance(a, Scalar)
            value = None if tensor and getattr(a, "optional", False) else _Dense()
            given.append(value)
            defaults.append(False)
        else:
            given.append(default)
            defaults.append(True)
    trimmed = list(given)
    while trimmed and defaults[len(trimmed) - 1]:
        trimmed.pop()
    got = []
    monkeypatch.setattr(op, "_cuda", lambda *args: got.append(args))
    lib = _Recorder()
    op.register_python(lib, "cuda")
    lib.kernels["CUDA"](*trimmed)
    assert len(got) == 1 and len(got[0]) == len(op.arg_names), (op.name, got)
    for name, want, value in zip(op.arg_names, given, got[0], strict=True):
        assert value is want or value == want, (op.name, name, value, want)


# ----------------------------------------------------------------------------- Ids


def _kernel(*params: Param) -> KernelDef:
    name = f"{NS}_k{next(_unique)}"
    return KernelDef(name, "tests.nowhere:build", (Param("N", "int"), Param("dtype", "dtype"),
                                                   *params),
                     (Arg("logits"), Arg("targets"), Arg("loss"), Arg("M", "i64")))  # fmt: skip


def _ids_cuda_op(k: KernelDef, **values) -> Op:
    """Rows logits and their Ids targets -> a per-row loss, whose cuda= function launches
    `k` by kbuild.launch with `values`."""

    def cuda(logits, targets):
        loss = logits.new_empty(logits.shape[0])
        launch_kernel(k, 1, logits, targets, loss, logits.shape[0], N=logits.shape[-1],
                      dtype="f32", **values)  # fmt: skip
        return loss

    op = Op(fresh("ids"), args=(Rows("logits"), Ids("targets", rows_of="logits")),
            outputs=(Out("loss", rows="logits"),), reference=lambda logits, t: logits[:, 0],
            cuda=cuda)  # fmt: skip
    on_cpu(op)
    return op


def _call(op: Op, ids_dtype: torch.dtype):
    return op(torch.ones(3, 8), torch.zeros(3, dtype=ids_dtype))


@pytest.mark.not_interpreted
def test_a_cuda_functions_launch_reading_ids_needs_their_index_parameter():
    """Catches a `cuda=` op whose kernel reads int32 ids with no "index" parameter (or one
    set to i64): the launch raises naming the op, the Ids argument and the kernel, before
    the device is touched. One whose index parameter is the ids' dtype passes this check
    (and reaches the next: a CPU tensor is no CUDA device)."""
    none = _kernel()
    op = _ids_cuda_op(none)
    message = (rf"{re.escape(op.name)}: the Ids argument 'targets' \(torch.int32\) is read by "
               rf"kernel {none.name}, which needs an \"index\" parameter set to 'i32' "
               r"\(else the ids are read as another integer type\), and it has none")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        _call(op, torch.int32)
    index = _kernel(Param("index_dtype", "index"))
    wrong = _ids_cuda_op(index, index_dtype="i64")
    with pytest.raises(
        ValueError,
        match=r"the Ids argument 'targets' \(torch.int32\) .* its "
        r"index parameters are \{'index_dtype': 'i64'\}",
    ):
        _call(wrong, torch.int32)
    right = _ids_cuda_op(index, index_dtype="i32")
    with pytest.raises(ValueError, match=r"args must be tensors on one CUDA device"):
        _call(right, torch.int32)


def test_a_computed_index_parameter_binds_one_ids_argument():
    """Catches ids accepted because the launch computes some index parameter: two Ids read by
    a kernel with one computed index parameter leave one of them unbound."""
    k = KernelDef(f"{NS}_k{next(_unique)}", "tests.nowhere:build",
                  (Param("N", "int"), Param("dtype", "dtype"), Param("index_dtype", "index")),
                  (Arg("logits"), Arg("a"), Arg("b"), Arg("loss"), Arg("M", "i64")))  # fmt: skip
    name = fresh("two_ids")
    with pytest.raises(ValueError, match=(
            rf"{re.escape(name)}: the Ids argument 'b' is read by kernel {k.name}, which needs "
            r"an \"index\" parameter b_dtype to bind its dtype to \(i32 or i64: without it int32 "
            r"ids would be read as int64\), and the launch computes \['index_dtype'\] for "
            r"\['a'\] already")):  # fmt: skip
        Op(name, args=(Rows("logits"), Ids("a", rows_of="logits"), Ids("b", rows_of="logits")),
           outputs=(Out("loss", rows="logits"),), reference=lambda logits, a, b: logits[:, 0],
           launch=Launch(k, values={"index_dtype": lambda bound: "i32"}))  # fmt: skip


def test_a_computed_index_parameter_must_be_the_ids_dtype(monkeypatch):
    """Catches a Launch(values=) index function giving another dtype than the ids': int64
    ids launched as i32 are refused at the call, naming the argument."""
    monkeypatch.setattr(opdef, "device_guard", lambda t: contextlib.nullcontext())  # no CUDA
    k = KernelDef(f"{NS}_k{next(_unique)}", "tests.nowhere:build",
                  (Param("N", "int"), Param("dtype", "dtype"), Param("index_dtype", "index")),
                  (Arg("logits"), Arg("targets"), Arg("loss"), Arg("M", "i64")))  # fmt: skip
    op = Op(fresh("computed"), args=(Rows("logits"), Ids("targets", rows_of="logits")),
            outputs=(Out("loss", rows="logits"),), reference=lambda logits, t: logits[:, 0],
            launch=Launch(k, values={"index_dtype": lambda bound: "i32"}))  # fmt: skip
    on_cpu(op)
    with pytest.raises(ValueError, match=(
            rf"{re.escape(op.name)}: the Ids argument 'targets' is torch.int64, but the index "
            rf"parameters kernel {k.name} reads it by are \['i32'\]")):  # fmt: skip
        _call(op, torch.int64)
