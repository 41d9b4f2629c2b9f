"""QK-norm and rotary position embedding over q and k in one pass, forward and backward
(kbuild/kernels/rope/qk_norm.py is the op, its layouts and its checks).

For a head vector x of D features at position (b, t), its side's weight w (q's or k's) and
the position's c = cos[b, t], s = sin[b, t] (D entries each: full rotary), fp32 math and one
rounding at the output:

    rstd = 1 / sqrt(sum(x^2) / D + eps)               (RMSNorm over the head, as rmsnorm.py)
    n    = x * rstd * (offset + w)                    (Gemma 3: offset 1, added in fp32)
    y    = c n + R(n) s                               (RoPE, R and the pairs as rope.py)

Backward, from dy and the saved x and rstd (x_hat = x * rstd):

    dn = c dy - R(s dy)                               (the rotation's transpose: rope.py's inverse)
    g  = dn * (offset + w)
    dx = (g - x_hat * sum(g * x_hat) / D) * rstd      (rmsnorm_bwd.py's, with dn for dy)
    dw = sum over positions and heads of dn * x_hat

The cover (`HeadCover`): a head is `units` units of `width` elements (rotate-half: a vector
of the first half and its partner D / 2 further; interleaved: one vector of adjacent pairs),
held by `lanes` threads, a power of two up to 32 (the largest dividing `units`), lane l
taking units l, l + lanes, ...: consecutive lanes read consecutive vectors, and a head's lanes
are an aligned group of a warp on every target, so its sums are `dsl.group_reduce`'s
butterflies, no shared memory. A block of 128 threads holds heads_per_pass = 128 / lanes
heads at once; slot tid // lanes takes heads slot, slot + heads_per_pass, ... of q and then of
k, each side in ceil(H / heads_per_pass) passes for every thread, so a warp's shuffles are
never divergent: a head past H is computed on head H - 1 and stores nothing. A thread's
cos / sin and weights stay in registers across its heads.

Forward grid: one block per position (B * T), as rope.py. Backward grid: G blocks (at most
`BLOCKS`), block g walking positions g, g + G, ...; each thread adds its columns' dw terms
over its heads in fp32 registers, then the block adds its slots in slot order through shared
memory into row g of an fp32 (2, G, D) workspace (q's plane, k's plane), which
reduce.py's column sum adds in row order: dq_weight and dk_weight are bitwise repeatable, no
atomics.

Tensors are read and written at the strides the launch passes (elements, i64: batch, head,
position; cos / sin batch and position, batch 0 where shared), so q and k are the transposed
views of a projection, or of a fused qkv projection, read in place. `vec` is what the launch
found every stride, offset and pointer a multiple of (16 bytes at most).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...dtypes import ELEMENT_BYTES
from ...registry import Arg, Param, kernel
from .kernels import _partner_sines, _turned

THREADS = 128  # a block: heads_per_pass * lanes
MAX_LANES = 32  # a head's lanes: within one warp on NVIDIA (32) and CDNA (64)
MAX_ELEMENTS = 32  # a thread's elements of one head: its registers, the backward's shared memory
# The backward's elements a thread where a narrower vector gives them (the launch narrows to
# it): register pressure, bench/NOTES.md ("QK-norm + RoPE").
BWD_ELEMENTS = 8
BLOCKS = 1024  # the backward's grid at most, and so the rows of its dw workspace

_SIDES = ("q", "k")
_DTYPES = (Param("D", "int", bounds=(2, None)), Param("dtype", "dtype"),
           Param("w_dtype", "dtype"), Param("cs_dtype", "dtype"))  # fmt: skip
_LAYOUT = (Param("offset", "float", 0.0), Param("interleaved", "bool", False))
_VEC = Param("vec", "int", 1, bounds=(1, 8))
FWD_PARAMS = (
    *_DTYPES,
    Param("eps", "float", bounds=(0.0, None)),
    *_LAYOUT,
    Param("store_rstd", "bool", True),
    _VEC,
)
BWD_PARAMS = (*_DTYPES, *_LAYOUT, Param("weight_grad", "bool", True), _VEC)


def _strides(names, when=None):
    """(batch, head, position) strides of each tensor of `names` (cos / sin: batch, position)."""
    return tuple(
        Arg(f"{n}_s{d}", "i64", when)
        for n in names
        for d in ("bt" if n in ("cos", "sin") else "bht")
    )


_INPUTS = (Arg("q"), Arg("k"), Arg("q_weight"), Arg("k_weight"), Arg("cos"), Arg("sin"))
_HEADS = (Arg("T", "i64"), Arg("Hq", "i64"), Arg("Hk", "i64"))
FWD_ARGS = (
    *_INPUTS,
    Arg("q_out"),
    Arg("k_out"),
    Arg("q_rstd", when="store_rstd"),
    Arg("k_rstd", when="store_rstd"),
    *_HEADS,
    *_strides(("q", "k", "q_out", "k_out")),
    *_strides(("q_rstd", "k_rstd"), "store_rstd"),
    *_strides(("cos", "sin")),
)
_N_FWD_STRIDES = 3 * 6 + 2 * 2  # the strides close the arguments
BWD_ARGS = (
    *_INPUTS,
    Arg("q_rstd"),
    Arg("k_rstd"),
    Arg("dq_out"),
    Arg("dk_out"),
    Arg("dq"),
    Arg("dk"),
    Arg("dw_partial", when="weight_grad"),
    Arg("P", "i64"),
    *_HEADS,
    *_strides(("q", "k", "dq_out", "dk_out", "dq", "dk", "q_rstd", "k_rstd", "cos", "sin")),
)
_N_BWD_STRIDES = 3 * 8 + 2 * 2


@dataclass(frozen=True)
class HeadCover:
    """How a block's threads cover a head (module docstring). Pure Python: the builders' and
    the tests' one description."""

    D: int
    interleaved: bool
    vec: int
    width: int  # elements of one access
    units: int
    lanes: int

    @property
    def per_lane(self) -> int:
        return self.units // self.lanes

    @property
    def heads_per_pass(self) -> int:
        return THREADS // self.lanes

    @property
    def parts(self) -> int:
        """Accesses of `width` elements a thread makes per head: one per unit, or two
        (a vector and its partner) in rotate-half."""
        return self.per_lane * (1 if self.interleaved else 2)

    @property
    def elements(self) -> int:
        return self.parts * self.width

    def columns(self, lane):
        """The first column of each of a lane's accesses (an int or an i64 value), in the
        order the kernels hold them: per unit, its vector (and its partner)."""
        out = []
        for j in range(self.per_lane):
            column = (lane + j * self.lanes) * self.width
            out += [column] if self.interleaved else [column, column + self.D // 2]
        return out


def head_cover(D: int, dtype: str, interleaved: bool, vec: int) -> HeadCover:
    """The cover of one head, or a ValueError naming what does not fit."""
    if D % 2 or D < 2:
        raise ValueError(f"qk_norm_rope: D must be even and >= 2; got {D}")
    widest = 16 // ELEMENT_BYTES[dtype]
    if vec < 1 or vec & (vec - 1) or vec > widest:
        raise ValueError(
            f"qk_norm_rope: vec must be a power of two <= {widest} for {dtype}; got {vec}"
        )
    width = max(vec, 2) if interleaved else vec  # interleaved pairs: two elements at least
    span = D if interleaved else D // 2
    if span % width:
        raise ValueError(f"qk_norm_rope: vec {vec} must divide {span} (D = {D})")
    units = span // width
    cover = HeadCover(D, interleaved, vec, width, units, min(units & -units, MAX_LANES))
    if cover.elements > MAX_ELEMENTS:
        raise ValueError(
            f"qk_norm_rope: a head of D = {D} takes {cover.elements} elements a thread at vec "
            f"{vec} ({cover.lanes} lanes a head); at most {MAX_ELEMENTS}"
        )
    return cover


class _Block:
    """A block's threads on the cover: their lane and slot, their accesses of a head, their
    heads of one side, the rotation of their values."""

    def __init__(self, k, cover: HeadCover, strides: dict):
        self.k, self.cover, self.s = k, cover, strides
        tid = k.thread_id()
        self.lane, self.slot = tid % cover.lanes, tid / cover.lanes
        self.cols = cover.columns(self.lane)
        self.aligned = cover.width == cover.vec  # interleaved pairs of a vec-1 launch: unaligned

    def read(self, base, at, dtype):
        """This thread's elements of a row starting at element `at`: f32, one list per access."""
        from kbuild.dsl import get_llvm_ptr, lanes, load, to_f32

        w, ok = self.cover.width, self.aligned
        return [lanes(to_f32(load(get_llvm_ptr(base, at + c, dtype), dtype, w, aligned=ok)))
                for c in self.cols]  # fmt: skip

    def write(self, values, base, at, dtype):
        from kbuild.dsl import cast, from_lanes, get_llvm_ptr, store

        for c, v in zip(self.cols, values, strict=True):
            store(
                cast(from_lanes(v), dtype), get_llvm_ptr(base, at + c, dtype), aligned=self.aligned
            )

    def row(self, name, b, t):
        """Element offset of (b, ., t) of tensor `name` and its head stride."""
        s = self.s
        return b * s[f"{name}_sb"] + t * s[f"{name}_st"], s.get(f"{name}_sh")

    def trig(self, cos, sin, cs_dtype, b, t, inverse):
        """The position's cos entries and the partners' multipliers (rope.py's
        _partner_sines), per access."""
        c = self.read(cos, self.row("cos", b, t)[0], cs_dtype)
        sn = self.read(sin, self.row("sin", b, t)[0], cs_dtype)
        m = []
        if self.cover.interleaved:
            for part in sn:
                m_a, m_b = _partner_sines(part[0::2], part[1::2], inverse)
                m.append([v for pair in zip(m_a, m_b, strict=True) for v in pair])
        else:
            for j in range(0, len(sn), 2):
                m += list(_partner_sines(sn[j], sn[j + 1], inverse))
        return c, m

    def rotate(self, v, c, m):
        """Each access's elements turned with their partners (rope.py's _turned)."""
        if self.cover.interleaved:
            return [_turned(p, [p[i ^ 1] for i in range(len(p))], ci, mi)
                    for p, ci, mi in zip(v, c, m, strict=True)]  # fmt: skip
        out = []
        for j in range(0, len(v), 2):
            out += [
                _turned(v[j], v[j + 1], c[j], m[j]),
                _turned(v[j + 1], v[j], c[j + 1], m[j + 1]),
            ]
        return out

    def weight(self, ptr, w_dtype, offset):
        """offset + w at this thread's columns, f32 (the offset never added to a stored w)."""
        w = self.read(ptr, 0, w_dtype)
        return [[e + offset for e in p] for p in w] if offset else w

    def heads(self, H, carried, body):
        """body(head, valid, carried) -> carried over this slot's heads of one side: the same
        number of passes in every thread (a head past H is H - 1, `valid` false)."""
        from kbuild.dsl import loop, select

        per = self.cover.heads_per_pass

        def step(i, carried):
            h = self.slot + i * per
            valid = h < H
            return body(select(valid, h, H - 1), valid, carried)

        return loop(0, (H + (per - 1)) / per, 1, carried, step)

    def head_sum(self, total):
        """The sum over the head's lanes (in every lane)."""
        from kbuild.dsl import group_reduce

        return group_reduce(self.k, [total], self.cover.lanes)[0]


def _sum(values):
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


def _flat(parts):
    return [e for p in parts for e in p]


@kernel("qk_norm_rope", params=FWD_PARAMS, args=FWD_ARGS)
def build_qk_norm_rope(D, dtype, w_dtype, cs_dtype, eps, target, offset=0.0, interleaved=False,
                       store_rstd=True, vec=1):  # fmt: skip
    """q_out, k_out = rope(rmsnorm(q, q_weight)), rope(rmsnorm(k, k_weight)) and, with
    `store_rstd`, each head's rstd (module docstring). Grid: B * T blocks, one per position."""
    from kbuild.dsl import Kernel, get_llvm_ptr, if_then, rsqrt, store

    cover = head_cover(D, dtype, interleaved, vec)
    with Kernel("qk_norm_rope", target, THREADS) as k:
        q, kk, qw, kw, cos, sin, q_out, k_out = (
            k.ptr(n) for n in ("q", "k", "q_weight", "k_weight", "cos", "sin", "q_out", "k_out")
        )
        rstds = [k.ptr(f"{n}_rstd") for n in _SIDES] if store_rstd else [None, None]
        T, Hq, Hk = k.i64("T"), k.i64("Hq"), k.i64("Hk")
        s = {a.name: k.i64(a.name) for a in FWD_ARGS[-_N_FWD_STRIDES:]
             if a.present({"store_rstd": store_rstd})}  # fmt: skip
        blk = _Block(k, cover, s)
        position = k.block_id()
        b = position / T
        t = position - b * T
        c, m = blk.trig(cos, sin, cs_dtype, b, t, False)

        def side(name, x, out, rstd_out, w_ptr, H):
            w = blk.weight(w_ptr, w_dtype, offset)
            x_at, x_head = blk.row(name, b, t)
            out_at, out_head = blk.row(f"{name}_out", b, t)
            rstd_at, rstd_head = blk.row(f"{name}_rstd", b, t) if store_rstd else (None, None)

            def body(h, valid, _):
                v = blk.read(x, x_at + h * x_head, dtype)
                squares = blk.head_sum(_sum([e * e for e in _flat(v)]))
                rstd = rsqrt(squares * (1.0 / D) + eps)
                n = [[e * rstd * we for e, we in zip(p, wp, strict=True)]
                     for p, wp in zip(v, w, strict=True)]  # fmt: skip
                y = blk.rotate(n, c, m)

                def put():
                    blk.write(y, out, out_at + h * out_head, dtype)
                    if store_rstd:
                        at = get_llvm_ptr(rstd_out, rstd_at + h * rstd_head, "f32")
                        if_then(blk.lane < 1, lambda: store(rstd, at))

                if_then(valid, put)
                return []

            blk.heads(H, [], body)

        side("q", q, q_out, rstds[0], qw, Hq)
        side("k", kk, k_out, rstds[1], kw, Hk)
        k.meta.update(grid="positions", heads_per_pass=cover.heads_per_pass)
    return k


@kernel("qk_norm_rope_bwd", params=BWD_PARAMS, args=BWD_ARGS)
def build_qk_norm_rope_bwd(D, dtype, w_dtype, cs_dtype, target, offset=0.0, interleaved=False,
                           weight_grad=True, vec=1):  # fmt: skip
    """dq, dk from dq_out, dk_out and the saved q, k, rstds; with `weight_grad`, each block's
    fp32 dq_weight and dk_weight partials into row g of dw_partial (2, G, D) (module
    docstring). Grid: G <= BLOCKS blocks walking the P = B * T positions."""
    from kbuild.dsl import Kernel, const, get_llvm_ptr, if_then, load, loop, select

    cover = head_cover(D, dtype, interleaved, vec)
    with Kernel("qk_norm_rope_bwd", target, THREADS) as k:
        names = ("q", "k", "q_weight", "k_weight", "cos", "sin", "q_rstd", "k_rstd", "dq_out",
                 "dk_out", "dq", "dk")  # fmt: skip
        p = {n: k.ptr(n) for n in names}
        partial = k.ptr("dw_partial") if weight_grad else None
        P, T, Hq, Hk = k.i64("P"), k.i64("T"), k.i64("Hq"), k.i64("Hk")
        s = {a.name: k.i64(a.name) for a in BWD_ARGS[-_N_BWD_STRIDES:]}
        blk = _Block(k, cover, s)
        weights = {n: blk.weight(p[f"{n}_weight"], w_dtype, offset) for n in _SIDES}
        n_acc = cover.elements if weight_grad else 0

        def side(name, H, b, t, c, m, acc):
            w = weights[name]
            x_at, x_head = blk.row(name, b, t)
            dy_at, dy_head = blk.row(f"d{name}_out", b, t)
            dx_at, dx_head = blk.row(f"d{name}", b, t)
            rstd_at, rstd_head = blk.row(f"{name}_rstd", b, t)

            def body(h, valid, acc):
                x = blk.read(p[name], x_at + h * x_head, dtype)
                dy = blk.read(p[f"d{name}_out"], dy_at + h * dy_head, dtype)
                saved = load(get_llvm_ptr(p[f"{name}_rstd"], rstd_at + h * rstd_head, "f32"), "f32")
                rstd = select(valid, saved, 0.0)  # a head past H adds nothing to dw
                dn = blk.rotate(dy, c, m)
                x_hat = [[e * rstd for e in part] for part in x]
                g = [
                    [d * we for d, we in zip(dp, wp, strict=True)]
                    for dp, wp in zip(dn, w, strict=True)
                ]
                mean = blk.head_sum(
                    _sum([a * b_ for a, b_ in zip(_flat(g), _flat(x_hat), strict=True)])
                )
                c2 = mean * (1.0 / D)
                dx = [[(gi - xi * c2) * rstd for gi, xi in zip(gp, xp, strict=True)]
                      for gp, xp in zip(g, x_hat, strict=True)]  # fmt: skip
                if_then(valid, lambda: blk.write(dx, p[f"d{name}"], dx_at + h * dx_head, dtype))
                terms = [a * b_ for a, b_ in zip(_flat(dn), _flat(x_hat), strict=True)]
                return [a + d for a, d in zip(acc, terms, strict=True)] if weight_grad else []

            return blk.heads(H, acc, body)

        def position_step(position, acc):
            b = position / T
            t = position - b * T
            c, m = blk.trig(p["cos"], p["sin"], cs_dtype, b, t, True)
            acc_q = side("q", Hq, b, t, c, m, acc[:n_acc])
            return acc_q + side("k", Hk, b, t, c, m, acc[n_acc:])

        grid = k.grid_size()
        acc = loop(k.block_id(), P, grid, [const(0.0)] * (2 * n_acc), position_step)
        if weight_grad:
            _block_partials(k, blk, acc, partial, grid)
        k.meta.update(grid="positions", heads_per_pass=cover.heads_per_pass)
    return k


def _block_partials(k, blk, acc, partial, grid):
    """The block's dw terms, q's then k's, added over its slots in slot order through shared
    memory into row block_id of each plane of `partial` (2, grid, D)."""
    from kbuild.dsl import const, from_lanes, get_llvm_ptr, if_then, load, loop, store

    cover, D = blk.cover, blk.cover.D
    per, width = cover.heads_per_pass, cover.width
    shared = k.shared(2 * per * D)  # [plane][slot][column]
    for plane in range(2):
        values = acc[plane * cover.elements : (plane + 1) * cover.elements]
        for j, column in enumerate(blk.cols):
            at = (blk.slot + plane * per) * D + column
            store(from_lanes(values[j * width : (j + 1) * width]), get_llvm_ptr(shared, at, "f32"))
    k.barrier()
    tid, block = k.thread_id(), k.block_id()
    for first in range(0, 2 * D, THREADS):
        index = tid + first  # plane * D + column
        plane, column = index / D, index % D

        def total(plane=plane, column=column):
            def add(slot, carried):
                at = (plane * per + slot) * D + column
                return [carried[0] + load(get_llvm_ptr(shared, at, "f32"), "f32")]

            (value,) = loop(0, per, 1, [const(0.0)], add)
            store(value, get_llvm_ptr(partial, (plane * grid + block) * D + column, "f32"))

        if first + THREADS <= 2 * D:
            total()
        else:
            if_then(index < 2 * D, total)
