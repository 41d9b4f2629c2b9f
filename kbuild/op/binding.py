"""How a kernel launch binds to an op's call (kbuild/op/opdef.py): the kernel table's
parameters and arguments by name, on the Python launch path (`_Binding.run`) and as the C++
generic kernel's program (`_Binding.native`, kbuild/native/generic.h)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..registry import KernelDef
from .args import Ids, Rows, Scalar
from .launch import launcher_for, record_fields, rows_grid
from .tensors import DTYPE_NAMES, INDEX_NAMES, dtype_name, row_count, stream_of

# ----------------------------------------------------------------------------- launches


# The C++ generic kernel's value sources (kbuild/native/generic.h `Source`).
_ROWS_N, _DTYPE_OF, _ALIGNED = 0, 1, 6
_SCALAR_CODES = {"float": 2, "bool": 3, "int": 4, "SymInt": 4, "dtype": 5}


@dataclass(frozen=True)
class NativeRecord:
    """What the C++ generic kernel keeps of a loaded kernel (generic.h `Record`): the launch
    and, per kernel argument, the call slot it reads (an argument's position, nargs + an
    output's index, or the slot after them for M)."""

    function_handle: int
    block: int
    shared: int
    cluster: int
    rows_per_block: int
    resident_clusters: int
    persistent: bool
    name: str
    slots: list[int]
    pointers: list[int]
    arg_names: list[str]


@dataclass(frozen=True)
class Launch:
    """One kernel launch of an op's CUDA kernel, bound by names (see the module docstring).
    `values`: table parameters computed from the call, {name: f(bound) -> value};
    `ints`: i64 arguments other than M, {name: f(bound) -> int}; `grid(launcher, M)`: the
    block count, by default one block (or cluster) per row group."""

    kernel: KernelDef
    values: Mapping[str, Callable[[Mapping[str, Any]], Any]] = field(default_factory=dict)
    ints: Mapping[str, Callable[[Mapping[str, Any]], int]] = field(default_factory=dict)
    grid: Callable[[Any, int], int | tuple[int, ...]] = rows_grid

    def __post_init__(self) -> None:
        if not isinstance(self.kernel, KernelDef):
            raise TypeError(
                f"Launch takes a kernel definition (a KernelDef), not {self.kernel!r}: the "
                "builder decorated with @kbuild.kernel is one, as are kbuild's table entries "
                "(kbuild.registry.kernel_def(name) finds one by its name)"
            )
        for what in ("values", "ints"):
            given = getattr(self, what)
            if not isinstance(given, Mapping):
                raise TypeError(
                    f"Launch({self.kernel.name}): {what}= must be a dict of name: function of "
                    f"the call, got {given!r}"
                )
            wrong = [name for name, f in given.items() if not callable(f)]
            if wrong:
                raise TypeError(
                    f"Launch({self.kernel.name}): {what}[{wrong[0]!r}] must be a function of "
                    f"the call (bound arguments by name), got {given[wrong[0]]!r}"
                )
        if not callable(self.grid):
            raise TypeError(
                f"Launch({self.kernel.name}): grid= must be a function, got {self.grid!r}"
            )


class _Binding:
    """A Launch compiled against its op: one getter per table parameter, in table order."""

    def __init__(self, launch: Launch, op: Any) -> None:  # op: the opdef.Op it binds to
        self.launch, self.kernel, self.op = launch, launch.kernel, op.name
        rows = [a.name for a in op.args if isinstance(a, Rows)]
        if not rows:
            raise ValueError(f"{op.name}: a Launch needs a Rows argument (its N and dtype)")
        self.rows = rows[0]
        tensors = set(op.tensor_names) | {o.name for o in op.outputs}
        scalars = {a.name: a for a in op.args if isinstance(a, Scalar)}
        self._check_names(launch, op)
        self.getters: list[Callable[[Mapping[str, Any], bool], Any]] = []
        # Where each value comes from, for the C++ generic kernel: ("N",), ("dtype_of", t),
        # ("scalar", name), ("aligned",), ("const",) or ("call",) (a Python function: none).
        self.sources: list[tuple[str, ...]] = []
        for p in self.kernel.params:
            source, getter = self._getter(p, op, tensors, scalars)
            self.sources.append(source)
            self.getters.append(getter)
        for a in self.kernel.args:
            if a.name not in tensors and a.name != "M" and a.name not in launch.ints:
                if a.name == "trace":
                    continue  # diagnostic builds only (never asked for by an op)
                raise ValueError(
                    f"{op.name}: kernel {self.kernel.name}'s argument {a.name!r} is none of "
                    f"the op's tensors {sorted(tensors)}, M or the launch's ints"
                )

    def _check_names(self, launch: Launch, op: Any) -> None:
        """What the launch names must be the kernel's (a value or an int under another name
        is never used); an int goes to a scalar argument (one to a pointer would be read as
        an address); an Ids tensor the kernel reads has an "index" parameter to bind its
        dtype to (without one, int32 ids would be read as int64)."""
        kernel = self.kernel
        params = {p.name: p for p in kernel.params}
        kinds = {a.name: a.kind for a in kernel.args}
        unknown = sorted(set(launch.values) - set(params))
        if unknown:
            raise ValueError(
                f"{op.name}: Launch(values=) names {unknown}, which are not parameters of "
                f"kernel {kernel.name} {list(params)}"
            )
        for name in launch.ints:
            if kinds.get(name, "ptr") == "ptr":
                raise ValueError(
                    f"{op.name}: Launch(ints=) names {name!r}, which is not a scalar argument "
                    f"of kernel {kernel.name} {list(kinds)}"
                )
        own = {f"{a.name}_dtype" for a in op.args if isinstance(a, Ids)}
        # index parameters the launch computes (values=), each binding one Ids' dtype
        computed = [n for n in launch.values if params[n].kind == "index" and n not in own]
        unbound = []  # Ids the kernel reads whose dtype only a computed parameter binds
        for a in op.args:
            if not isinstance(a, Ids) or a.name not in kinds:
                continue
            p = params.get(f"{a.name}_dtype")
            if p is None and len(unbound) < len(computed):
                unbound.append(a.name)  # bound by the launch's own function of the call
                continue
            if p is None or p.kind != "index":
                got = "has none" if p is None else f"has one of kind {p.kind!r}"
                if p is None and computed:
                    got = f"the launch computes {computed} for {unbound} already"
                raise ValueError(
                    f"{op.name}: the Ids argument {a.name!r} is read by kernel {kernel.name}, "
                    f'which needs an "index" parameter {a.name}_dtype to bind its dtype to '
                    f"(i32 or i64: without it int32 ids would be read as int64), and "
                    f'{got}: add Param({a.name + "_dtype"!r}, "index") to the kernel'
                )
        # checked at each call (`run`): the computed values are the unbound ids' dtypes
        names = [p.name for p in kernel.params]
        self._computed_ids = (tuple(unbound), tuple(names.index(n) for n in computed))

    def _getter(self, p, op: Any, tensors: set[str], scalars: Mapping[str, Scalar]):
        name, rows = p.name, self.rows
        if name in self.launch.values:
            f = self.launch.values[name]
            return ("call",), lambda bound, aligned: f(bound)
        derived = name in ("N", "dtype", "vectorize") or (
            name.endswith("_dtype") and name[: -len("_dtype")] in tensors
        )
        if derived and name in scalars:  # the scalar would be ignored without a word
            raise ValueError(
                f"{op.name}: kernel {self.kernel.name}'s parameter {name!r} is derived from the "
                f"call and is also the op's scalar {name}: rename the scalar, or give the "
                "parameter in Launch(values=...)"
            )
        if name == "N":
            return ("N",), lambda bound, aligned: bound[rows].shape[-1]
        if name == "dtype":
            return ("dtype_of", rows), lambda bound, aligned: DTYPE_NAMES[bound[rows].dtype]
        if name.endswith("_dtype") and name[: -len("_dtype")] in tensors:
            t = name[: -len("_dtype")]
            return ("dtype_of", t), lambda bound, aligned: dtype_name(bound[t])
        if name in scalars:
            if scalars[name].kind == "dtype":
                return ("scalar", name), lambda bound, aligned: DTYPE_NAMES.get(bound[name])
            return ("scalar", name), lambda bound, aligned: bound[name]
        if name == "vectorize":
            return ("aligned",), lambda bound, aligned: aligned
        if not p.required:
            default = p.default
            return ("const",), lambda bound, aligned: default
        raise ValueError(
            f"{op.name}: kernel {self.kernel.name}'s parameter {name!r} has no source: name "
            "a scalar of the op so, or give it in Launch(values=...)"
        )

    def native(self, op: Any) -> tuple[list[tuple[int, int]], Callable] | None:
        """The launch as the C++ generic kernel runs it: the varying values' sources (kind
        code and argument position, generic.h `Source`) and its resolver; None where a value
        or an argument is computed by a Python function, a value is an optional scalar other
        than a dtype, or the grid is not the rows grid."""
        if self.launch.ints or self.launch.grid is not rows_grid:
            return None
        if any(source[0] == "call" for source in self.sources):
            return None
        position = {name: i for i, name in enumerate(op.arg_names)}
        position.update((o.name, len(op.arg_names) + k) for k, o in enumerate(op.outputs))
        codes = []
        for source in self.sources:
            kind = source[0]
            if kind == "N":
                codes.append((_ROWS_N, position[self.rows]))
            elif kind == "dtype_of":
                codes.append((_DTYPE_OF, position[source[1]]))
            elif kind == "scalar":
                scalar = op.scalars[source[1]]
                if scalar.optional and scalar.kind != "dtype":
                    # None has no bits in the C++ key (only a dtype has a None code): the
                    # Python path hands it to the table, whose check names the parameter.
                    return None
                codes.append((_SCALAR_CODES[scalar.kind], position[source[1]]))
            elif kind == "aligned":
                codes.append((_ALIGNED, 0))
        m_slot = len(op.arg_names) + len(op.outputs)

        def resolve(device: int, varying: tuple):
            """A C++ key's values -> the table's, the loaded kernel, the slots it reads."""
            given = iter(varying)
            values = tuple(
                get(None, False) if source[0] == "const" else next(given)
                for source, get in zip(self.sources, self.getters, strict=True)
            )
            launcher = launcher_for(self.kernel, device, values)
            slots = [m_slot if name == "M" else position[name] for name in launcher.names]
            named = [(name, position[name]) for name in launcher.names if name != "M"]
            return NativeRecord(
                **record_fields(launcher),
                name=self.kernel.spec(*values).short(),
                slots=slots,
                pointers=[slot for _, slot in named],
                arg_names=[name for name, _ in named],
            )

        return codes, resolve

    def values(self, bound: Mapping[str, Any], aligned: bool) -> tuple:
        return tuple(get(bound, aligned) for get in self.getters)

    def _check_computed_ids(self, bound: Mapping[str, Any], values: tuple) -> None:
        """Ids bound by index parameters the launch computes: each one's dtype is among
        them (a function giving "i64" for int32 ids would have the kernel read them as
        int64)."""
        ids, where = self._computed_ids
        given = [values[i] for i in where]
        for name in ids:
            t = bound[name]
            if t is not None and INDEX_NAMES.get(t.dtype) not in given:
                raise ValueError(
                    f"{self.op}: the Ids argument {name!r} is {t.dtype}, but the index "
                    f"parameters kernel {self.kernel.name} reads it by are {given} (computed "
                    "by Launch(values=)): the launch must give its dtype"
                )

    def run(self, bound: Mapping[str, Any]) -> None:
        x = bound[self.rows]
        N = x.shape[-1]
        M = row_count(x)
        if M == 0 or N == 0:
            return  # nothing to launch (a grid of no blocks is a driver error)
        tensors = [t for t in bound.values() if isinstance(t, torch.Tensor) and t.numel()]
        combined = 0
        for t in tensors:
            combined |= t.data_ptr()
        values = self.values(bound, combined & 15 == 0)
        if self._computed_ids[0]:
            self._check_computed_ids(bound, values)
        device = x.get_device()
        launcher = launcher_for(self.kernel, device, values)
        ints = self.launch.ints
        args = []
        for name in launcher.names:
            if name == "M":
                args.append(M)
            elif name in ints:
                args.append(int(ints[name](bound)))
            else:
                t = bound[name]
                if t is None or not t.numel():
                    spec = self.kernel.spec(*values).short()
                    raise ValueError(f"{self.op}: kernel {spec}'s argument {name} has no tensor")
                args.append(t.data_ptr())
        launcher(self.launch.grid(launcher, M), stream_of(device), *args)
