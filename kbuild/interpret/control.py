"""Structured control flow under masks: scf.if, scf.for, scf.while (the builder's module)."""

from __future__ import annotations

import numpy as np

from .op_table import op, operand_slots, result_slots
from .regions import region, run_region


def _where(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.ndim > c.ndim:
        c = c.reshape(c.shape + (1,) * (a.ndim - c.ndim))
    return np.where(c, a, b)


@op("scf.yield", "scf.condition", "gpu.return", "llvm.return", "gpu.terminator")
def _yield(program, o):
    ins = operand_slots(program, o)

    def run(m):
        return [m.vals[i] for i in ins]

    return run


@op("scf.if")
def _if(program, o):
    (c,) = operand_slots(program, o)
    outs = result_slots(program, o)
    then = region(program, o.regions[0])
    other = region(program, o.regions[1]) if len(o.regions[1].blocks) else None

    def run(m):
        mask = m.mask
        cond = m.vals[c]
        taken = mask & cond
        rest = mask & ~cond
        got_then = got_else = None
        if taken.any():
            m.mask = taken
            got_then = run_region(then, m)
        if other is not None and rest.any():
            m.mask = rest
            got_else = run_region(other, m)
        m.mask = mask
        for k, r in enumerate(outs):
            if got_then is None:
                m.vals[r] = got_else[k]
            elif got_else is None:
                m.vals[r] = got_then[k]
            else:
                m.vals[r] = _where(cond, got_then[k], got_else[k])

    return run


def _uniform(x: np.ndarray, mask: np.ndarray):
    v = x[mask]
    return int(v[0]) if v.size and (v == v[0]).all() else None


@op("scf.for")
def _for(program, o):
    ins, outs = operand_slots(program, o), result_slots(program, o)
    lb, ub, step, inits = ins[0], ins[1], ins[2], ins[3:]
    body = region(program, o.regions[0])
    iv, carried = body.args[0][0], body.args[0][1:]

    def run(m):
        mask = m.mask
        for slot, init in zip(carried, inits, strict=True):
            m.vals[slot] = m.vals[init]
        lo, hi, st = m.vals[lb], m.vals[ub], m.vals[step]
        bounds = [_uniform(x, mask) for x in (lo, hi, st)]
        if None not in bounds:  # every lane takes the same trip
            a, b, s = bounds
            for i in range(a, b, s):
                m.vals[iv] = np.full(m.lanes, i, np.int64)
                got = run_region(body, m)
                for slot, v in zip(carried, got, strict=True):
                    m.vals[slot] = v
        else:
            i = lo.copy()
            active = mask & (i < hi)
            while active.any():
                m.mask = active
                m.vals[iv] = i
                got = run_region(body, m)
                for slot, v in zip(carried, got, strict=True):
                    m.vals[slot] = _where(active, v, m.vals[slot])
                i = np.where(active, i + st, i)
                active = active & (i < hi)
            m.mask = mask
        for r, slot in zip(outs, carried, strict=True):
            m.vals[r] = m.vals[slot]

    return run


@op("scf.while")
def _while(program, o):
    ins, outs = operand_slots(program, o), result_slots(program, o)
    before = region(program, o.regions[0])
    after = region(program, o.regions[1])

    def run(m):
        mask = m.mask
        for slot, init in zip(before.args[0], ins, strict=True):
            m.vals[slot] = m.vals[init]
        active = mask.copy()
        results = [None] * len(outs)
        while True:
            m.mask = active
            got = run_region(before, m)
            cond, forwarded = got[0], got[1:]
            leaving = active & ~cond
            for k, v in enumerate(forwarded):
                results[k] = v.copy() if results[k] is None else _where(leaving, v, results[k])
            active = active & cond
            if not active.any():
                break
            m.mask = active
            for slot, v in zip(after.args[0], forwarded, strict=True):
                m.vals[slot] = v
            got = run_region(after, m)
            for slot, v in zip(before.args[0], got, strict=True):
                m.vals[slot] = _where(active, v, m.vals[slot])
        m.mask = mask
        for r, v in zip(outs, results, strict=True):
            m.vals[r] = v

    return run
