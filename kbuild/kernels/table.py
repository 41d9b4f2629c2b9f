"""The kernel table: one description per kernel, everything else is derived from it.

Each `KernelDef` names a kernel's builder, its compile-time parameters (types, defaults, and
the rules that make two spellings of one kernel one spec) and its launch arguments in order
(which ones exist for which parameters). From it come:

- the spec: `RMSNORM_FWD.spec(N, dtype, ...)` (positional in table order, or by keyword),
  what the cache keys on and what manifests list;
- the registry: `KERNELS[name]`, whose `builder` ("module:function") is imported on compile;
  kernels defined outside kbuild join it through `register` (`kbuild.kernel` does it);
- the in-memory key: the table's name and the parameter values as given, plus the device
  (ops/launch.py `launcher_for`);
- the argument order: `arg_names(spec)`, which the compiler checks each built kernel's
  signature against and the launch path follows;
- the manifests (kbuild/manifest.py call `.spec` with the shapes the tests and benchmarks use).

Adding a kernel: one entry here and its builder (CLAUDE.md has a worked example). Pure Python:
no MLIR, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..dtypes import ELEMENT_BYTES, FLOAT_DTYPES
from ..spec import KernelSpec, Scalar

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
    tunable: bool = False  # takes launch-plan overrides as extra keywords (kernels/plans.py)
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
                f"table's {expected} (kbuild/kernels/table.py)"
            )


# A row width: any positive one (rows too long for registers are split over a cluster or
# walked in chunks, kernels/config.py); eps: any finite value >= 0, as the ops accept it.
_WIDE = (1, None)
_N, _DTYPE = Param("N", "int", bounds=_WIDE), Param("dtype", "dtype")
_WEIGHT = Param("weight_dtype", "dtype?")
_EPS = Param("eps", "float", bounds=(0.0, None))
# RMSNorm's weight offset (y = x_hat * (offset + w), Gemma: 1). Last, and out of the spec at
# 0: the specs (and warmed caches) of plain RMSNorm stay what they were.
_OFFSET = Param("offset", "float", 0.0, needs="weight_dtype", keyed=False)
_TRACE = Arg("trace", when="trace")  # diagnostic builds (dsl.trace): timestamps first
_M = Arg("M", "i64")
# x's rows in groups of x_group contiguous rows, the groups x_stride elements apart (a
# (B, T, H, D) view of a fused qkv projection, read without a copy: dsl.rows.GroupedRows).
# Last, and out of the spec when False, as the offset.
_STRIDED = Param("strided", "bool", False, keyed=False)
_GROUPED_ROWS = tuple(
    Arg(name, "i64", when="strided") for name in ("x_group", "x_stride", "x_group_magic")
)
MAX_GROUPED_ROWS = 1 << 31  # rows a strided launch may have (group_magic's range)


def group_magic(group: int) -> int:
    """The x_group_magic launch argument: r // group == (r * m) >> p for every 0 <= r < 2^31,
    with p = 31 + ceil(log2(group)) and m = ceil(2^p / group) < 2^32 (Granlund and
    Montgomery's round-up method; r * m stays below 2^63). Packed as m | p << 32."""
    if not 1 <= group <= MAX_GROUPED_ROWS:
        raise ValueError(f"x_group must be in [1, 2^31], got {group}")
    p = 31 + (group - 1).bit_length()
    return -(-(1 << p) // group) | p << 32


def _vectorize(*dtypes: str) -> Param:
    return Param("vectorize", "bool", True, vectors_of=dtypes)


# A row kernel's 16-byte accesses: its arrays start 16-byte aligned. Rows of any width take
# them (a row not a whole number of vectors is peeled: dsl.rows), so N does not turn it off.
_ROW_VECTORIZE = Param("vectorize", "bool", True)


RMSNORM_FWD = KernelDef(
    "rmsnorm_fwd",
    "kbuild.kernels.rmsnorm:build_rmsnorm_module",
    (
        _N,
        _DTYPE,
        _WEIGHT,
        Param("store_rstd", "bool"),
        _EPS,
        _ROW_VECTORIZE,
        _OFFSET,
        _STRIDED,
    ),
    (
        _TRACE,
        Arg("x"),
        Arg("weight", when="weight_dtype"),
        Arg("y"),
        Arg("rstd", when="store_rstd"),
        _M,
        *_GROUPED_ROWS,
    ),
    tunable=True,
)
FUSED_ADD_RMSNORM_FWD = KernelDef(
    "fused_add_rmsnorm_fwd",
    "kbuild.kernels.rmsnorm:build_fused_add_rmsnorm_module",
    (
        _N,
        _DTYPE,
        _WEIGHT,
        Param("residual_dtype", "dtype"),
        Param("store_rstd", "bool"),
        _EPS,
        _ROW_VECTORIZE,
        _OFFSET,
        # The residual's dtype when it is not x's (an fp32 stream); keyed only when set.
        Param("residual_in_dtype", "dtype?", None, keyed=False),
    ),
    (
        _TRACE,
        Arg("x"),
        Arg("residual"),
        Arg("weight", when="weight_dtype"),
        Arg("y"),
        Arg("residual_out"),
        Arg("rstd", when="store_rstd"),
        _M,
    ),
    tunable=True,
)
LAYERNORM_FWD = KernelDef(
    "layernorm_fwd",
    "kbuild.kernels.layernorm:build_layernorm_module",
    (
        _N,
        _DTYPE,
        _WEIGHT,
        Param("bias_dtype", "dtype?"),
        Param("store_stats", "bool"),
        _EPS,
        _ROW_VECTORIZE,
    ),
    (
        _TRACE,
        Arg("x"),
        Arg("weight", when="weight_dtype"),
        Arg("bias", when="bias_dtype"),
        Arg("y"),
        Arg("mean", when="store_stats"),
        Arg("rstd", when="store_stats"),
        _M,
    ),
    tunable=True,
)
_COMPUTE_DW = Param("compute_dw", "bool", needs="weight_dtype")
_PARTIALS = (Arg("dw_partial", when="compute_dw"), Arg("db_partial", when="compute_db"))
RMSNORM_BWD = KernelDef(
    "rmsnorm_bwd",
    "kbuild.kernels.rmsnorm_bwd:build_rmsnorm_bwd_module",
    (_N, _DTYPE, _WEIGHT, _COMPUTE_DW, _ROW_VECTORIZE, _OFFSET, _STRIDED),
    (
        _TRACE,
        Arg("x"),
        Arg("weight", when="weight_dtype"),
        Arg("dy"),
        Arg("rstd"),
        Arg("dx"),
        *_PARTIALS,
        _M,
        *_GROUPED_ROWS,
    ),
    tunable=True,
)
FUSED_ADD_RMSNORM_BWD = KernelDef(
    "fused_add_rmsnorm_bwd",
    "kbuild.kernels.rmsnorm_bwd:build_fused_add_rmsnorm_bwd_module",
    (
        _N,
        _DTYPE,
        _WEIGHT,
        Param("residual_dtype", "dtype"),
        Param("has_dresidual_out", "bool"),
        _COMPUTE_DW,
        _ROW_VECTORIZE,
        _OFFSET,
        # d(residual) written apart from dx, in this dtype (an fp32 stream); keyed when set.
        Param("dresidual_dtype", "dtype?", None, keyed=False),
    ),
    (
        _TRACE,
        Arg("x"),
        Arg("weight", when="weight_dtype"),
        Arg("dy"),
        Arg("rstd"),
        Arg("dresidual_out", when="has_dresidual_out"),
        Arg("dx"),
        Arg("dresidual", when="dresidual_dtype"),
        *_PARTIALS,
        _M,
    ),
    tunable=True,
)
LAYERNORM_BWD = KernelDef(
    "layernorm_bwd",
    "kbuild.kernels.layernorm:build_layernorm_bwd_module",
    (_N, _DTYPE, _WEIGHT, _COMPUTE_DW, Param("compute_db", "bool"), _ROW_VECTORIZE),
    (
        _TRACE,
        Arg("x"),
        Arg("weight", when="weight_dtype"),
        Arg("dy"),
        Arg("mean"),
        Arg("rstd"),
        Arg("dx"),
        *_PARTIALS,
        _M,
    ),
    tunable=True,
)
COLUMN_SUM = KernelDef(
    "column_sum",
    "kbuild.kernels.reduce:build_column_sum_module",
    # One-plane specs predate `planes`: keyed without it, so warmed caches keep hitting.
    (_N, Param("out_dtype", "dtype"), Param("planes", "int", 1, keyed=False, bounds=(1, 2))),
    (
        Arg("partial"),
        Arg("out"),
        Arg("out1", when=lambda p: p.get("planes", 1) == 2),
        Arg("R", "i64"),
    ),
)

BIAS_GRAD = KernelDef(
    "bias_grad",
    "kbuild.kernels.reduce:build_bias_grad_module",
    (Param("OC", "int", bounds=_WIDE), _DTYPE, _vectorize("dtype")),
    (Arg("dout"), Arg("partial"), _M, Arg("rows_per_chunk", "i64")),
)
_C, _INDEX = Param("C", "int", bounds=_WIDE), Param("index_dtype", "index")
ENCODER_FWD = KernelDef(
    "encoder_fwd",
    "kbuild.kernels.encoder:build_encoder_fwd_module",
    (_C, _DTYPE, _INDEX, _vectorize("dtype")),
    (
        Arg("tokens"),
        Arg("wte"),
        Arg("wpe"),
        Arg("out"),
        Arg("V", "i64"),
        Arg("T", "i64"),
        _M,
    ),
)
ENCODER_BWD_WPE = KernelDef(
    "encoder_bwd_wpe",
    "kbuild.kernels.encoder:build_encoder_bwd_wpe_module",
    (_C, _DTYPE, Param("accumulate", "bool"), _vectorize("dtype")),
    (Arg("dout"), Arg("dwpe"), Arg("B", "i64"), Arg("T", "i64")),
)
ENCODER_BWD_WTE = KernelDef(
    "encoder_bwd_wte",
    "kbuild.kernels.encoder:build_encoder_bwd_wte_module",
    (_C, _DTYPE, _INDEX, _vectorize("dtype")),
    (
        Arg("sorted_ids"),
        Arg("order"),
        Arg("dout"),
        Arg("dwte"),
        Arg("partial"),
        Arg("V", "i64"),
        _M,
    ),
)
ENCODER_BWD_WTE_MERGE = KernelDef(
    "encoder_bwd_wte_merge",
    "kbuild.kernels.encoder:build_encoder_bwd_wte_merge_module",
    (_C, _DTYPE, _INDEX, _vectorize("dtype")),
    (Arg("sorted_ids"), Arg("partial"), Arg("dwte"), Arg("V", "i64"), _M),
)

KERNELS: dict[str, KernelDef] = {
    d.name: d
    for d in (
        RMSNORM_FWD,
        FUSED_ADD_RMSNORM_FWD,
        LAYERNORM_FWD,
        RMSNORM_BWD,
        FUSED_ADD_RMSNORM_BWD,
        LAYERNORM_BWD,
        COLUMN_SUM,
        BIAS_GRAD,
        ENCODER_FWD,
        ENCODER_BWD_WPE,
        ENCODER_BWD_WTE,
        ENCODER_BWD_WTE_MERGE,
    )
}
BUILTIN = frozenset(KERNELS)


def register(definition: KernelDef) -> KernelDef:
    """Add a kernel defined outside this table (a user's, `kbuild.kernel`) to the registry,
    so specs of it compile, cache, warm and launch like kbuild's own. Registering the same
    name with the same builder again replaces the entry (a module imported twice: as
    `__main__` and by name); another builder under a taken name is a ValueError."""
    if not isinstance(definition, KernelDef):
        raise TypeError(f"register takes a KernelDef, got {type(definition).__name__}")
    known = KERNELS.get(definition.name)
    if known is not None and (definition.name in BUILTIN or known.builder != definition.builder):
        raise ValueError(
            f"kernel name {definition.name!r} is taken (by {known.builder}); choose another"
        )
    KERNELS[definition.name] = definition
    return definition


# kbuild's kernels declared beside their builders (`kbuild.kernel`), outside this table: on a
# miss `kernel_def` imports them (no MLIR: their builders import it inside), so every kernel
# kbuild ships is known by name to the CLI, specs and records without `--module`.
OWN_MODULES = (
    "kbuild.kernels.cross_entropy",
    "kbuild.kernels.rope",
    "kbuild.kernels.activations",
    "kbuild.kernels.softmax",
    "kbuild.kernels.qk_norm_rope",
)


def kernel_def(name: str) -> KernelDef:
    if name not in KERNELS:
        import importlib

        for module in OWN_MODULES:
            importlib.import_module(module)
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(
            f"unknown kernel {name!r}; known: {', '.join(sorted(KERNELS))} (a kernel of your "
            "own is known once the module that defines it is imported)"
        ) from None
