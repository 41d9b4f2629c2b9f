"""Softmax and log-softmax over rows, forward and backward (kbuild/kernels/softmax/op.py is the op).

One row per block (or cluster) as `row_plan.plan_rows` chooses, rows of any width (odd N
peeled by the row layer), fp32 math whatever the storage dtype:

    m, s = online (max, sum of exp(x - m)) over the row      (one reduction, softmax_pair)
    softmax:      y  = exp(x - m) / s            dx = y (dy - sum(y dy))
    log_softmax:  y  = x - m - log(s)            dx = dy - exp(y) sum(dy)

The forwards read x once (twice for rows chunked through registers: the second pass takes
exp again) and write y in `out_dtype` (None: x's dtype; the op's `dtype=` argument where
casting x to it first is exact, fp32 or x's own). The backwards read the saved output y and
its gradient dy once (twice when chunked) and write dx in y's dtype.
"""

from __future__ import annotations

from ...plan.rows import row_kernel
from ...registry import Arg, Param, kernel

ROW = (Param("N", "int", bounds=(1, None)), Param("dtype", "dtype"))
FWD_PARAMS = (*ROW, Param("out_dtype", "dtype?", None), Param("vectorize", "bool", True))
BWD_PARAMS = (*ROW, Param("vectorize", "bool", True))
FWD_ARGS = (Arg("x"), Arg("y"), Arg("M", "i64"))
BWD_ARGS = (Arg("y"), Arg("dy"), Arg("dx"), Arg("M", "i64"))


def _forward(name: str, log: bool, N, dtype, target, out_dtype, vectorize):
    """The shared forward: the row's (max, sum of exp) by one online reduction, then y."""
    from kbuild.dsl import (
        NEG_INF,
        RowTile,
        const,
        eq,
        exp,
        maximum,
        select,
        softmax_pair,
        thread_max,
        thread_sum,
    )
    from kbuild.dsl import log as ln

    out = out_dtype or dtype
    k, row = row_kernel(name, N, dtype, target, vectorize=vectorize, online=True)
    with k:
        x, y, M = k.ptr("x"), k.ptr("y"), k.i64("M")
        t = RowTile(k, row, M)
        v = t.values(x, dtype, pad=NEG_INF)  # columns past N: -inf, which exp makes 0

        if row.chunked:  # each chunk read twice: y is taken from x again

            def own(c, state):  # this thread's (max, sum) with a chunk's columns added
                m = maximum(state[0], thread_max(v(c)))
                safe = select(eq(m, NEG_INF), 0.0, m)  # a thread that holds only padding
                e = thread_sum([exp(a - safe) for a in v(c)])
                return [m, state[1] * exp(state[0] - safe) + e]

            m, s = t.reduce(t.over_chunks(own, [const(NEG_INF), const(0.0)]), softmax_pair)
            if log:  # (x - m) - log s: x - lse rounds lse at the logits' magnitude
                log_s = ln(s)
                write = lambda c: [(a - m) - log_s for a in v(c)]  # noqa: E731
            else:
                write = lambda c: [exp(a - m) * (1.0 / s) for a in v(c)]  # noqa: E731
        else:  # exp(x - own max) held, rescaled once to the row's max
            m_own = thread_max(v(0))
            safe = select(eq(m_own, NEG_INF), 0.0, m_own)  # a thread that holds only padding
            e = [exp(a - safe) for a in v(0)]
            m, s = t.reduce([m_own, thread_sum(e)], softmax_pair)
            if log:  # (x - m) - log s: x - lse rounds lse at the logits' magnitude
                log_s = ln(s)
                write = lambda c: [(a - m) - log_s for a in v(c)]  # noqa: E731
            else:
                # exp(m_own - m) <= 1 (not exp(safe - m), which overflows for a thread of
                # -inf values in a row whose maximum is below -88: 0 * inf = NaN)
                scale = exp(m_own - m) * (1.0 / s)
                write = lambda c: [a * scale for a in e]  # noqa: E731
        t.over_chunks(lambda c, _: t.store(y, write(c), out, c) or [])
    return k


@kernel("softmax_fwd", params=FWD_PARAMS, args=FWD_ARGS)
def build_softmax_fwd(N, dtype, target, out_dtype=None, vectorize=True):
    """y = exp(x - max x) / sum(exp(x - max x)) along rows of N, y in `out_dtype` (or x's)."""
    return _forward("softmax_fwd", False, N, dtype, target, out_dtype, vectorize)


@kernel("log_softmax_fwd", params=FWD_PARAMS, args=FWD_ARGS)
def build_log_softmax_fwd(N, dtype, target, out_dtype=None, vectorize=True):
    """y = x - max x - log(sum(exp(x - max x))) along rows of N, y in `out_dtype` (or x's)."""
    return _forward("log_softmax_fwd", True, N, dtype, target, out_dtype, vectorize)


def _backward(name: str, log: bool, N, dtype, target, vectorize):
    """The shared backward: one row sum (y dy, or dy), then dx."""
    from kbuild.dsl import RowTile, const, exp, thread_sum

    k, row = row_kernel(name, N, dtype, target, vectorize=vectorize, rows_held=2)
    with k:
        yp, dyp, dxp, M = k.ptr("y"), k.ptr("dy"), k.ptr("dx"), k.i64("M")
        t = RowTile(k, row, M)
        y, dy = t.values(yp, dtype), t.values(dyp, dtype)  # padding 0: adds nothing
        pairs = lambda c: zip(y(c), dy(c), strict=True)  # noqa: E731
        if log:  # sum(dy); dx = dy - exp(y) sum(dy)
            part = lambda c: thread_sum(dy(c))  # noqa: E731
            grad = lambda c, d: [b - exp(a) * d for a, b in pairs(c)]  # noqa: E731
        else:  # sum(y dy); dx = y (dy - sum(y dy))
            part = lambda c: thread_sum([a * b for a, b in pairs(c)])  # noqa: E731
            grad = lambda c, d: [a * (b - d) for a, b in pairs(c)]  # noqa: E731
        total = t.over_chunks(lambda c, acc: [acc[0] + part(c)], [const(-0.0)])
        (d,) = t.sum(*total)
        t.over_chunks(lambda c, _: t.store(dxp, grad(c, d), dtype, c) or [])
    return k


@kernel("softmax_bwd", params=BWD_PARAMS, args=BWD_ARGS)
def build_softmax_bwd(N, dtype, target, vectorize=True):
    """dx = y (dy - sum(y dy)) along rows, from softmax's output y."""
    return _backward("softmax_bwd", False, N, dtype, target, vectorize)


@kernel("log_softmax_bwd", params=BWD_PARAMS, args=BWD_ARGS)
def build_log_softmax_bwd(N, dtype, target, vectorize=True):
    """dx = dy - exp(y) sum(dy) along rows, from log_softmax's output y."""
    return _backward("log_softmax_bwd", True, N, dtype, target, vectorize)
