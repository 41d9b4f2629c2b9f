"""Structured control flow: conditionals and loops that carry values (scf dialect).

The bodies are Python callables run once, at build time, inside the op's region. A branch or
loop body that returns values of other types than the op carries (an if_else whose branches
disagree, a loop whose carried f32 comes back bf16) raises a TypeError naming the function
and both types before the op is finished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlir import ir
from mlir.dialects import scf

from .values import V, _const, _is_integral, cast, describe, need_flag, need_int_scalar, need_v


def _callable(f: object, fn: str, what: str) -> None:
    if not callable(f):
        raise TypeError(f"{fn}: {what} must be a function (a lambda), got {describe(f)}")


def if_then(cond: V, body: Callable[[], None], otherwise: Callable[[], None] | None = None) -> None:
    """Run `body` where `cond` holds (and `otherwise`, if given, where it does not); nothing
    is produced."""
    need_flag(cond, "dsl.if_then")
    _callable(body, "dsl.if_then", "body")
    if otherwise is not None:
        _callable(otherwise, "dsl.if_then", "otherwise")
    op = scf.IfOp(cond.value, [], has_else=otherwise is not None)
    with ir.InsertionPoint(op.then_block):
        body()
        scf.YieldOp([])
    if otherwise is not None:
        with ir.InsertionPoint(op.else_block):
            otherwise()
            scf.YieldOp([])


def _branch_values(v: object, fn: str, what: str) -> list[V]:
    """A branch's result as a list: one V, or a list / tuple of them."""
    values = [v] if isinstance(v, V) else _values(v)
    if not values or not all(isinstance(x, V) for x in values):
        raise TypeError(f"{fn}: {what} must return a V or a list of them, got {describe(v)}")
    return values


def if_else(cond: V, then: Callable[[], object], otherwise: Callable[[], object]):
    """A value: `then()` where `cond` holds, else `otherwise()` (both of one type); or, where
    the branches return lists of values, the list (of the same types, in order)."""
    fn = "dsl.if_else"
    need_flag(cond, fn)
    _callable(then, fn, "then")
    _callable(otherwise, fn, "otherwise")
    # Build `then` first in a scratch op to learn the result types, then the real op.
    probe = scf.IfOp(cond.value, [], has_else=False)
    with ir.InsertionPoint(probe.then_block):
        first = then()
        types = [v.type for v in _branch_values(first, fn, "then()")]
        scf.YieldOp([])
    probe.operation.erase()
    op = scf.IfOp(cond.value, types, has_else=True)
    with ir.InsertionPoint(op.then_block):
        scf.YieldOp([v.value for v in _branch_values(then(), fn, "then()")])
    with ir.InsertionPoint(op.else_block):
        other = _branch_values(otherwise(), fn, "otherwise()")
        got = [v.type for v in other]
        if got != types:
            shown = lambda ts: ts[0] if len(ts) == 1 else f"({', '.join(map(str, ts))})"  # noqa: E731
            raise TypeError(
                f"{fn}: the branches return different types, then() {shown(types)} and "
                f"otherwise() {shown(got)}"
            )
        scf.YieldOp([v.value for v in other])
    results = [V(r) for r in op.results]
    return results[0] if isinstance(first, V) else results


def _values(x: object) -> list | None:
    """`x` as a list if it is a list, tuple or other iterable of values (not a V), else None."""
    if isinstance(x, (V, str, bytes)) or not hasattr(x, "__iter__"):
        return None
    return list(x)


def _carried(carried: Sequence[V], fn: str) -> list[V]:
    values = _values(carried)
    if values is None:
        raise TypeError(f"{fn}: carried must be a list of V, got {describe(carried)}")
    return [need_v(c, fn, f"carried value {i}") for i, c in enumerate(values)]


def _next_carried(out: object, types: list[ir.Type], fn: str) -> list[V]:
    """The body's result, checked against the carried types."""
    if out is None and not types:
        return []
    values = _values(out)
    if values is None:
        raise TypeError(
            f"{fn}: the body must return a list of the {len(types)} carried values, got "
            f"{describe(out)}"
        )
    if len(values) != len(types):
        raise ValueError(
            f"{fn}: the body returned {len(values)} values for {len(types)} carried ones"
        )
    for i, (v, t) in enumerate(zip(values, types, strict=True)):
        if not isinstance(v, V):
            raise TypeError(f"{fn}: the body's carried value {i} must be a V, got {describe(v)}")
        if v.type != t:
            raise TypeError(
                f"{fn}: carried value {i} changes type in the body: {t} in, {v.type} out"
            )
    return values


def _bound(v: V | int, fn: str, what: str) -> V:
    if _is_integral(v):
        return _const(v, "i64", fn)
    return need_int_scalar(v, fn, what)


def loop(
    start: V, stop: V, step: V, carried: Sequence[V], body: Callable[[V, list[V]], Sequence[V]]
) -> list[V]:
    """for i in range(start, stop, step), threading `carried` values through `body`.

    `body(i, carried) -> new carried` (the same number of values, of the same types); returns
    the carried values after the last iteration. Bounds are i64 values (or Python ints); the
    loop runs in index space.
    """
    fn = "dsl.loop"
    bounds = [_bound(v, fn, what) for v, what in ((start, "start"), (stop, "stop"), (step, "step"))]
    carried = _carried(carried, fn)
    _callable(body, fn, "body")
    lo, hi, st = (cast(v, "index", fn).value for v in bounds)
    op = scf.ForOp(lo, hi, st, [c.value for c in carried])
    with ir.InsertionPoint(op.body):
        index = cast(V(op.induction_variable), "i64", fn)
        out = body(index, [V(a) for a in op.inner_iter_args])
        out = _next_carried(out, [c.type for c in carried], fn)
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
    fn = "dsl.while_loop"
    carried = _carried(carried, fn)
    _callable(cond, fn, "cond")
    _callable(body, fn, "body")
    types = [c.type for c in carried]
    op = scf.WhileOp(types, [c.value for c in carried])
    before = op.before.blocks.append(*types)
    with ir.InsertionPoint(before):
        args = [V(a) for a in before.arguments]
        flag = cond(args)
        need_flag(flag, fn, "cond(carried)")
        scf.ConditionOp(flag.value, [a.value for a in args])
    after = op.after.blocks.append(*types)
    with ir.InsertionPoint(after):
        out = _next_carried(body([V(a) for a in after.arguments]), types, fn)
        scf.YieldOp([v.value for v in out])
    return [V(r) for r in op.results]
