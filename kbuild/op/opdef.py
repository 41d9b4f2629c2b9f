"""One description per op: from an `Op`, everything torch needs of a kernel-backed operator.

    softmax = Op(
        "user_softmax::softmax",
        args=(Rows("x"),),
        outputs=(Out("y", like="x"),),
        launch=Launch(SOFTMAX_FWD),           # a KernelDef (kbuild.kernel or the table)
        reference=lambda x: torch.softmax(x.float(), -1).to(x.dtype),
        backward=Op("user_softmax::softmax_backward", args=(Rows("y"), Like("dy", "y")),
                    outputs=(Out("dx", like="y"),), launch=Launch(SOFTMAX_BWD),
                    reference=softmax_backward_reference),
    )
    y = softmax(x)                             # checks, then torch.ops.user_softmax.softmax

From the declaration come:
- the torch.library schema (`args` in order: tensors, then or among them the compile-time
  scalars, with their defaults; the outputs as Tensors);
- the argument checks, each error naming the argument (`Op.check`, run by `Op.__call__`):
  `Rows` is a float tensor of at least one dimension seen as (M, N) rows, `Like` one of
  another's shape, dtype (or fp32) and device, `Feature` an optional (N,) parameter,
  `Scalar` a bool, int, float or dtype with its bounds or its own check (eps: finite and
  >= 0). Where the op's CUDA kernel is the extension's generic one, a positional call is
  checked in C++ first (`native_program`'s "checks"): a call it accepts runs with no Python
  but `__call__`'s line, one it refuses takes the Python check (and its error);
- the fake kernel (shapes for tracing) from the outputs' rules, and the CPU kernel (the
  `reference`, outputs made dense, unwanted ones empty, each held to the shape and dtype
  those rules give it: an error naming the output otherwise);
- the CUDA kernel: `Launch` binds the kernel table's parameters and arguments by name (a
  tensor argument is the op's tensor of that name, `M` the row count, `N` and `dtype` the
  first Rows tensor's, `<t>_dtype` tensor t's dtype or None, `vectorize` whether every
  pointer is 16-byte aligned, any other parameter the op's scalar of that name, or a function
  of the call given in `values`), one block per row group (or the persistent grid the
  builder asks for), run by the C++ extension's generic kernel where it loads and nothing of
  it is Python (`native_program`), else from Python; or a hand-written `cuda` function;
- the autograd formula, by names: the backward op's arguments are the forward's tensors
  (saved), `d<output>` (the gradient of that output), `need_d<input>` (whether that input
  wants a gradient) and the forward's scalars; its outputs `d<input>` are the inputs'
  gradients (an empty tensor: none); run by the extension's generic C++ autograd kernel
  (`autograd_program`), else torch.library's. Or a hand-written `autograd=(setup, backward)`;
- the kernels to warm for a row width (`Op.warm_specs`: the launches' specs on meta tensors,
  so exactly what a call of aligned tensors asks for), which `kbuild warmup --ops` lists.

kbuild's own norm operators are declared so too (kernels/norms/custom_ops.py); their CUDA kernels
and autograd come from the C++ extension where it loads (`native=True`). Declaring the same op
again (a script run as __main__, then imported by name) reuses the first registration.

The pieces: op/args.py (arguments and outputs), op/binding.py (a Launch bound to the
op's call, in Python and as the C++ generic kernel's program), this module (the Op).
A declaration that could not work is refused when made, naming the op and the argument (a
reference that is not a function of the op's arguments, a KernelDef without Launch(...), a
name twice, Ids a kernel reads without its "index" parameter).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .. import native
from ..registry import KernelDef
from ..spec import KernelSpec
from .args import (
    _DENSE,
    _REQUIRED,
    Argument,
    Feature,
    Ids,
    Like,
    Out,
    Rows,
    Scalar,
    Tensors,
    _has_data,
    _Tensor,
    eps,
)
from .binding import Launch, NativeRecord, _Binding, rows_grid
from .extension import Standin
from .launch import IDS_IN_CALL
from .tensors import (
    DTYPE_NAMES,
    INDEX_NAMES,
    INTERPRETED,
    device_guard,
    dtype_name,
    on_gpu,
    row_count,
)

__all__ = [
    "DEFINED",
    "INDEX_NAMES",
    "Feature",
    "Ids",
    "Launch",
    "Like",
    "NativeRecord",
    "Op",
    "Out",
    "Rows",
    "Scalar",
    "Tensors",
    "dtype_name",
    "eps",
    "rows_grid",
]

_LIBRARIES: dict[str, torch.library.Library] = {}  # kept alive: a dropped Library unregisters
DEFINED: dict[str, Op] = {}  # qualified name -> its description, as declared
# The C++ extension once loaded, whose generic kernel runs the CUDA kernel of ops declared
# later; until then the stand-in (STANDIN, below), and None where it cannot be had.
NATIVE: list = [None]
# Where a backward argument comes from (kbuild/native/generic.h `BackwardSource`).
_SAVED_INPUT, _SAVED_OUTPUT, _GRAD, _NEED, _SCALAR = range(5)


# ----------------------------------------------------------------------------- the op


class Op:
    """One operator: its arguments, outputs, kernels, reference and gradient (see the module
    docstring). Declaring it defines and registers `namespace::name` with torch.library."""

    def __init__(
        self,
        name: str,
        args: Iterable[Argument],
        outputs: Iterable[Out],
        reference: Callable[..., Any],
        launch: Launch | Iterable[Launch] | None = None,
        cuda: Callable[..., Any] | None = None,
        backward: Op | None = None,
        autograd: tuple[Callable, Callable] | None = None,
        native: bool = False,
        check: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if not isinstance(name, str) or "::" not in name:
            raise ValueError(f"op name must be 'namespace::name', got {name!r}")
        self.name = name
        self.namespace, self.op_name = name.split("::", 1)
        self.args = self._sequence("args", args, _ARGUMENTS, "Rows, Like, Feature, ...")
        self.outputs = self._sequence("outputs", outputs, (Out,), "Out")
        self._check_functions(reference, cuda, check, autograd, backward)
        self.reference = reference
        self.backward = backward
        self.native = native
        # Whether its CUDA kernel / its autograd run in the extension's generic C++ kernels
        # (set when they are registered).
        self._entry = None  # the extension's checked call of the op (`_take_entry`)
        self.generic_native = self.native_autograd = False
        self._check_more = check
        names = [a.name for a in self.args]
        _unique(name, "argument", names)
        _unique(name, "output", [o.name for o in self.outputs])
        both = [o.name for o in self.outputs if o.name in names]
        if both:  # the launches bind tensors by name: one would stand for the other
            raise ValueError(
                f"{name}: {both[0]!r} is both an argument and an output (names must be unique "
                "among the arguments and the outputs)"
            )
        self.arg_names = tuple(names)
        self._check_reference(reference)
        self.tensor_names = tuple(a.name for a in self.args if not isinstance(a, Scalar))
        self.scalars = {a.name: a for a in self.args if isinstance(a, Scalar)}
        self._check_names()
        if launch is not None and cuda is not None:
            raise ValueError(f"{name}: give launch= or cuda=, not both")
        self.launches = self._launches(launch)
        if cuda is None and not self.launches:  # native too: its Python kernel is the fallback
            raise ValueError(f"{name}: give launch= or cuda= (its CUDA kernel)")
        self._bindings = [_Binding(x, self) for x in self.launches]
        self._cuda = cuda
        self._ids = tuple(a.name for a in self.args if isinstance(a, Ids))
        self.schema = self._schema()
        if backward is not None and autograd is not None:
            raise ValueError(f"{name}: give backward= (by names) or autograd=, not both")
        self._autograd = autograd
        if backward is not None:
            self._check_backward(backward)
        self._register()
        self.overload = getattr(getattr(torch.ops, self.namespace), self.op_name).default

    def _sequence(self, what: str, given: Any, kinds: tuple, expected: str) -> tuple:
        """args / outputs as a tuple, each of its kinds."""
        if isinstance(given, (*kinds, str)):  # (Rows("x")) without its comma
            raise TypeError(f"{self.name}: {what}= must be a tuple of {expected}, got {given!r}")
        try:
            items = tuple(given)
        except TypeError:
            raise TypeError(
                f"{self.name}: {what}= must be a tuple of {expected}, got {given!r}"
            ) from None
        for item in items:
            if not isinstance(item, kinds):
                raise TypeError(f"{self.name}: {what}= must be {expected}, got {item!r}")
        return items

    def _check_functions(self, reference, cuda, check, autograd, backward) -> None:
        """The functions a declaration gives are functions (else the first call fails with
        "'NoneType' object is not callable", far from the declaration)."""
        if not callable(reference):
            raise TypeError(
                f"{self.name}: reference= must be a function (the CPU kernel, called with the "
                f"op's arguments in order), got {reference!r}"
            )
        for what, f, role in (
            ("cuda", cuda, "the CUDA kernel, called with the op's arguments"),
            ("check", check, "called with the arguments by name"),
        ):
            if f is not None and not callable(f):
                raise TypeError(f"{self.name}: {what}= must be a function ({role}), got {f!r}")
        pair = tuple(autograd) if isinstance(autograd, (tuple, list)) else ()
        if autograd is not None and (len(pair) != 2 or not all(map(callable, pair))):
            raise TypeError(
                f"{self.name}: autograd= must be (setup_context, backward), two functions as "
                f"torch.library.register_autograd takes them, got {autograd!r}"
            )
        if backward is not None and not isinstance(backward, Op):
            raise TypeError(
                f"{self.name}: backward= must be an Op (the backward op, bound by names), got "
                f"{backward!r}; a hand-written formula is autograd=(setup_context, backward)"
            )

    def _check_reference(self, reference: Callable) -> None:
        """The reference takes the op's arguments, in order (the CPU kernel calls it so)."""
        try:
            signature = inspect.signature(reference)
        except (TypeError, ValueError):  # a builtin without one: its call says
            return
        try:
            signature.bind(*self.arg_names)
        except TypeError:
            raise TypeError(
                f"{self.name}: reference= must take the op's {len(self.arg_names)} arguments "
                f"({', '.join(self.arg_names)}) in order; it takes {signature}"
            ) from None

    def _launches(self, launch: Any) -> tuple[Launch, ...]:
        """launch= as a tuple of Launches (a KernelDef is bound to the op by a Launch)."""
        if launch is None:
            return ()
        one = isinstance(launch, (Launch, KernelDef, str)) or not isinstance(launch, Iterable)
        launches = (launch,) if one else tuple(launch)
        for x in launches:
            if isinstance(x, KernelDef):
                raise TypeError(
                    f"{self.name}: launch= takes Launch(...), got the kernel {x.name}: wrap the "
                    "kernel in Launch(...) (launch=Launch(kernel), which binds its parameters "
                    "and arguments to the op's by name)"
                )
            if not isinstance(x, Launch):
                raise TypeError(
                    f"{self.name}: launch= must be a Launch or a sequence of them, got {x!r}"
                )
        return launches

    def _check_names(self) -> None:
        """What the checks, outputs and schema refer to must exist (else a call fails with a
        KeyError, or torch refuses the schema): a Like's or Feature's `of` a required tensor
        before it; an output's `like` / `rows` a tensor (an optional one only with it in
        `when`), its `dtype` "float32" or a dtype scalar, its `when` bool or dtype scalars or
        tensors; no argument without a default after one with a default."""
        tensors = set(self.tensor_names)
        seen: dict[str, Argument] = {}
        defaulted = None
        for a in self.args:
            of = getattr(a, "of", None) or getattr(a, "rows_of", None)
            if of is not None and not isinstance(seen.get(of), _Tensor):
                raise ValueError(
                    f"{self.name}: {a.name} is checked against {of}, which is not a tensor "
                    "argument before it"
                )
            if of is not None and seen[of].optional:
                raise ValueError(
                    f"{self.name}: {a.name} is checked against {of}, which is optional"
                )
            seen[a.name] = a
            if getattr(a, "default", _REQUIRED) is not _REQUIRED:
                defaulted = a.name
            elif defaulted is not None:
                raise ValueError(
                    f"{self.name}: {a.name} has no default but follows {defaulted}, which has "
                    "one (torch's schemas take defaults last)"
                )
        flags = {n for n, a in self.scalars.items() if a.kind in ("bool", "dtype")}
        for o in self.outputs:
            of = o.like or o.rows
            key = "like" if o.like is not None else "rows"
            if of not in tensors:
                raise ValueError(
                    f"{self.name}: output {o.name}: {key}={of!r} is not a tensor argument"
                )
            if seen[of].optional and of not in o.when:
                raise ValueError(
                    f"{self.name}: output {o.name} is {key} {of}, which is optional: add {of!r} "
                    "to its when="
                )
            dtype = self.scalars.get(o.dtype)
            if o.dtype not in (None, "float32") and (dtype is None or dtype.kind != "dtype"):
                raise ValueError(
                    f"{self.name}: output {o.name}: dtype={o.dtype!r} is neither 'float32' nor a "
                    "dtype scalar"
                )
            for name in o.when:
                if name not in flags and name not in tensors:
                    raise ValueError(
                        f"{self.name}: output {o.name}: when={name!r} is not a bool or dtype "
                        "scalar or a tensor argument"
                    )

    # -- the schema --------------------------------------------------------------------

    def _schema(self) -> str:
        parts = []
        for a in self.args:
            default = getattr(a, "default", _REQUIRED)
            text = f"{a.schema_type} {a.name}"
            if default is not _REQUIRED:
                text += f"={_schema_default(default)}"
            parts.append(text)
        returns = ", ".join("Tensor" for _ in self.outputs)
        returns = returns if len(self.outputs) == 1 else f"({returns})"
        return f"({', '.join(parts)}) -> {returns}"

    # -- binding and checks ------------------------------------------------------------

    def bind(self, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, defaults filled in (TypeError as Python's own)."""
        if not kwargs and len(args) == len(self.arg_names):  # all given, in order
            return dict(zip(self.arg_names, args, strict=True))
        if len(args) > len(self.args):
            raise TypeError(f"{self.name} takes {len(self.args)} arguments, got {len(args)}")
        bound = dict(zip(self.arg_names, args, strict=False))
        for key, value in kwargs.items():
            if key not in self.arg_names:
                raise TypeError(f"{self.name} has no argument {key!r}; it takes {self.arg_names}")
            if key in bound:
                raise TypeError(f"{self.name}: {key} given twice")
            bound[key] = value
        for a in self.args:
            if a.name not in bound:
                default = getattr(a, "default", _REQUIRED)
                if default is _REQUIRED:
                    if getattr(a, "optional", False) and not isinstance(a, Scalar):
                        bound[a.name] = None
                        continue
                    raise TypeError(f"{self.name}: missing argument {a.name!r}")
                bound[a.name] = default
        return {name: bound[name] for name in self.arg_names}

    def check(self, bound: dict[str, Any]) -> dict[str, Any]:
        """Every argument's check, in order; returns the checked (normalised) values."""
        for a in self.args:
            bound[a.name] = a.check(bound[a.name], bound)
        if self._check_more is not None:
            self._check_more(bound)
        return bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Check the arguments, then run the operator (autograd included). A positional call
        of an op whose CUDA kernel is the extension's generic one goes to the extension first
        (`_fast`, kbuild/native/generic.h `call`): it runs the same checks on exact CUDA
        tensors and calls the operator through the dispatcher, or returns None for anything
        else (a bad argument, another device, a tensor subclass, a torch function mode),
        which the Python check and call below take, their errors naming the argument. Under
        torch.compile the Python path is traced."""
        fast = self._fast
        if fast is not None and not kwargs and not torch.compiler.is_compiling():
            out = fast(args)
            if out is not None:
                return out
        bound = self.check(self.bind(args, kwargs))
        return self.run(*bound.values())

    def run(self, *values: Any) -> Any:
        """The operator on checked values (every argument, in order): what
        `self.overload(*values)` computes. Where its CUDA kernel and its autograd formula
        are Python (`cuda=` or launches without the extension's generic kernel; `autograd=`
        or a backward op without its C++ autograd), an eager call on plain CUDA tensors runs
        them itself, through one torch.autograd.Function, not through the dispatcher and
        torch.library's Python autograd: the same code, without the host work in between
        (kbuild.cross_entropy's forward and backward: 332 us of host time a call through
        the dispatcher on the CPU machine, 231 through here; bench/NOTES.md). Anything
        that may be listening to the dispatcher takes the operator: torch.compile, a torch
        function or dispatch mode (fake tensors, export), functorch's transforms, tensor
        subclasses, tensors on other devices. Under the profiler the call is recorded
        under the operator's name."""
        if self.native or self.generic_native or not plain_eager(values):
            return self.overload(*values)
        if torch.is_grad_enabled() and any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in values
        ):
            function = self._eager_function()
            if function is None:  # no Python formula: the operator's own autograd
                return self.overload(*values)
            run = function.apply
        else:
            run = self._python_kernel()
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(self.name):
                return run(*values)
        return run(*values)

    def _python_kernel(self) -> Callable[..., Any]:
        """The CUDA kernel where it is Python: `cuda=`, else the launches."""
        return self._user_cuda if self._cuda is not None else self._launch_cuda

    def _eager_function(self) -> type[torch.autograd.Function] | None:
        """The op as one torch.autograd.Function (`run`), made once: its Python kernel, then
        the formula's setup on the inputs and outputs; the formula's backward. None where its
        autograd is C++ (`native_autograd`) or it has none."""
        function = self.__dict__.get("_function", False)
        if function is not False:
            return function
        if self.native_autograd or (self.backward is None and self._autograd is None):
            function = None
        else:
            if self.backward is not None:
                setup, backward = self._setup_context, self._backward
            else:
                setup, backward = self._autograd
            function = _eager_function(self.op_name, self._python_kernel(), setup, backward)
        self._function = function
        return function

    @property
    def generic_native(self) -> bool:
        """Whether its CUDA kernel is the extension's generic one (set when it is registered,
        or when the extension loads); with it, `__call__` takes the extension's checked call
        where every argument's check is a declaration (`_native_checks`)."""
        return self._generic_native

    @generic_native.setter
    def generic_native(self, on: bool) -> None:
        self._generic_native = on
        self._fast = self._entry if on else None

    def _take_entry(self, entry: Callable[[tuple], Any]) -> None:
        """Called by the extension's define_generic with the op's checked call (generic.h
        `call`: the outputs, or None for a call it leaves to the Python check)."""
        self._entry = entry
        self._fast = entry if self._generic_native else None

    def _native_checks(self) -> list[tuple] | None:
        """Every argument's check as the C++ fast path runs it (op_args `native_check`), or
        None where one is Python's alone or the op has a `check=` function."""
        if self._check_more is not None:
            return None
        position = {name: i for i, name in enumerate(self.arg_names)}
        checks = [a.native_check(position) for a in self.args]
        return None if any(c is None for c in checks) else checks

    # -- kernels -----------------------------------------------------------------------

    def _named(self, args: tuple) -> dict[str, Any]:
        """A kernel's arguments by name: the dispatcher leaves trailing defaults out."""
        return self.bind(args, {})

    def _kernel_args(self, args: tuple) -> dict[str, Any]:
        """What the fake, CPU and CUDA kernels take: the arguments by name, through the op's
        own check (torch.ops calls reach the kernels without Op.__call__)."""
        bound = self._named(args)
        if self._check_more is not None:
            self._check_more(bound)
        return bound

    def _first(self, bound: Mapping[str, Any]) -> torch.Tensor:
        return next(bound[n] for n in self.tensor_names if bound[n] is not None)

    def _fake(self, *args: Any) -> Any:
        bound = self._kernel_args(args)
        first = self._first(bound)
        return self._result([o.allocate(bound, first) for o in self.outputs])

    def _cpu(self, *args: Any) -> Any:
        bound = self._kernel_args(args)
        returned = self.reference(*bound.values())
        got = (returned,) if isinstance(returned, torch.Tensor) else returned
        if not isinstance(got, (tuple, list)) or len(got) != len(self.outputs):
            names = ", ".join(o.name for o in self.outputs)
            raise ValueError(
                f"{self.name}: the reference must return the op's {len(self.outputs)} outputs "
                f"({names}); it returned {_described(returned)}"
            )
        first = self._first(bound)
        # The schema says no output aliases an input or another output; a reference may return
        # one (x.float() of fp32 x): such outputs are copied.
        taken = {t.untyped_storage().data_ptr() for t in bound.values() if _has_data(t)}
        outs = []
        for o, t in zip(self.outputs, got, strict=True):
            if not o.wanted(bound):
                outs.append(o.empty(first))
                continue
            t = self._declared(o, t, bound)
            if _has_data(t):
                if t.untyped_storage().data_ptr() in taken:
                    t = t.clone()
                taken.add(t.untyped_storage().data_ptr())
            outs.append(t)
        return self._result(outs)

    def _declared(self, o: Out, t: Any, bound: Mapping[str, Any]) -> torch.Tensor:
        """The reference's output `o`, dense (a statistic flattened), held to the shape and
        dtype its declaration gives, which the fake and the launches' outputs have: a
        reference disagreeing with them would give CPU callers (and graphs traced on the
        fake) other tensors than declared."""
        shape, dtype = o.expected(bound)
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{self.name}: the reference's output {o.name} must be a tensor of shape "
                f"{shape} and dtype {dtype} ({o.rule()}), got {_described(t)}"
            )
        t = (t.reshape(-1) if o.rows is not None and t.numel() == shape[0] else t).contiguous()
        if tuple(t.shape) != shape or t.dtype != dtype:
            error = ValueError if tuple(t.shape) != shape else TypeError
            raise error(
                f"{self.name}: the reference's output {o.name} has shape {tuple(t.shape)} and "
                f"dtype {t.dtype}; {o.rule()} declares shape {shape} and dtype {dtype}"
            )
        return t

    def _user_cuda(self, *args: Any) -> Any:
        """The `cuda=` kernel, given every argument (the dispatcher leaves out trailing
        arguments equal to their schema defaults, which a plain Python function would miss)
        and rows made dense, as the declaration promises its kernels (a strided x given to
        torch.ops.kbuild.layernorm_fwd was read as dense rows).
        The kernels it launches by `kbuild.launch` are held to the Ids declaration: one
        reading an Ids tensor binds its dtype to an "index" parameter (op/launch.py
        `_check_ids`; a Launch is checked when declared, `_Binding._check_names`)."""
        bound = self._dense(self._named(args))
        if not self._ids:
            return self._cuda(*bound.values())
        token = IDS_IN_CALL.set((self.name, {n: bound[n] for n in self._ids}))
        try:
            return self._cuda(*bound.values())
        finally:
            IDS_IN_CALL.reset(token)

    def _dense(self, bound: dict[str, Any]) -> dict[str, Any]:
        for a in self.args:  # the kernels read dense rows
            if isinstance(a, _DENSE) and bound[a.name] is not None:
                t = bound[a.name]
                bound[a.name] = t if t.is_contiguous() else t.contiguous()
        return bound

    def _launch_cuda(self, *args: Any) -> Any:
        bound = self._dense(self._kernel_args(args))
        first = self._first(bound)
        outs = [o.allocate(bound, first) for o in self.outputs]
        bound.update((o.name, t) for o, t in zip(self.outputs, outs, strict=True))
        with device_guard(first):
            for binding in self._bindings:
                binding.run(bound)
        no_rows = row_count(bound[self._bindings[0].rows]) == 0
        for o, t in zip(self.outputs, outs, strict=True):
            if o.rows is not None and bound[o.rows].shape[-1] == 0:
                t.fill_(float("nan"))  # statistics of rows with no elements: undefined
            elif no_rows:
                t.zero_()  # nothing launched: a (N,) output (dw) is a sum over no rows
        return self._result(outs)

    def _result(self, outs: list[torch.Tensor]) -> Any:
        return outs[0] if len(outs) == 1 else tuple(outs)

    def kernel_values(self, *args: Any, aligned: bool = True) -> list[tuple[KernelDef, tuple]]:
        """The (kernel, table values) each launch of a call with these arguments asks for."""
        bound = self._named(args)
        first = self._first(bound)
        bound.update((o.name, o.allocate(bound, first)) for o in self.outputs)
        return [(b.kernel, b.values(bound, aligned)) for b in self._bindings]

    # -- autograd ----------------------------------------------------------------------

    def _check_backward(self, bwd: Op) -> None:
        """Every argument of the backward op must have a source and every output a target:
        the forward's tensors and scalars, d<output>, need_d<input> (or need_grad_of), and
        outputs d<input> (or grad_of)."""
        outputs = [o.name for o in self.outputs]
        # per backward argument: where it comes from and the forward name it reads (what the
        # Python formula and the C++ autograd kernel's spec both follow)
        self._backward_sources: list[tuple[int, str]] = []
        for a in bwd.args:
            name = a.name
            need = getattr(a, "need_grad_of", None) or (
                name[len("need_d") :] if name.startswith("need_d") else None
            )
            if name in self.scalars:
                self._backward_sources.append((_SCALAR, name))
            elif name in self.arg_names:
                self._backward_sources.append((_SAVED_INPUT, name))
            elif name in outputs:
                self._backward_sources.append((_SAVED_OUTPUT, name))
            elif need in self.tensor_names:
                self._backward_sources.append((_NEED, need))
            elif name.startswith("d") and name[1:] in outputs:
                self._backward_sources.append((_GRAD, name[1:]))
            else:
                raise ValueError(
                    f"{bwd.name}: argument {name!r} is none of {self.name}'s tensors, scalars, "
                    "d<output> or need_d<input>"
                )
        self._grad_targets: dict[str, str] = {}  # backward output -> forward input
        for o in bwd.outputs:
            target = o.grad_of or (o.name[1:] if o.name.startswith("d") else None)
            if target not in self.tensor_names:
                raise ValueError(
                    f"{bwd.name}: output {o.name!r} is the gradient of none of {self.name}'s "
                    f"tensors {self.tensor_names} (name it d<input> or give grad_of=)"
                )
            other = next((n for n, t in self._grad_targets.items() if t == target), None)
            if other is not None:
                raise ValueError(
                    f"{bwd.name}: outputs {other!r} and {o.name!r} are both the gradient of "
                    f"{target}"
                )
            self._grad_targets[o.name] = target

    def _setup_context(self, ctx, inputs, output) -> None:
        bound = self._named(tuple(inputs))
        outs = (output,) if isinstance(output, torch.Tensor) else output
        named = {**bound, **{o.name: t for o, t in zip(self.outputs, outs, strict=True)}}
        sources = self._backward_sources
        ctx.save_for_backward(*(named[n] for s, n in sources if s in (_SAVED_INPUT, _SAVED_OUTPUT)))
        ctx.kbuild_scalars = [bound[n] for s, n in sources if s == _SCALAR]

    def _backward(self, ctx, *grads):
        saved, scalars = iter(ctx.saved_tensors), iter(ctx.kbuild_scalars)
        outputs = [o.name for o in self.outputs]
        # (arguments left at their defaults are not among the inputs: they need nothing)
        given = self.arg_names[: len(ctx.needs_input_grad)]
        needs = dict(zip(self.arg_names, ctx.needs_input_grad, strict=False))
        args = []
        for source, name in self._backward_sources:
            if source in (_SAVED_INPUT, _SAVED_OUTPUT):
                args.append(next(saved))
            elif source == _SCALAR:
                args.append(next(scalars))
            elif source == _NEED:
                args.append(bool(needs.get(name)))
            else:
                args.append(grads[outputs.index(name)])
        bwd = self.backward
        got = bwd.run(*args)
        got = (got,) if isinstance(got, torch.Tensor) else got
        # An empty gradient is one not computed (or of an empty input): None, which autograd
        # reads as zeros.
        by_input = {self._grad_targets[o.name]: g for o, g in zip(bwd.outputs, got, strict=True)}
        return tuple(
            by_input[n] if needs[n] and n in by_input and by_input[n].numel() else None
            for n in given
        )

    def autograd_program(self) -> dict:
        """The autograd formula as the C++ generic autograd kernel runs it (kbuild/native/
        generic.h `define_autograd`): each backward argument's source, as `_backward` reads
        it (a forward scalar, a saved forward tensor or output, need_d<input>, d<output>),
        and the forward argument each backward output is the gradient of."""
        position = {name: i for i, name in enumerate(self.arg_names)}
        output = {o.name: k for k, o in enumerate(self.outputs)}
        # forward outputs are indexed among the outputs, everything else among the arguments
        args = [
            (source, output[name] if source in (_SAVED_OUTPUT, _GRAD) else position[name])
            for source, name in self._backward_sources
        ]
        grad_outputs = {index for source, index in args if source == _GRAD}
        return {
            "backward": self.backward.name,
            "nargs": len(self.arg_names),
            "nouts": len(self.outputs),
            "inputs": [position[name] for name in self.tensor_names],
            "grad_outputs": sorted(grad_outputs),
            "args": args,
            "targets": [position[self._grad_targets[o.name]] for o in self.backward.outputs],
        }

    # -- registration ------------------------------------------------------------------

    def _register(self) -> None:
        """Define the operator with its CPU and fake kernels; its CUDA kernel and autograd
        too unless they come from elsewhere (`native`: the C++ extension's, where it loads;
        `register_cuda_and_autograd` registers these when it does not)."""
        existing = DEFINED.get(self.name)
        if existing is not None:
            where = _where(self.reference)
            if (
                existing.schema != self.schema
                or where is None
                or where != _where(existing.reference)
            ):
                raise ValueError(f"{self.name} is declared already (as {existing.schema})")
            # The same declaration again: its module imported a second time (a script run as
            # __main__, then by name, as `kbuild warmup --module` does; kernels are taken
            # back the same way, registry.py register). The operator registered first
            # runs the same code: this Op calls it.
            self._entry = getattr(existing, "_entry", None)
            self.generic_native = getattr(existing, "generic_native", False)
            self.native_autograd = getattr(existing, "native_autograd", False)
            return
        lib = _LIBRARIES.get(self.namespace)
        if lib is None:
            lib = _LIBRARIES[self.namespace] = torch.library.Library(self.namespace, "FRAGMENT")
        lib.define(self.op_name + self.schema)
        if INTERPRETED and (self._cuda is not None or self.launches):
            self.register_python(lib, "cuda", key="CPU")  # CPU tensors take the CUDA path
        else:
            lib.impl(self.op_name, self._cpu, "CPU")
        torch.library.register_fake(self.name, self._fake, lib=lib)
        DEFINED[self.name] = self
        if not self.native:
            self.register_cuda_and_autograd()

    def native_program(self) -> dict | None:
        """The op as the C++ generic kernel runs it (kbuild/native/generic.h `define`), or
        None where part of it is Python's (a `cuda` function, a `check`, a computed value or
        shape); with its arguments' checks for Op.__call__'s fast path, which `define` hands
        to `_take_entry`."""
        if self._cuda is not None or not self.launches or self._check_more is not None:
            return None
        if any(o.shape is not None for o in self.outputs):
            return None
        launches = [b.native(self) for b in self._bindings]
        if any(launch is None for launch in launches):
            return None
        position = {name: i for i, name in enumerate(self.arg_names)}
        dtype_rule = {None: -1, "float32": -2}
        outputs = [
            (
                o.rows is not None,
                position[o.rows if o.rows is not None else o.like],
                dtype_rule[o.dtype] if o.dtype in dtype_rule else position[o.dtype],
                [position[name] for name in o.when],
            )
            for o in self.outputs
        ]
        return {
            "nargs": len(self.arg_names),
            "tensors": [position[n] for n in self.tensor_names],
            "dense": [position[a.name] for a in self.args if isinstance(a, _DENSE)],
            "rows": position[self._bindings[0].rows],
            "outputs": outputs,
            "launches": launches,
            # Op.__call__'s fast path: the checks (None: none, the Python check runs) and, per
            # argument, what `bind` gives it when a call leaves it out (None where required)
            "checks": self._native_checks(),
            "defaults": [self._default_of(a) for a in self.args],
            "entry": self._take_entry,
        }

    @staticmethod
    def _default_of(a: Argument) -> tuple[bool, Any]:
        """(given when left out, the value) as `bind` fills an argument in: its default, None
        for an optional tensor without one."""
        default = getattr(a, "default", _REQUIRED)
        if default is not _REQUIRED:
            return True, default
        tensor = not isinstance(a, Scalar)
        return (True, None) if tensor and getattr(a, "optional", False) else (False, None)

    def register_cuda_and_autograd(self) -> None:
        """Register the CUDA kernel and the autograd formula: the C++ generic kernel where
        the extension loads and the op is all declarations (`native_program`), else the
        launches from Python (or `cuda`)."""
        lib = _LIBRARIES[self.namespace]
        program = self.native_program() if NATIVE[0] is not None else None
        self.generic_native = program is not None
        if program is not None:
            NATIVE[0].define_generic(self.namespace, self.op_name, program)
        else:
            self.register_python(lib, "cuda")
        self.native_autograd = self.backward is not None and NATIVE[0] is not None
        if self.native_autograd:  # one C++ kernel on the Autograd key: no Python per call
            NATIVE[0].define_generic_autograd(self.namespace, self.op_name, self.autograd_program())
        else:
            self.register_python(lib, "autograd")

    def register_python(
        self, lib: Any, what: str, wrap: Callable | None = None, key: str = "CUDA"
    ) -> None:
        """Register in `lib` what runs where the extension does not: the Python CUDA kernel
        (`what` "cuda": `cuda=`, else the launches), or the autograd formula ("autograd":
        derived from the backward op, or `autograd=`; nothing for an op with neither).
        `wrap` wraps the CUDA kernel (custom_ops' stand-in loads the extension on its first
        call). `key`: the dispatch key the CUDA kernel goes to (a test puts it on "CPU" to
        call it as the dispatcher does, trailing defaults left out)."""
        if what == "cuda":
            kernel = self._python_kernel()
            lib.impl(self.op_name, kernel if wrap is None else wrap(kernel), key)
        elif self.backward is not None:
            torch.library.register_autograd(
                self.name, self._backward, setup_context=self._setup_context, lib=lib
            )
        elif self._autograd is not None:
            setup, backward = self._autograd
            torch.library.register_autograd(self.name, backward, setup_context=setup, lib=lib)

    # -- warming -----------------------------------------------------------------------

    def warm_specs(
        self, N: int, dtype: torch.dtype | str = torch.bfloat16, misaligned: bool = True
    ) -> list[KernelSpec]:
        """The specs this op and its backward launch on rows of width N in `dtype`: what
        `kbuild warmup --ops` compiles. Every optional tensor given; scalars at their
        defaults, and both values of a bool without one (a backward's need flags); ids of
        both index dtypes; with `misaligned`, each kernel that takes 16-byte vectors also as a
        misaligned view (a tensor starting at an odd offset) asks for it, `vectorize=False`.
        Computed on meta tensors, by the launches' own bindings."""
        if not self.launches:
            raise ValueError(
                f"{self.name} launches its kernels from its own code (cuda=), not by Launch: "
                "its kernels are warmed by their specs (--spec, a module's warmup_specs())"
            )
        if isinstance(dtype, str):
            by_name = {v: k for k, v in DTYPE_NAMES.items()}
            if dtype not in by_name:
                raise ValueError(
                    f"dtype must be a torch float dtype or one of {sorted(by_name)}, got {dtype!r}"
                )
            dtype = by_name[dtype]
        specs: list[KernelSpec] = []
        # the backward takes the forward's scalars as the forward was called: by default
        forwarded = {n: a.default for n, a in self.scalars.items() if a.default is not _REQUIRED}
        for op, given in ((self, {}), (self.backward, forwarded)):
            if op is None:
                continue
            for args in op._example_calls(N, dtype, given):
                for k, values in op.kernel_values(*args):
                    spec = k.spec(*values)
                    specs.append(spec)
                    if misaligned and spec.kwargs.get("vectorize") is True:
                        specs.append(k.spec(**{**spec.kwargs, "vectorize": False}))
        return list(dict.fromkeys(specs))

    def _example_calls(
        self, N: int, dtype: torch.dtype, given: Mapping[str, Any]
    ) -> list[list[Any]]:
        """Calls on meta tensors of one row of width N, one per combination of what picks a
        kernel without a default: a bool scalar's two values, an ids tensor's two dtypes;
        `given`: scalars' values (a backward's, from its forward)."""
        choices: list[list[Any]] = []
        for a in self.args:
            if isinstance(a, Scalar):
                if a.name in given:
                    choices.append([given[a.name]])
                elif a.default is not _REQUIRED:
                    choices.append([a.default])
                elif a.kind == "bool":
                    choices.append([True, False])
                else:
                    raise ValueError(f"{self.name}: {a.name} has no default to warm with")
            elif isinstance(a, Ids):
                choices.append([torch.empty(1, dtype=t, device="meta") for t in INDEX_NAMES])
            elif isinstance(a, Feature):
                choices.append([torch.empty(N, dtype=dtype, device="meta")])
            else:
                choices.append([torch.empty(1, N, dtype=dtype, device="meta")])
        return [list(call) for call in itertools.product(*choices)]


_ARGUMENTS = (Rows, Like, Feature, Tensors, Ids, Scalar)


def _unique(op: str, what: str, names: list[str]) -> None:
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"{op}: {what} names must be unique; {', '.join(map(repr, twice))} declared twice"
        )


def _described(value: Any) -> str:
    """A returned value as an error names it: a tensor by its shape and dtype."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, (tuple, list)):
        items = ", ".join(map(_described, value))
        return f"a {type(value).__name__} of {len(value)} ({items})"
    return repr(value)


def _where(function: Callable) -> tuple | None:
    """Where a function was written (file, line, name), None where it is not Python code."""
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    return code.co_filename, code.co_firstlineno, getattr(function, "__qualname__", None)


def _schema_default(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")  # torch's schemas spell it float32
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


# The extension's stand-in (kbuild/op/extension.py): every op declared from here on runs the
# extension's generic kernels where it loads (the interpreter runs the Python launch path
# only: no extension).
STANDIN = Standin(DEFINED.__getitem__, NATIVE)
if not INTERPRETED:
    NATIVE[0] = STANDIN
    native.on_load(STANDIN.take_away, STANDIN.wire)


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types with no torch function of their own


def plain_eager(values: tuple) -> bool:
    """Whether a call may skip the dispatcher (`Op.run`): eager, no torch function or
    dispatch mode, functorch transform or jit trace active, and every tensor a plain
    torch.Tensor (or Parameter) that takes the GPU path (a CUDA tensor; a CPU one under the
    interpreter)."""
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch._C._get_tracing_state() is not None  # torch.jit.trace
    ):
        return False
    seen = False
    for v in values:
        if isinstance(v, torch.Tensor):
            if type(v) not in _PLAIN or not on_gpu(v):
                return False
            seen = True
    return seen


def _eager_function(name: str, kernel: Callable, setup: Callable, backward: Callable):
    """A torch.autograd.Function running `kernel` then `setup(ctx, inputs, output)` (the
    formula's, as torch.library.register_autograd takes it), and `backward`, its gradients
    padded to one per input."""

    def forward(ctx, *values):
        out = kernel(*values)
        setup(ctx, values, out)
        return out

    def grads(ctx, *dout):
        got = backward(ctx, *dout)
        got = (got,) if not isinstance(got, tuple) else got
        return got + (None,) * (len(ctx.needs_input_grad) - len(got))

    return type(
        f"{name}_eager",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(grads)},
    )
