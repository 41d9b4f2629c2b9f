"""Structured control flow: conditionals and loops that carry values (scf dialect)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlir import ir
from mlir.dialects import scf

from .values import V, cast


def if_then(cond: V, body: Callable[[], None]) -> None:
    """Run `body` where `cond` holds; nothing is produced."""
    op = scf.IfOp(cond.value)
    with ir.InsertionPoint(op.then_block):
        body()
        scf.YieldOp([])


def if_else(cond: V, then: Callable[[], V], otherwise: Callable[[], V]) -> V:
    """A value: `then()` where `cond` holds, else `otherwise()` (both of one type)."""
    # Build `then` first in a scratch op to learn the result type, then the real op.
    probe = scf.IfOp(cond.value, [], has_else=False)
    with ir.InsertionPoint(probe.then_block):
        result_type = then().type
        scf.YieldOp([])
    probe.operation.erase()
    op = scf.IfOp(cond.value, [result_type], has_else=True)
    with ir.InsertionPoint(op.then_block):
        scf.YieldOp([then().value])
    with ir.InsertionPoint(op.else_block):
        scf.YieldOp([otherwise().value])
    return V(op.results[0])


def loop(
    start: V, stop: V, step: V, carried: Sequence[V], body: Callable[[V, list[V]], Sequence[V]]
) -> list[V]:
    """for i in range(start, stop, step), threading `carried` values through `body`.

    `body(i, carried) -> new carried`; returns the carried values after the last iteration.
    Bounds are i64 values; the loop runs in index space.
    """
    lo, hi, st = (cast(v, "index").value for v in (start, stop, step))
    op = scf.ForOp(lo, hi, st, [c.value for c in carried])
    with ir.InsertionPoint(op.body):
        index = cast(V(op.induction_variable), "i64")
        out = body(index, [V(a) for a in op.inner_iter_args])
        scf.YieldOp([v.value for v in out])
    return [V(r) for r in op.results]


def while_loop(
    carried: Sequence[V],
    cond: Callable[[list[V]], V],
    body: Callable[[list[V]], Sequence[V]],
) -> list[V]:
    """while cond(carried): carried = body(carried); returns the carried values at exit.

    For loops whose trip count is data (a run of equal token ids): `cond` and `body` see the
    current values; `body` returns the next ones, of the same types."""
    types = [c.type for c in carried]
    op = scf.WhileOp(types, [c.value for c in carried])
    before = op.before.blocks.append(*types)
    with ir.InsertionPoint(before):
        args = [V(a) for a in before.arguments]
        scf.ConditionOp(cond(args).value, [a.value for a in args])
    after = op.after.blocks.append(*types)
    with ir.InsertionPoint(after):
        out = body([V(a) for a in after.arguments])
        scf.YieldOp([v.value for v in out])
    return [V(r) for r in op.results]
