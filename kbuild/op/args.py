"""What an op takes and gives (kbuild/op/opdef.py declares ops with them): its arguments,
each with the check that names it in an error and its schema type, and its outputs, each
with the rule that shapes it, for the fake, the CPU kernel and the launches alike.

Each argument's check is also given to the C++ extension (`native_check`, kbuild/native/
generic.h `ArgCheck`), which runs it on the common path of `Op.__call__` and hands every call
it does not accept to the Python check below, whose errors name the argument; an argument
whose check is Python's alone (a Scalar's `check_value` without `bounds`) keeps the op's calls
on the Python check."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .tensors import (
    DTYPE_NAMES,
    INDEX_NAMES,
    check_eps,
    check_input,
    check_like,
    check_param,
    row_count,
)

_REQUIRED = object()  # an argument without a default

# The C++ fast path's check of each argument kind (kbuild/native/generic.h `CheckKind`).
_ROWS, _LIKE, _FEATURE, _TENSORS, _IDS = range(5)
_SCALAR_CHECKS = {"float": 5, "bool": 6, "int": 7, "SymInt": 7, "dtype": 8}


def _cpp_check(kind: int, optional: bool, of: int = -1, or_fp32: bool = False, low=None, high=None):
    """One argument's check as generic.h `ArgCheck` reads it: (kind, None accepted, the
    argument it is checked against (-1: none), fp32 accepted (Like), bounds (None: open))."""
    return (kind, optional, of, or_fp32, low, high)


# ----------------------------------------------------------------------------- arguments


class _Tensor:
    """What the tensor arguments share: their schema type."""

    optional: bool

    @property
    def schema_type(self) -> str:
        return "Tensor?" if self.optional else "Tensor"


@dataclass(frozen=True)
class Rows(_Tensor):
    """A float tensor (float32, float16 or bfloat16) of shape (..., N), seen as (M, N) rows.
    The first Rows argument gives the kernels' N and dtype."""

    name: str
    optional: bool = False

    def check(self, value: Any, bound: Mapping[str, Any]) -> Any:
        if value is None and self.optional:
            return None
        return check_input(self.name, value)

    def native_check(self, position: Mapping[str, int]) -> tuple:
        return _cpp_check(_ROWS, self.optional)


@dataclass(frozen=True)
class Like(_Tensor):
    """A tensor of `of`'s shape, dtype (or float32, with `or_fp32`) and device."""

    name: str
    of: str
    or_fp32: bool = False
    optional: bool = False

    def check(self, value: Any, bound: Mapping[str, Any]) -> Any:
        if value is None and self.optional:
            return None
        return check_like(self.name, value, bound[self.of], self.of, self.or_fp32)

    def native_check(self, position: Mapping[str, int]) -> tuple:
        return _cpp_check(_LIKE, self.optional, position[self.of], self.or_fp32)


@dataclass(frozen=True)
class Feature(_Tensor):
    """A per-feature parameter (weight, bias): None, or (N,) of `of`'s dtype or float32 on
    its device."""

    name: str
    of: str = "x"
    optional: bool = True

    def check(self, value: Any, bound: Mapping[str, Any]) -> Any:
        if value is None and not self.optional:
            raise TypeError(f"{self.name} must be a torch.Tensor, got None")
        return check_param(self.name, value, bound[self.of], self.of)

    def native_check(self, position: Mapping[str, int]) -> tuple:
        # (a strided one, which the Python check copies, is left to it)
        return _cpp_check(_FEATURE, self.optional, position[self.of])


@dataclass(frozen=True)
class Tensors(_Tensor):
    """Any tensor the op's own code interprets (saved statistics): checked to be a tensor (or
    None where optional), nothing more."""

    name: str
    optional: bool = False

    def check(self, value: Any, bound: Mapping[str, Any]) -> Any:
        if value is None and self.optional:
            return None
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{self.name} must be a torch.Tensor, got {type(value).__name__}")
        return value

    def native_check(self, position: Mapping[str, int]) -> tuple:
        return _cpp_check(_TENSORS, self.optional)


@dataclass(frozen=True)
class Ids(Tensors):
    """Integer ids (int32 or int64): with `rows_of`, one per row of that tensor (its shape
    without the last dimension: a cross-entropy's targets); its `<name>_dtype` binds to an
    "index" parameter of the kernel table ("i32" / "i64")."""

    rows_of: str | None = None

    def check(self, value: Any, bound: Mapping[str, Any]) -> Any:
        value = super().check(value, bound)
        if value is None:
            return None
        if value.dtype not in INDEX_NAMES:
            raise TypeError(
                f"{self.name} must be torch.int32 or torch.int64 ids; got {value.dtype}"
            )
        if self.rows_of is not None:
            of = bound[self.rows_of]
            if value.shape != of.shape[:-1]:
                raise ValueError(
                    f"{self.name} must have {self.rows_of}'s shape without its last dimension "
                    f"{tuple(of.shape[:-1])}; got {tuple(value.shape)}"
                )
            if value.device != of.device:
                where = f"{self.rows_of}'s device {of.device}"
                raise ValueError(f"{self.name} must be on {where}; got {value.device}")
        return value

    def native_check(self, position: Mapping[str, int]) -> tuple:
        of = -1 if self.rows_of is None else position[self.rows_of]
        return _cpp_check(_IDS, self.optional, of)


_SCALAR_SCHEMA = {
    "float": "float",
    "bool": "bool",
    "int": "int",
    "SymInt": "SymInt",  # a size, symbolic under torch.compile(dynamic=True)
    "dtype": "ScalarType",
}


@dataclass(frozen=True)
class Scalar:
    """A compile-time scalar: `kind` float, bool, int, SymInt or dtype (a torch float dtype), None
    allowed where `optional`; a float finite. `bounds=(low, high)`: a float's or int's range,
    ends included, None for an open end. `check_value(value, bound)`: a check of its own, run
    instead of these (it may normalise, and its errors are its own); given with `bounds`, it
    states that it accepts exactly the kind's values within them (eps()'s), which the C++
    fast path then checks; without, the op's calls keep its Python check."""

    name: str
    kind: str
    default: Any = _REQUIRED
    optional: bool = False
    check_value: Callable[[Any, Mapping[str, Any]], Any] | None = None
    # In a backward op: the forward input whose "needs a gradient" this bool is (autograd
    # sets it); by default X for a name need_dX.
    need_grad_of: str | None = None
    bounds: tuple[float | None, float | None] | None = None

    def __post_init__(self) -> None:
        if self.kind not in _SCALAR_SCHEMA:
            raise ValueError(f"{self.name}: kind must be one of {sorted(_SCALAR_SCHEMA)}")
        if self.bounds is not None:
            self._check_bounds()

    def _check_bounds(self) -> None:
        number = int if self.kind in ("int", "SymInt") else (int, float)
        given = tuple(self.bounds) if isinstance(self.bounds, (tuple, list)) else ()
        ok = (
            self.kind in ("float", "int", "SymInt")
            and len(given) == 2
            and all(b is None or (isinstance(b, number) and not isinstance(b, bool)) for b in given)
            and not any(isinstance(b, float) and math.isnan(b) for b in given)
        )
        if not ok:
            raise ValueError(
                f"{self.name}: bounds= takes (low, high), each None or a number (an int for an "
                f"int scalar), for a float or int scalar; got {self.bounds!r} for a {self.kind}"
            )
        low, high = given
        if low is not None and high is not None and low > high:
            raise ValueError(f"{self.name}: bounds=({low}, {high}) is empty (low > high)")
        object.__setattr__(self, "bounds", given)

    @property
    def schema_type(self) -> str:
        return _SCALAR_SCHEMA[self.kind] + ("?" if self.optional else "")

    def check(self, value: Any, bound: Mapping[str, Any]) -> Any:
        if self.check_value is not None:
            return self.check_value(value, bound)
        if value is None and self.optional:
            return None
        ok = {
            "float": isinstance(value, (int, float, torch.SymFloat))
            and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "int": isinstance(value, int) and not isinstance(value, bool),
            "SymInt": isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool),
            "dtype": isinstance(value, torch.dtype) and value in DTYPE_NAMES,
        }[self.kind] and (self.kind == "bool" or not isinstance(value, bool))
        if not ok:
            want = {"dtype": "a torch float dtype", "int": "an int", "SymInt": "an int"}
            want = want.get(self.kind, f"a {self.kind}")
            raise TypeError(f"{self.name} must be {want}, got {value!r}")
        if self.kind == "float" and not isinstance(value, torch.SymFloat):
            if not math.isfinite(value):
                raise ValueError(f"{self.name} must be a finite number; got {value}")
            value = float(value)
        if self.bounds is not None:
            self._within_bounds(value)
        return value

    def _within_bounds(self, value: Any) -> None:
        low, high = self.bounds
        if (low is None or value >= low) and (high is None or value <= high):
            return
        if low is None or high is None:
            limit = f">= {low}" if high is None else f"<= {high}"
        else:
            limit = f"in [{low}, {high}]"
        raise ValueError(f"{self.name} must be {limit}; got {value}")

    def native_check(self, position: Mapping[str, int]) -> tuple | None:
        """Its check for the C++ fast path: the kind (and None where optional) and the bounds;
        None where it is a Python function's (check_value without bounds)."""
        if self.check_value is not None and self.bounds is None:
            return None
        low, high = self.bounds or (None, None)
        if not all(b is None or _exact_in_cpp(b, self.kind) for b in (low, high)):
            return None  # C++ compares as int64 / double: a bound it cannot hold stays Python's
        # A check_value decides None itself: the fast path leaves None to it.
        optional = self.optional and self.check_value is None
        return _cpp_check(_SCALAR_CHECKS[self.kind], optional, low=low, high=high)


def _exact_in_cpp(bound: float, kind: str) -> bool:
    """The bound is held exactly by the C++ check's comparison (int64 for ints, else double)."""
    if kind in ("int", "SymInt"):
        return -(2**63) <= bound < 2**63
    try:
        return float(bound) == bound
    except OverflowError:
        return False


def eps(default: Any = _REQUIRED) -> Scalar:
    """A norm's eps, declared once: its schema type, its check, the kernels' `eps`. Its check
    (check_eps: its own messages) accepts a finite float or int >= 0: its bounds."""
    return Scalar(
        "eps",
        "float",
        default,
        check_value=lambda value, bound: check_eps(value),
        bounds=(0.0, None),
    )


Argument = Rows | Like | Feature | Tensors | Ids | Scalar
# Tensors the kernels read as dense arrays (copied when they are not).
_DENSE = (Rows, Like, Feature, Ids)


def _has_data(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() > 0


# ----------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class Out:
    """An output: of `like`'s shape (and its dtype, or `dtype`: "float32" or the name of a
    dtype scalar), or with `rows`, one float32 value per row of that tensor (a statistic,
    flattened to (M,)). `when`: the names that must all hold (a bool scalar true, a dtype
    scalar or a tensor not None) for it to be computed; otherwise it is an empty tensor
    (float32 for a statistic, else of the op's first tensor's dtype), as the kernels return.
    In a backward op, `grad_of` names the forward input it is the gradient of (by default X
    for an output dX). `shape(bound)`: a shape of its own (an embedding's (B, T, C) from the
    ids and the table), `like` then giving its dtype and device."""

    name: str
    like: str | None = None
    rows: str | None = None
    dtype: str | None = None
    when: tuple[str, ...] | str = ()
    # In a backward op: the forward input this is the gradient of; by default X for dX.
    grad_of: str | None = None
    # A shape of its own, from the call (`like` then gives the dtype and device only).
    shape: Callable[[Mapping[str, Any]], tuple] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if (self.like is None) == (self.rows is None):
            raise ValueError(f"output {self.name}: give one of like= and rows=")
        if isinstance(self.when, str):
            object.__setattr__(self, "when", (self.when,))

    def wanted(self, bound: Mapping[str, Any]) -> bool:
        return all(bound[name] is not None and bound[name] is not False for name in self.when)

    def dtype_for(self, bound: Mapping[str, Any]) -> torch.dtype:
        if self.rows is not None or self.dtype == "float32":
            return torch.float32
        if self.dtype is not None and bound[self.dtype] is not None:
            return bound[self.dtype]
        return bound[self.like].dtype  # (an optional dtype scalar given None too)

    def empty(self, first: torch.Tensor) -> torch.Tensor:
        return first.new_empty(0, dtype=torch.float32 if self.rows is not None else None)

    def expected(self, bound: Mapping[str, Any]) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype of this output when wanted: what `allocate` makes (the fake's
        and the launches' outputs), which the CPU kernel holds the reference's to."""
        if self.rows is not None:
            return (row_count(bound[self.rows]),), torch.float32
        shape = bound[self.like].shape if self.shape is None else self.shape(bound)
        return tuple(shape), self.dtype_for(bound)

    def rule(self) -> str:
        """The declaration, as the errors name it: Out('y', like='x', dtype='float32')."""
        given = {"like": self.like, "rows": self.rows, "dtype": self.dtype}
        given = [f"{k}={v!r}" for k, v in given.items() if v is not None]
        if self.shape is not None:
            given.append("shape=...")
        return f"Out({', '.join([repr(self.name), *given])})"

    def allocate(self, bound: Mapping[str, Any], first: torch.Tensor) -> torch.Tensor:
        """A dense tensor for this output (the kernels write dense outputs), or an empty one."""
        if not self.wanted(bound):
            return self.empty(first)
        if self.rows is not None:
            return first.new_empty(row_count(bound[self.rows]), dtype=torch.float32)
        like = bound[self.like]
        shape = like.shape if self.shape is None else self.shape(bound)
        return like.new_empty(shape, dtype=self.dtype_for(bound))
