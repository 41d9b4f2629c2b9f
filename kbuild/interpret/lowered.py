"""The lowered module (after the target pipeline: NVVM or ROCDL with the LLVM dialect): its
unstructured control flow and the ops the lowering introduces, so that the lowering's own
work (NVIDIA's shfl.sync with its clamp word, AMD's ds_swizzle / ds_bpermute shuffles and
mbcnt lane ids) executes too.

Control flow is a graph of blocks: the branches here return a `regions.Jump` (per lane, the
successor taken and the values passed), and `regions.run_blocks` moves each lane's program
counter by it.
"""

from __future__ import annotations

import numpy as np

from . import types as T
from .op_table import OPS, elementwise, op, operand_slots, result_slots, result_type
from .regions import Jump
from .semantics import MATH, shuffle_maker

# -- control flow ------------------------------------------------------------------------


def _operand_groups(program, o):
    """The operands each successor is given (MLIR's operand segments of a branch)."""
    from mlir import ir

    slots = operand_slots(program, o)
    if o.name == "llvm.br" or o.name == "cf.br":
        return [slots]
    sizes = list(ir.DenseI32ArrayAttr(o.attributes["operandSegmentSizes"]))
    cond, true_n, false_n = sizes[0], sizes[1], sizes[2]
    start = cond
    return [slots[start : start + true_n], slots[start + true_n : start + true_n + false_n]]


@op("llvm.br", "cf.br")
def _br(program, o):
    (args,) = _operand_groups(program, o)

    def run(m):
        return Jump(np.zeros(m.lanes, np.int64), [[m.vals[a] for a in args]])

    return run


@op("llvm.cond_br", "cf.cond_br")
def _cond_br(program, o):
    cond = operand_slots(program, o)[0]
    then_args, else_args = _operand_groups(program, o)

    def run(m):
        target = np.where(m.vals[cond], 0, 1)
        return Jump(target, [[m.vals[a] for a in then_args], [m.vals[a] for a in else_args]])

    return run


# -- the LLVM dialect's values -----------------------------------------------------------


@op("llvm.mlir.poison", "llvm.mlir.undef", "llvm.mlir.zero")
def _poison(program, o):
    (r,) = result_slots(program, o)
    t = result_type(o)

    def run(m):
        m.vals[r] = T.zeros(t, m.lanes)

    return run


@op("llvm.extractelement")
def _extractelement(program, o):
    (v, i), (r,) = operand_slots(program, o), result_slots(program, o)

    def run(m):
        vec = m.vals[v]
        m.vals[r] = vec[np.arange(m.lanes), np.clip(m.vals[i], 0, vec.shape[1] - 1)]

    return run


@op("llvm.insertelement")
def _insertelement(program, o):
    (v, x, i), (r,) = operand_slots(program, o), result_slots(program, o)

    def run(m):
        vec = m.vals[v].copy()
        vec[np.arange(m.lanes), np.clip(m.vals[i], 0, vec.shape[1] - 1)] = m.vals[x]
        m.vals[r] = vec

    return run


def _shuffle_attr_i32(attr):
    from mlir import ir

    return list(ir.DenseI32ArrayAttr(attr))


OPS["llvm.shufflevector"] = shuffle_maker(_shuffle_attr_i32)


for _n, _f in {"smin": np.minimum, "smax": np.maximum}.items():
    OPS[f"llvm.intr.{_n}"] = elementwise(_f)


def _reduce_maker(fn):
    def maker(program, o):
        ins, (r,) = operand_slots(program, o), result_slots(program, o)
        t = result_type(o)

        def run(m):  # in order from the start value (no reassoc flag: LLVM's order)
            *start, v = (m.vals[i] for i in ins)
            vec = v
            acc = start[0] if start else vec[:, 0]
            with np.errstate(all="ignore"):
                for j in range(0 if start else 1, vec.shape[1]):
                    acc = T.as_float(fn(acc, vec[:, j]), t.name)
            m.vals[r] = acc

        return run

    return maker


for _n, _f in {
    "fadd": np.add,
    "fmul": np.multiply,
    "fmax": np.fmax,
    "fmin": np.fmin,
    "fmaximum": np.maximum,
    "fminimum": np.minimum,
}.items():
    OPS[f"llvm.intr.vector.reduce.{_n}"] = _reduce_maker(_f)


@op("llvm.call")
def _call(program, o):
    """Calls into the vendor math library (libdevice's __nv_*, ROCm's __ocml_*)."""
    from mlir import ir

    callee = ir.FlatSymbolRefAttr(o.attributes["callee"]).value
    name = callee.removeprefix("__nv_").removeprefix("__ocml_")
    name = name.rsplit("_f32", 1)[0]
    fn = MATH.get(name) or MATH.get(name.removesuffix("f"))
    if fn is None:
        raise NotImplementedError(f"the interpreter does not know the function {callee}")
    return elementwise(fn)(program, o)


# -- NVVM ----------------------------------------------------------------------------------


def _sreg(read):
    def maker(program, o):
        (r,) = result_slots(program, o)

        def run(m):
            m.vals[r] = read(m).astype(np.int64)

        return run

    return maker


OPS["nvvm.read.ptx.sreg.tid.x"] = _sreg(lambda m: m.tid)
OPS["nvvm.read.ptx.sreg.ctaid.x"] = _sreg(lambda m: m.bid[0])
OPS["nvvm.read.ptx.sreg.ctaid.y"] = _sreg(lambda m: m.bid[1])
OPS["nvvm.read.ptx.sreg.ctaid.z"] = _sreg(lambda m: m.bid[2])
OPS["nvvm.read.ptx.sreg.nctaid.x"] = _sreg(lambda m: np.full(m.lanes, m.grid[0]))
OPS["nvvm.read.ptx.sreg.nctaid.y"] = _sreg(lambda m: np.full(m.lanes, m.grid[1]))
OPS["nvvm.read.ptx.sreg.ntid.x"] = _sreg(lambda m: np.full(m.lanes, m.block))
OPS["nvvm.read.ptx.sreg.laneid"] = _sreg(lambda m: m.tid % m.warp_size)


@op("nvvm.shfl.sync")
def _shfl_sync(program, o):
    """PTX shfl.sync: c = ((32 - width) << 8) | clamp; lanes outside [min, max] keep their
    own value (PTX ISA, shfl.sync's pseudo-code)."""
    (_mask, v, b, c), outs = operand_slots(program, o), result_slots(program, o)
    kind = str(o.attributes["kind"]).rstrip(">").split()[-1].split("<")[-1]
    pair = "return_value_and_is_valid" in o.attributes
    if pair:
        raise NotImplementedError("nvvm.shfl.sync returning its predicate")
    (r,) = outs

    def run(m):
        lane = m.tid % 32
        bval, cval = m.vals[b] & 31, m.vals[c] & 31
        segmask = (m.vals[c] >> 8) & 31
        max_lane = (lane & segmask) | (cval & ~segmask)
        min_lane = lane & segmask
        if kind == "bfly":
            j = lane ^ bval
            ok = j <= max_lane
        elif kind == "down":
            j = lane + bval
            ok = j <= max_lane
        elif kind == "up":
            j = lane - bval
            ok = j >= max_lane
        else:
            j = min_lane | (bval & ~segmask)
            ok = j <= max_lane
        j = np.where(ok, j, lane)
        m.vals[r] = m.vals[v][np.arange(m.lanes) - lane + j]

    return run


# -- ROCDL ---------------------------------------------------------------------------------

OPS["rocdl.workitem.id.x"] = OPS["nvvm.read.ptx.sreg.tid.x"]
OPS["rocdl.workgroup.id.x"] = OPS["nvvm.read.ptx.sreg.ctaid.x"]
OPS["rocdl.workgroup.id.y"] = OPS["nvvm.read.ptx.sreg.ctaid.y"]
OPS["rocdl.workgroup.id.z"] = OPS["nvvm.read.ptx.sreg.ctaid.z"]
OPS["rocdl.grid.dim.x"] = OPS["nvvm.read.ptx.sreg.nctaid.x"]
OPS["rocdl.grid.dim.y"] = OPS["nvvm.read.ptx.sreg.nctaid.y"]


@op("rocdl.mbcnt.lo", "rocdl.mbcnt.hi")
def _mbcnt(program, o):
    """Bits of `mask` set below this lane (lo: lanes 0-31, hi: 32-63), plus `base`."""
    (mask, base), (r,) = operand_slots(program, o), result_slots(program, o)
    high = o.name.endswith("hi")

    def run(m):
        lane = m.tid % m.warp_size
        below = np.clip(lane - (32 if high else 0), 0, 32)
        bits = T.unsigned(m.vals[mask], 32)
        low_bits = bits & ((np.int64(1) << below) - 1)
        counts = np.array([bin(int(x)).count("1") for x in low_bits], np.int64)
        m.vals[r] = T.wrap(counts + m.vals[base], 32)

    return run


@op("rocdl.ds_bpermute")
def _ds_bpermute(program, o):
    """Lane i reads `data` of lane (address[i] / 4) mod 64 of its wave."""
    (addr, data), (r,) = operand_slots(program, o), result_slots(program, o)

    def run(m):
        lane = m.tid % m.warp_size
        source = (m.vals[addr] // 4) % m.warp_size
        m.vals[r] = m.vals[data][np.arange(m.lanes) - lane + source]

    return run


@op("rocdl.ds_swizzle")
def _ds_swizzle(program, o):
    """The swizzle pattern in `offset`: bit 15 set, four 2-bit lane selectors within each
    quad; clear, the bitmask mode over 32 lanes: ((lane & and) | or) ^ xor."""
    (data, offset), (r,) = operand_slots(program, o), result_slots(program, o)

    def run(m):
        lane = m.tid % m.warp_size
        off = m.vals[offset]
        quad = (off >> 15) & 1
        within = lane & 31
        and_mask, or_mask, xor_mask = off & 31, (off >> 5) & 31, (off >> 10) & 31
        bitmask = (lane & ~31) | ((((within & and_mask) | or_mask) ^ xor_mask) & 31)
        sel = (off >> (2 * (lane & 3))) & 3
        quadperm = (lane & ~3) | sel
        source = np.where(quad == 1, quadperm, bitmask)
        m.vals[r] = m.vals[data][np.arange(m.lanes) - lane + source]

    return run
