"""The op table the interpreter's semantics modules fill, and what they read ops with.

`OPS` maps an op name to a maker: `maker(program, o)` reads the op once (its operands' and
results' slots, types and attributes, with the helpers below) and returns the closure
`run(machine)` that computes it on every lane at once. The semantics modules (semantics.py:
arith, math, vector; access.py; threads.py; control.py; lowered.py) register their ops with
`@op(name, ...)` or `OPS[name] = maker`; program.py imports each of them once, so the table
is whole before a kernel is read. This module imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable

from . import types as T
from .types import parse_type

OPS: dict[str, Callable] = {}


def op(*names: str):
    """Register the decorated maker as the meaning of the ops `names`."""

    def register(fn):
        for n in names:
            OPS[n] = fn
        return fn

    return register


def operand_slots(program, o) -> list[int]:
    return [program.slot(v) for v in o.operands]


def result_slots(program, o) -> list[int]:
    return [program.slot(v) for v in o.results]


def result_type(o, i=0) -> T.Type:
    return parse_type(str(o.results[i].type))


def operand_type(o, i=0) -> T.Type:
    return parse_type(str(o.operands[i].type))


def int_attr(o, name) -> int:
    from mlir import ir

    return ir.IntegerAttr(o.attributes[name]).value


def elementwise(fn):
    """The maker of an op whose one result is `fn` of its operands' values, lane by lane
    (the result as its type holds it: see types.as_type)."""

    def maker(program, o):
        ins, (r,) = operand_slots(program, o), result_slots(program, o)
        t = result_type(o)

        def run(m):
            m.vals[r] = T.as_type(fn(*(m.vals[i] for i in ins)), t)

        return run

    return maker
