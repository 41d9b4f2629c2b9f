"""Rotary position embedding over q and k in one launch, forward and backward
(kbuild/kernels/rope/op.py is the op, its layouts and its checks).

For a head vector x of D features, the first rd of which rotate (rd = D: full rotary; rd < D:
partial, GPT-NeoX's and Phi's `partial_rotary_factor`), c = cos[b, t] and s = sin[b, t]
(rd entries each), fp32 math and one rounding to x's dtype:

    out[:rd] = x[:rd] * c + R(x[:rd]) * s          out[rd:] = x[rd:]
    rotate-half (HF's rotate_half):   R(v) = (-v[h:], v[:h]),  h = rd / 2
    interleaved (GPT-J, Cohere):      R(v)[2i] = -v[2i + 1],   R(v)[2i + 1] = v[2i]

Every entry of c and s is read (rd of each per position), so any cos / sin rotate as given;
HF's repeat the frequencies (cat(f, f) for rotate-half, repeat_interleave(f, 2) for
interleaved), which makes this the rotation of each pair by its angle.

`inverse`: the transpose, which is the backward (dx from dy): dx = c dy - R(s dy), the
rotation by -theta for HF's cos / sin. It is the forward with the sines of each pair swapped
and negated: forward  y_a = c_a x_a - s_a x_b,  y_b = c_b x_b + s_b x_a;
inverse  y_a = c_a x_a + s_b x_b,  y_b = c_b x_b - s_a x_a  (a the first of a pair, b its
partner: h apart, or adjacent).

The launch: one block per position (b, t) of the B * T (the grid), over every head of q and
then of k, so each of q and k is read once and written once and the position's cos / sin once
per thread. A head is U units of `vec` elements: R rotating units (pairs of vectors h apart, or
one vector of adjacent pairs) and P passing units (the features past rd, copied). Thread
`tid` takes unit tid % U of heads tid // U, tid // U + heads_per_pass, ...: its cos / sin stay
in registers across heads. Tensors are read and written at the strides the launch passes (in
elements, i64): any (B, H, T, D) or (B, T, H, D) view whose last dimension is dense, a q or k
view of a fused qkv projection among them; cos / sin at (batch, position) strides (batch 0:
shared by the batch).

`vec` (elements per access) is what the launch found every stride, offset and pointer to be a
multiple of (16 bytes at most); vectors are aligned to it. Interleaved pairs are read two
elements at a time (element by element when vec is 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...dtypes import ELEMENT_BYTES
from ...registry import Arg, Param, kernel

THREADS = 128  # a block aims for this many threads: heads_per_pass = THREADS // U
MAX_THREADS = 1024

PARAMS = (
    Param("D", "int", bounds=(2, None)),
    Param("rd", "int", bounds=(2, None)),
    Param("dtype", "dtype"),
    Param("cs_dtype", "dtype"),
    Param("interleaved", "bool", False),
    Param("inverse", "bool", False),
    Param("vec", "int", 1, bounds=(1, 8)),
)
# x strides are (batch, head, position) of q, k and their outputs; cos / sin (batch, position)
STRIDES = tuple(f"{t}_s{d}" for t in ("q", "k", "q_out", "k_out") for d in "bht") + tuple(
    f"{t}_s{d}" for t in ("cos", "sin") for d in "bt"
)
ARGS = (
    Arg("q"),
    Arg("k"),
    Arg("cos"),
    Arg("sin"),
    Arg("q_out"),
    Arg("k_out"),
    Arg("T", "i64"),
    Arg("Hq", "i64"),
    Arg("Hk", "i64"),
    *(Arg(name, "i64") for name in STRIDES),
)


@dataclass(frozen=True)
class HeadLayout:
    """How a block's threads cover a head: `width` elements per rotating access, `rotating`
    units (R) and `passing` units (P) of `vec` elements, `heads_per_pass` heads at once, `used`
    threads of the block's. Pure Python: the builder's and the tests' one description."""

    D: int
    rd: int
    interleaved: bool
    vec: int
    width: int
    rotating: int
    passing: int
    heads_per_pass: int

    @property
    def units(self) -> int:
        return self.rotating + self.passing

    @property
    def used(self) -> int:
        return self.heads_per_pass * self.units

    def block(self, warp: int) -> int:
        return -(-self.used // warp) * warp


def head_layout(D: int, rd: int, dtype: str, cs_dtype: str, interleaved: bool, vec: int):
    """The layout of one head, or a ValueError naming what does not fit."""
    if rd % 2 or not 2 <= rd <= D:
        raise ValueError(f"rope: rd must be even and in [2, D = {D}]; got {rd}")
    widest = 16 // max(ELEMENT_BYTES[dtype], 1)
    if vec & (vec - 1) or vec > widest:
        raise ValueError(f"rope: vec must be a power of two <= {widest} for {dtype}; got {vec}")
    unit = rd if interleaved else rd // 2
    if unit % vec or (D - rd) % vec:
        raise ValueError(f"rope: vec {vec} must divide {unit} and D - rd = {D - rd}")
    width = max(vec, 2) if interleaved else vec  # interleaved pairs: two elements at least
    rotating = rd // width if interleaved else rd // (2 * width)
    passing = (D - rd) // vec
    units = rotating + passing
    if units > MAX_THREADS:
        raise ValueError(
            f"rope: a head of D = {D} is {units} units of {vec} elements; at most {MAX_THREADS}"
        )
    heads = max(1, THREADS // units)
    return HeadLayout(D, rd, interleaved, vec, width, rotating, passing, heads)


def _partner_sines(s_a, s_b, inverse):
    """What each element's partner is multiplied by, for the first elements of the pairs and
    for the second: forward (-s_a, s_b), inverse (the transpose) (s_b, -s_a)."""
    if inverse:
        return s_b, [-v for v in s_a]
    return [-v for v in s_a], s_b


def _turned(x, partner, c, m):
    """c x + m partner, lane by lane (fp32): each element of its pair rotated."""
    from kbuild.dsl import fma

    return [fma(mi, p, ci * xi) for xi, p, ci, mi in zip(x, partner, c, m, strict=True)]


@kernel("rope", params=PARAMS, args=ARGS)
def build_rope(D, rd, dtype, cs_dtype, target, interleaved=False, inverse=False, vec=1):
    """q_out, k_out = q, k rotated by (cos, sin) (by their transpose with `inverse`): module
    docstring. Grid: B * T blocks, one per position."""
    from kbuild.dsl import (
        Kernel,
        cast,
        const,
        from_lanes,
        get_llvm_ptr,
        if_then,
        lanes,
        load,
        loop,
        select,
        store,
        to_f32,
    )

    layout = head_layout(D, rd, dtype, cs_dtype, interleaved, vec)
    width, R, U = layout.width, layout.rotating, layout.units
    aligned = width == vec  # interleaved pairs of a vec-1 launch: element by element
    half = rd // 2
    with Kernel("rope", target, layout.block(target.warp_size)) as k:
        q, kk, cos, sin, q_out, k_out = (
            k.ptr(n) for n in ("q", "k", "cos", "sin", "q_out", "k_out")
        )
        T, Hq, Hk = k.i64("T"), k.i64("Hq"), k.i64("Hk")
        s = {name: k.i64(name) for name in STRIDES}
        tid = k.thread_id()
        unit, slot = tid % U, tid / U
        position = k.block_id()
        b = position / T
        t = position - b * T
        heads = Hq + Hk
        # threads past the used ones take no head: their loop starts at its end
        first = select(tid < layout.used, slot, heads)

        def offset(name):  # the (b, ., t) row of x's head 0, and the head stride
            return b * s[f"{name}_sb"] + t * s[f"{name}_st"], s[f"{name}_sh"]

        rows = {name: offset(name) for name in ("q", "k", "q_out", "k_out")}

        def over_heads(body):  # body(x, out, x's row, out's row) for each of this thread's heads
            def step(h, carried):
                in_q = h < Hq
                j = select(in_q, h, h - Hq)

                def at(a, b_):
                    base_a, head_a = rows[a]
                    base_b, head_b = rows[b_]
                    return select(in_q, base_a + j * head_a, base_b + j * head_b)

                body(select(in_q, q, kk), select(in_q, q_out, k_out), at("q", "k"),
                     at("q_out", "k_out"))  # fmt: skip
                return []

            loop(first, heads, const(layout.heads_per_pass, "i64"), [], step)

        def read(base, at, dtype_, n, is_aligned=True):
            value = load(get_llvm_ptr(base, at, dtype_), dtype_, n, aligned=is_aligned)
            return lanes(to_f32(value))

        def write(values, base, at, n, is_aligned=True):
            ptr = get_llvm_ptr(base, at, dtype)
            store(cast(from_lanes(values), dtype), ptr, aligned=is_aligned)

        def trig(table, column):  # this thread's cos or sin entries at a column
            base = b * s[f"{table}_sb"] + t * s[f"{table}_st"] + column
            return read(cos if table == "cos" else sin, base, cs_dtype, width, aligned)

        def rotate():
            column = unit * width
            if interleaved:  # one vector of adjacent pairs (a, b)
                c, sn = trig("cos", column), trig("sin", column)
                m_a, m_b = _partner_sines(sn[0::2], sn[1::2], inverse)
                m = [v for pair in zip(m_a, m_b, strict=True) for v in pair]

                def one(x, out, at_x, at_out):
                    v = read(x, at_x + column, dtype, width, aligned)
                    y = _turned(v, [v[i ^ 1] for i in range(width)], c, m)
                    write(y, out, at_out + column, width, aligned)

            else:  # a vector of the first half and its partner h further
                c_a, c_b = trig("cos", column), trig("cos", column + half)
                m_a, m_b = _partner_sines(trig("sin", column), trig("sin", column + half), inverse)

                def one(x, out, at_x, at_out):
                    x_a = read(x, at_x + column, dtype, width)
                    x_b = read(x, at_x + column + half, dtype, width)
                    write(_turned(x_a, x_b, c_a, m_a), out, at_out + column, width)
                    write(_turned(x_b, x_a, c_b, m_b), out, at_out + column + half, width)

            over_heads(one)

        def copy():  # the features past rd, as they are
            column = rd + (unit - R) * vec

            def one(x, out, at_x, at_out):
                value = load(get_llvm_ptr(x, at_x + column, dtype), dtype, vec)
                store(value, get_llvm_ptr(out, at_out + column, dtype))

            over_heads(one)

        if layout.passing:
            if_then(unit < R, rotate, copy)
        else:
            rotate()
        k.meta.update(grid="positions", heads_per_pass=layout.heads_per_pass)
    return k
