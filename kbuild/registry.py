"""The kernel table: one description per kernel, everything else is derived from it.

Each `KernelDef` names a kernel's builder, its compile-time parameters (types, defaults, and
the rules that make two spellings of one kernel one spec) and its launch arguments in order
(which ones exist for which parameters). From it come:

- the spec: `RMSNORM_FWD.spec(N, dtype, ...)` (positional in table order, or by keyword),
  what the cache keys on and what manifests list;
- the registry: `KERNELS[name]`, whose `builder` ("module:function") is imported on compile;
  kernels defined outside kbuild join it through `register` (`kbuild.kernel` does it);
- the in-memory key: the table's name and the parameter values as given, plus the device
  (op/launch.py `launcher_for`);
- the argument order: `arg_names(spec)`, which the compiler checks each built kernel's
  signature against and the launch path follows;
- the manifests (kbuild/cli/manifest.py call `.spec` with the shapes the tests and benchmarks use).

Declaring a kernel: `kernel` (below) beside its builder, as kbuild's own are in
kbuild/kernels/<family>/ (CLAUDE.md has a worked example). Pure Python: no MLIR, no torch.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .dtypes import ELEMENT_BYTES, FLOAT_DTYPES
from .spec import KernelSpec, Scalar

_REQUIRED = object()
_KINDS = {"int", "float", "bool", "dtype", "dtype?", "index"}
INDEX_DTYPES = ("i32", "i64")
# A launch argument's kinds: a pointer, an i64 or an f32 scalar (dsl.Kernel's ptr / i64 /
# f32 arguments, runtime/prepared.py FORMATS).
ARG_KINDS = ("ptr", "i64", "f32")


def _unique(kernel: str, what: str, names: list[str]) -> None:
    """Refuse a name declared twice among a kernel's parameters or its arguments."""
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{kernel}: {what} {', '.join(map(repr, twice))} declared twice")


@dataclass(frozen=True)
class Param:
    """A compile-time parameter. `kind`: int, float, bool, dtype (a FLOAT_DTYPES name) or
    dtype? (a name or None). `needs`: a parameter that only means something with that one
    set (compute_dw and the weight offset need weight_dtype), so it is its default (False
    for a bool without one) without it: one kernel, not two that compute the same.
    `vectors_of`: this bool asks for 128-bit accesses of those dtype parameters' arrays,
    legal only for rows a whole number of vectors long, so it is False for other N. `keyed`:
    False for a parameter left out of the spec at its default (a parameter added after caches
    were warmed). `bounds`: (low, high), the closed interval of values the kernel takes, None
    on a side without a bound (an int or float parameter: a row width (1, None)); every int
    is a 64-bit one (launch keys hold it so) and every float finite, bounds or not."""

    name: str
    kind: str
    default: Scalar | object = _REQUIRED
    needs: str | None = None
    vectors_of: tuple[str, ...] = ()
    keyed: bool = True
    bounds: tuple[int | float | None, int | float | None] | None = None

    def _check_bounds(self) -> None:
        if self.bounds is None:
            return
        where = f"parameter {self.name!r}"
        if self.kind not in ("int", "float"):
            raise ValueError(f"{where}: bounds are for int and float parameters, not {self.kind}")
        pair = isinstance(self.bounds, tuple) and len(self.bounds) == 2
        numbers = pair and all(
            b is None or isinstance(b, (int, float)) and not isinstance(b, bool)
            for b in self.bounds
        )
        if not numbers:
            raise TypeError(
                f"{where}: bounds must be (low, high), numbers or None, not {self.bounds!r}"
            )
        low, high = self.bounds
        if low is not None and high is not None and low > high:
            raise ValueError(f"{where}: bounds {self.bounds} hold no value (low > high)")
        if self.default is not _REQUIRED and not _within(self.default, self.bounds):
            raise ValueError(f"{where}: its default {self.default!r} is not {_range(self.bounds)}")

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(
                f"parameter {self.name!r}: unknown kind {self.kind!r}; the kinds are "
                f"{', '.join(sorted(_KINDS))}"
            )
        self._check_bounds()

    @property
    def required(self) -> bool:
        """Whether a spec must give this parameter (it has no default)."""
        return self.default is _REQUIRED

    def check(self, kernel: str, value: Scalar) -> Scalar:
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "dtype": value in FLOAT_DTYPES,
            "dtype?": value is None or value in FLOAT_DTYPES,
            "index": value in INDEX_DTYPES,
        }[self.kind]
        if not ok:
            expected = {
                "dtype": f"one of {FLOAT_DTYPES}",
                "dtype?": f"None or {FLOAT_DTYPES}",
                "index": f"one of {INDEX_DTYPES}",
            }
            raise TypeError(
                f"{kernel}: {self.name} must be {expected.get(self.kind, self.kind)}, got {value!r}"
            )
        if self.kind not in ("int", "float"):
            return value
        given = value
        if self.kind == "float":
            try:
                value = float(value)
            except OverflowError:
                value = math.inf
        kept = math.isfinite(value) if self.kind == "float" else -(1 << 63) <= value < 1 << 63
        if not kept or self.bounds is not None and not _within(value, self.bounds):
            what = ("finite" if self.kind == "float" else "a 64-bit int") if not kept else ""
            if self.bounds is not None:
                what += (" and " if what else "") + _range(self.bounds)
            raise ValueError(f"{kernel}: {self.name} must be {what}, got {given!r}")
        return value


def _within(value: int | float, bounds: tuple[int | float | None, int | float | None]) -> bool:
    low, high = bounds
    return (low is None or value >= low) and (high is None or value <= high)


def _range(bounds: tuple[int | float | None, int | float | None]) -> str:
    """Bounds in words: ">= 1", "<= 8", "in [1, 2]"."""
    low, high = bounds
    if low is not None and high is not None:
        return f"in [{low}, {high}]"
    return f">= {low}" if low is not None else f"<= {high}"


@dataclass(frozen=True)
class Arg:
    """A launch argument: a global pointer (a tensor's address) or an i64 scalar. It exists
    when the parameter `when` names is set (truthy), or when `when` (a function of the spec's
    parameters) says so; always when `when` is None."""

    name: str
    kind: str = "ptr"
    when: str | Callable[[Mapping[str, Scalar]], bool] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ARG_KINDS:
            raise ValueError(
                f"argument {self.name!r}: unknown kind {self.kind!r}; the kinds are "
                f"{', '.join(ARG_KINDS)} (a tensor is a ptr)"
            )

    def present(self, params: Mapping[str, Scalar]) -> bool:
        if self.when is None:
            return True
        if isinstance(self.when, str):
            return bool(params.get(self.when))
        return self.when(params)


@dataclass(frozen=True)
class KernelDef:
    name: str
    builder: str  # "module:function", imported only when the kernel is compiled
    params: tuple[Param, ...]
    args: tuple[Arg, ...]
    tunable: bool = False  # takes launch-plan overrides as extra keywords (plan/norms.py)
    # The builder itself where it is at hand (`kbuild.kernel` declares it so); else imported
    # from `builder` on compile. Not part of what the definition is.
    function: Callable | None = field(default=None, compare=False, repr=False)
    # Its source fingerprint, taken when it was declared (`kbuild.kernel`): the key then names
    # the code this process runs even if the file changes on disk before the first compile.
    source: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for what, items, kind in (("params", self.params, Param), ("args", self.args, Arg)):
            wrong = [x for x in items if not isinstance(x, kind)]
            if wrong:
                raise TypeError(f"{self.name}: {what} must be {kind.__name__}s, got {wrong[0]!r}")
        _unique(self.name, "parameter", [p.name for p in self.params])
        _unique(self.name, "argument", [a.name for a in self.args])

    def spec(self, *values: Scalar, **named: Scalar) -> KernelSpec:
        """The KernelSpec for these parameter values (positional in table order, or by
        name); launch-plan overrides of a tunable kernel go by name after them."""
        if len(values) > len(self.params):
            raise TypeError(f"{self.name}: at most {len(self.params)} parameters, not {values}")
        bound = dict(zip((p.name for p in self.params), values, strict=False))
        own = {p.name for p in self.params}
        for name, value in named.items():
            if name in bound:
                raise TypeError(f"{self.name}: {name} given twice")
            if name not in own and not self.tunable:
                raise TypeError(f"{self.name} has no parameter {name!r}; it takes {sorted(own)}")
            bound[name] = value
        for p in self.params:
            if p.name not in bound:
                if p.default is _REQUIRED:
                    raise TypeError(f"{self.name}: missing parameter {p.name!r}")
                bound[p.name] = p.default
            bound[p.name] = p.check(self.name, bound[p.name])
        for p in self.params:  # the rules, after every value is known
            if p.needs is not None and bound[p.needs] is None:
                bound[p.name] = False if p.default is _REQUIRED else p.default
            if p.vectors_of and bound[p.name]:  # the row width is the first parameter
                widest = max(ELEMENT_BYTES[bound[d]] for d in p.vectors_of)
                bound[p.name] = bound[self.params[0].name] % (16 // widest) == 0
            if not p.keyed and bound[p.name] == p.default:
                del bound[p.name]
        return KernelSpec.make(self.name, **bound)

    def arg_names(self, spec: KernelSpec) -> list[str]:
        """The launch arguments of `spec`'s kernel, in order."""
        params = spec.kwargs
        return [a.name for a in self.args if a.present(params)]

    def check_signature(self, spec: KernelSpec, signature: list[tuple[str, str]]) -> None:
        """A built kernel's (name, kind) arguments must be the table's, in its order."""
        expected = [(a.name, a.kind) for a in self.args if a.present(spec.kwargs)]
        if list(map(tuple, signature)) != expected:
            raise ValueError(
                f"{spec.short()}: the builder's arguments {signature} are not the kernel "
                f"table's {expected} (kbuild/registry.py)"
            )


# Parameters and arguments several families share. A row width: any positive one (rows too
# long for registers are split over a cluster or walked in chunks, kbuild/plan/config.py).
WIDE = (1, None)
WIDTH, DTYPE = Param("N", "int", bounds=WIDE), Param("dtype", "dtype")
WEIGHT_DTYPE = Param("weight_dtype", "dtype?")
TRACE = Arg("trace", when="trace")  # diagnostic builds (dsl.trace): timestamps first
ROWS = Arg("M", "i64")
MAX_GROUPED_ROWS = 1 << 31  # rows a strided launch may have (group_magic's range)


def group_magic(group: int) -> int:
    """The x_group_magic launch argument: r // group == (r * m) >> p for every 0 <= r < 2^31,
    with p = 31 + ceil(log2(group)) and m = ceil(2^p / group) < 2^32 (Granlund and
    Montgomery's round-up method; r * m stays below 2^63). Packed as m | p << 32."""
    if not 1 <= group <= MAX_GROUPED_ROWS:
        raise ValueError(f"x_group must be in [1, 2^31], got {group}")
    p = 31 + (group - 1).bit_length()
    return -(-(1 << p) // group) | p << 32


def vectorize(*dtypes: str) -> Param:
    """16-byte accesses where the row width allows them for these arrays' dtypes."""
    return Param("vectorize", "bool", True, vectors_of=dtypes)


# A row kernel's 16-byte accesses: its arrays start 16-byte aligned. Rows of any width take
# them (a row not a whole number of vectors is peeled: dsl.rows), so N does not turn it off.
ROW_VECTORIZE = Param("vectorize", "bool", True)


# Every kernel by name: kbuild's own, declared with `kernel` beside their builders in
# OWN_MODULES (loaded at the end of this module: no MLIR, their builders import it inside),
# and a user's, registered when the module that declares it is imported.
KERNELS: dict[str, KernelDef] = {}
OWN_MODULES = (
    "kbuild.kernels.norms.kernels",
    "kbuild.kernels.reduce",
    "kbuild.kernels.llmc.encoder",
    "kbuild.kernels.loss.kernels",
    "kbuild.kernels.softmax.kernels",
    "kbuild.kernels.rope.kernels",
    "kbuild.kernels.rope.qk_norm_kernels",
    "kbuild.kernels.activations.kernels",
)
BUILTIN: set[str] = set()  # the names of kbuild's own kernels


def register(definition: KernelDef) -> KernelDef:
    """Add a kernel to the registry, so specs of it compile, cache, warm and launch like any
    other (`kbuild.kernel` calls it). Registering the same name with the same builder again
    replaces the entry (a module imported twice: as `__main__` and by name); another builder
    under a taken name is a ValueError."""
    if not isinstance(definition, KernelDef):
        raise TypeError(f"register takes a KernelDef, got {type(definition).__name__}")
    known = KERNELS.get(definition.name)
    if known is not None and known.builder != definition.builder:
        raise ValueError(
            f"kernel name {definition.name!r} is taken (by {known.builder}); choose another"
        )
    KERNELS[definition.name] = definition
    if definition.builder.split(":")[0] in OWN_MODULES:
        BUILTIN.add(definition.name)
    return definition


def get_builder(kernel: str) -> Callable:
    """The builder function of a kernel, imported on first use (it needs MLIR)."""
    definition = kernel_def(kernel)
    if definition.function is not None:
        return definition.function
    module, function = definition.builder.split(":")
    found = getattr(importlib.import_module(module), function)
    # a module-level name bound to a KernelDef (`@kbuild.kernel`) stands for its builder
    return found.function if isinstance(found, KernelDef) else found


def kernel_def(name: str) -> KernelDef:
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(
            f"unknown kernel {name!r}; known: {', '.join(sorted(KERNELS))} (a kernel of your "
            "own is known once the module that defines it is imported)"
        ) from None


# ----------------------------------------------------------------------------- declaring


def _module_name(function: Callable) -> str:
    """The importable name of the function's module: a script run as `python file.py` is
    `__main__` here but imports as its file's stem (its folder is on sys.path); one run as
    `python -m pkg.mod` imports as pkg.mod."""
    module = function.__module__
    if module != "__main__":
        return module
    main = sys.modules["__main__"]
    if getattr(main, "__spec__", None) is not None:
        return main.__spec__.name
    path = getattr(main, "__file__", None)
    if path is None:
        raise ValueError(
            f"{function.__qualname__}: a kernel's builder must live in a file (a module or a "
            "script), not in an interactive session: kbuild imports it again to compile"
        )
    return Path(path).stem


def kernel(
    name: str,
    params: Iterable[Param],
    args: Iterable[Arg],
    *,
    tunable: bool = False,
) -> Callable[[Callable], KernelDef]:
    """Declare the decorated builder `fn(**params, target) -> dsl.Kernel` as the kernel
    `name`: compile-time `params` (what the spec and the cache key hold) and launch `args` in
    the order the kernel takes them (checked against every built kernel's signature)."""
    for what, given, kind in (("params", params, "Param"), ("args", args, "Arg")):
        if isinstance(given, (Param, Arg, str)):  # (Param("N", "int")) without its comma
            raise TypeError(f"kernel {name}: {what} must be a tuple of {kind}s, got {given!r}")
    params, args = tuple(params), tuple(args)

    def declare(function: Callable) -> KernelDef:
        if "." in function.__qualname__:
            raise ValueError(
                f"{function.__qualname__}: a kernel's builder must be a module-level function"
            )
        from .cache.sources import fingerprint

        module = _module_name(function)
        builder = f"{module}:{function.__qualname__}"
        # A user's source as this process runs it: its file read now, not at the first compile.
        # kbuild's own (loaded with this module, in every process) are fingerprinted at their
        # first compile or lookup instead (cache/sources.py builder_fingerprint, once each):
        # reading them all here cost every import of kbuild half a second.
        own = module in OWN_MODULES
        source = None if own else fingerprint(builder, function.__code__.co_filename)
        definition = KernelDef(name, builder, params, args, tunable, function, source)
        return register(definition)

    return declare


# kbuild's own kernels, loaded with the registry (by name, as plugins are: each declares its
# kernels with `kernel` above, which needs this module's names defined first).
for _module in OWN_MODULES:
    importlib.import_module(_module)
