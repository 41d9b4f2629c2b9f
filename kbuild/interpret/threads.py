"""Threads, blocks and clusters: ids, barriers, warp shuffles, mbarriers and inline asm."""

from __future__ import annotations

import numpy as np

from . import types as T
from .access import write
from .memory import Mbarrier, cluster_address, split_cluster_address
from .op_table import OPS, op, operand_slots, result_slots, result_type

_DIMS = {"x": 0, "y": 1, "z": 2}


def _dimension(o) -> int:
    return _DIMS[str(o.attributes["dimension"]).rstrip(">").split()[-1]]


def _dimension_maker(read):
    """gpu.thread_id / block_id / grid_dim / block_dim: `read(machine, dimension)`."""

    def maker(program, o):
        (r,) = result_slots(program, o)
        d = _dimension(o)

        def run(m):
            m.vals[r] = np.asarray(read(m, d), np.int64) + np.zeros(m.lanes, np.int64)

        return run

    return maker


OPS["gpu.thread_id"] = _dimension_maker(lambda m, d: m.tid if d == 0 else 0)
OPS["gpu.block_id"] = _dimension_maker(lambda m, d: m.bid[d])
OPS["gpu.grid_dim"] = _dimension_maker(lambda m, d: m.grid[d])
OPS["gpu.block_dim"] = _dimension_maker(lambda m, d: m.block if d == 0 else 1)


@op("gpu.lane_id")
def _lane_id(program, o):
    (r,) = result_slots(program, o)

    def run(m):
        m.vals[r] = m.tid % m.warp_size

    return run


@op("gpu.barrier", "nvvm.barrier0", "nvvm.barrier", "rocdl.barrier", "rocdl.s.barrier")
def _barrier(program, o):
    def run(m):
        m.barrier()

    return run


@op("nvvm.cluster.arrive", "nvvm.cluster.arrive.relaxed")
def _cluster_arrive(program, o):
    def run(m):  # lockstep: every thread arrives now; the wait checks they all did
        m.check_uniform("cluster arrive", m.block * m.cluster)

    return run


@op("nvvm.cluster.wait")
def _cluster_wait(program, o):
    def run(m):
        m.cluster_barrier()

    return run


@op("nvvm.read.ptx.sreg.cluster.ctarank")
def _ctarank(program, o):
    (r,) = result_slots(program, o)

    def run(m):
        m.vals[r] = m.rank.copy()

    return run


@op("nvvm.mapa")
def _mapa(program, o):
    (p, rank), (r,) = operand_slots(program, o), result_slots(program, o)

    def run(m):
        m.vals[r] = cluster_address(m.vals[rank], m.vals[p])

    return run


_SHUFFLE_MODES = ("xor", "down", "up", "idx")


@op("gpu.shuffle")
def _shuffle(program, o):
    (v, offset, width), (r, valid) = operand_slots(program, o), result_slots(program, o)
    mode = str(o.attributes["mode"]).rstrip(">").split()[-1]
    if mode not in _SHUFFLE_MODES:
        raise NotImplementedError(f"gpu.shuffle {mode}")

    def run(m):
        lane = m.tid % m.warp_size
        w, off = m.vals[width], m.vals[offset]
        segment = lane - lane % w
        if mode == "xor":
            src = lane ^ off
            ok = (src - segment >= 0) & (src - segment < w)
        elif mode == "down":
            src = lane + off
            ok = src - segment < w
        elif mode == "up":
            src = lane - off
            ok = src >= segment
        else:
            src = segment + off
            ok = off < w
        source = np.where(ok, np.arange(m.lanes) - lane + src, np.arange(m.lanes))
        values = m.vals[v]
        m.vals[r] = values[source]
        m.vals[valid] = ok

    return run


# -- mbarriers (the state the inline PTX of dsl/mbarrier.py acts on) ----------------------


def _bars(m, lanes, addr):
    """(owner block, offset) pairs of mbarrier addresses (local or mapa'd remote)."""
    rank, offset = split_cluster_address(addr)
    local = m.local_block[lanes]
    return np.where(rank >= 0, local - m.rank[lanes] + rank, local), offset


def mbarrier_init(m, bar, count) -> None:
    lanes = np.nonzero(m.mask)[0]
    owner, offset = _bars(m, lanes, bar[lanes])
    for b, a, n in zip(owner, offset, count[lanes], strict=True):
        m.smem.mbarriers[(int(b), int(a))] = Mbarrier(int(n))


def _barrier_at(m, b, a, lane):
    bar = m.smem.mbarriers.get((int(b), int(a)))
    if bar is None:
        raise m.fault(f"mbarrier at shared address {int(a):#x} used before its init", int(lane))
    return bar


def arrive_expect_tx(m, bar, nbytes) -> None:
    lanes = np.nonzero(m.mask)[0]
    owner, offset = _bars(m, lanes, bar[lanes])
    for lane, b, a, n in zip(lanes, owner, offset, nbytes[lanes], strict=True):
        state = _barrier_at(m, b, a, lane)
        state.tx += int(n)
        state.pending -= 1
        state.settle()


def wait_parity(m, bar, parity) -> None:
    """Lockstep has every thread of the cluster here: a phase not complete now never
    completes (on the GPU: a hang)."""
    lanes = np.nonzero(m.mask)[0]
    owner, offset = _bars(m, lanes, bar[lanes])
    keys = {}
    for lane, b, a, p in zip(lanes, owner, offset, parity[lanes], strict=True):
        state = _barrier_at(m, b, a, lane)
        if state.phase % 2 == int(p) % 2:  # the phase of this parity has not completed
            raise m.fault(
                f"mbarrier wait at shared address {int(a):#x} (parity {int(p) % 2}) can never "
                f"complete: {state.pending} arrivals and {state.tx} bytes still missing when "
                "every thread waits (a hang on the GPU)",
                int(lane),
            )
        keys[int(b)] = True
    for b in keys:  # the wait orders what the phase's stores wrote before it
        m.smem.epoch[b] += 1


def store_async(m, slot, value, bar, rank) -> None:
    """st.async of 4 bytes into block `rank`'s copy of `slot`, counted on its `bar`."""
    lanes = np.nonzero(m.mask)[0]
    if not lanes.size:
        return
    slot_there, bar_there = (cluster_address(rank[lanes], a[lanes]) for a in (slot, bar))
    i32 = T.parse_type("i32")
    write(m, T.SHARED_CLUSTER, lanes, slot_there, value[lanes], i32, 4, "st.async")
    owner, offset = _bars(m, lanes, bar_there)
    for lane, b, a in zip(lanes, owner, offset, strict=True):
        state = _barrier_at(m, b, a, lane)
        state.tx -= 4
        state.settle()


@op("llvm.inline_asm")
def _inline_asm(program, o):
    from mlir import ir

    from ..dsl.asm_semantics import lookup

    text = ir.StringAttr(o.attributes["asm_string"]).value
    meaning = lookup(text)
    if meaning is None:
        raise NotImplementedError(
            f"the interpreter has no semantics for the inline asm {text!r}: register them "
            "beside the helper that emits it (kbuild.dsl.asm_semantics.register)"
        )
    ins, outs = operand_slots(program, o), result_slots(program, o)
    types = [result_type(o, i) for i in range(len(outs))]

    def run(m):
        got = meaning(m, *(m.vals[i] for i in ins))
        for r, t, v in zip(outs, types, got or (), strict=False):
            m.vals[r] = T.wrap(v, t.width) if t.kind == "int" else v

    return run
