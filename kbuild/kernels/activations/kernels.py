"""GELU and the gated MLP activations, forward and backward (kbuild/kernels/activations/op.py is
the op): elementwise over rows of I, fp32 math whatever the storage dtype, one rounding of
each output.

    silu(g)       = g sigmoid(g)                    silu'(g) = s (1 + g (1 - s)),  s = sigmoid(g)
    gelu_tanh(g)  = g sigmoid(2u),  u = c (g + 0.044715 g^3),  c = sqrt(2 / pi)
                    (= 0.5 g (1 + tanh u), GPT-2's; the sigmoid keeps g << 0 from cancelling)
                    gelu_tanh'(g) = s + g s (1 - s) 2c (1 + 3 * 0.044715 g^2),  s = sigmoid(2u)
    gelu(g)       = g Phi(g),  Phi(g) = (1 + erf(g / sqrt 2)) / 2
                    gelu'(g) = Phi(g) + g exp(-g^2 / 2) / sqrt(2 pi)

    swiglu / geglu:  y = act(gate) up      dgate = dy up act'(gate),  dup = dy act(gate)
    gelu:            y = act(x)            dx = dy act'(x)

The backwards take the forward's inputs, not its output: the activation is recomputed.

The gated kernels read gate and up in one of three layouts (the kernel's name says which):
- dense: two (M, I) arrays;
- strided (`*_strided_*`): two arrays whose rows are laid out as `GroupedRows` says (the
  halves of a (M, 2I) projection passed separately, x_group = 1, x_stride = 2I), read in place;
  the outputs dense;
- fused (`*_fused_*`): one (M, 2I) array, gate its first I columns and up the rest, seen as
  (2M, I) rows: gate row r is row 2r, up row 2r + 1 (`RowTile.load_row`); its backward writes
  d(gate, up) as one (M, 2I) array the same way.
Rows are planned for I columns (`row_kernel`) and never split over a cluster (no row
reduction to share; a long row is walked in chunks). I not a whole number of 16-byte vectors
(4097) is peeled by the row layer for the dense arrays; the fused rows then start at other
phases than the output's and move element by element, and the strided kernels are launched
with `vectorize=False`.
"""

from __future__ import annotations

import math

from ...dtypes import ELEMENT_BYTES
from ...plan.config import CHUNK_ITERS, RowBudget
from ...plan.rows import plan_rows, row_kernel
from ...registry import Arg, Param, kernel

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715  # GPT-2's tanh approximation
INV_SQRT_2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

ROW = (Param("N", "int", bounds=(1, None)), Param("dtype", "dtype"))
TANH = Param("tanh", "bool")  # GELU's tanh approximation (True) or the erf form
VECTORIZE = Param("vectorize", "bool", True)
GROUPED = tuple(Arg(name, "i64") for name in ("x_group", "x_stride", "x_group_magic"))
M = Arg("M", "i64")

SPLIT_FWD_ARGS = (Arg("gate"), Arg("up"), Arg("y"), M)
SPLIT_BWD_ARGS = (Arg("gate"), Arg("up"), Arg("dy"), Arg("dgate"), Arg("dup"), M)
FUSED_FWD_ARGS = (Arg("gate_up"), Arg("y"), M)
FUSED_BWD_ARGS = (Arg("gate_up"), Arg("dy"), Arg("dgate_up"), M)
GELU_FWD_ARGS = (Arg("x"), Arg("y"), M)
GELU_BWD_ARGS = (Arg("x"), Arg("dy"), Arg("dx"), M)


# ----------------------------------------------------------------------------- the math


def logistic(z):
    """(sigmoid(z), 1 - sigmoid(z)), each to a few ulps, from one exp: 1 - s taken as
    e / (1 + e) where s is near 1 (1 - s there keeps none of its bits: gelu_tanh'(5) lost
    16 ulps so), e = e^-|z| (at most 1, so never inf)."""
    from kbuild.dsl import absolute, exp, select

    e = exp(-absolute(z))
    d = 1.0 / (e + 1.0)
    big, small = d, e * d
    up = z >= 0.0
    return select(up, big, small), select(up, small, big)


def activation(kind: str, g, grad: bool = False):
    """(act(g), act'(g) or None) for f32 values `g` (a vector or a scalar): `kind` is
    "silu", "gelu_tanh" or "gelu" (the module docstring's formulas)."""
    from kbuild.dsl import erf, exp

    if kind == "silu":
        s, rest = logistic(g)
        return g * s, (s * (1.0 + g * rest) if grad else None)
    if kind == "gelu_tanh":
        g2 = g * g
        s, rest = logistic(g * (2.0 * SQRT_2_OVER_PI + (2.0 * SQRT_2_OVER_PI * GELU_CUBIC) * g2))
        if not grad:
            return g * s, None
        du = (2.0 * SQRT_2_OVER_PI) + (6.0 * SQRT_2_OVER_PI * GELU_CUBIC) * g2  # d(2u)/dg
        return g * s, s + g * (s * rest) * du
    if kind == "gelu":
        cdf = 0.5 + 0.5 * erf(g * INV_SQRT_2)
        return g * cdf, (cdf + g * exp(-0.5 * (g * g)) * INV_SQRT_2PI if grad else None)
    raise ValueError(f"activation: kind must be 'silu', 'gelu_tanh' or 'gelu', not {kind!r}")


def gelu_kind(tanh: bool) -> str:
    return "gelu_tanh" if tanh else "gelu"


# ----------------------------------------------------------------------------- bodies


# A forward whose row, held in registers, takes a block of more threads than this, each
# holding several vectors, is walked in chunks instead, by blocks of STREAM_THREADS, one
# vector of each array a thread per pass.
# Held, Llama's swiglu_fwd at I = 14336 took 448 threads of 82 registers and GELU at 16384
# 512 of 71 (ptxas, CUDA 13.0, sm_90): one block an SM, which drains before the next starts
# (on an H100, 2026-12-07: swiglu 95.8% of copy against torch.compile's 105.3%, GELU 74.8%
# against torch eager's 103%). Walked: 56 and 47 registers, 9 and 10 blocks of 128 an SM, as
# inductor's pointwise kernels run. Rows read element by element (vectorize off) keep their
# plan: one element a thread a pass would leave too few bytes in flight.
HELD_BLOCK_MAX = 256
STREAM_THREADS = 128


def _rows(name: str, N: int, dtype: str, target, vectorize: bool, held: int, backward: bool):
    """The kernel and its rows of N: one pass, never a cluster (nothing to reduce). A
    backward walking a long row in chunks takes one vector of each array a thread per pass:
    its derivative's temporaries live beside three arrays' values (ptxas, sm_90: at four
    vectors swiglu_bwd at 14336 spilled 136 bytes at 128 registers, geglu_bwd 188; at one,
    62-76 registers and none). A forward too wide to hold in a small block streams
    (HELD_BLOCK_MAX)."""
    chunk = 1 if backward else CHUNK_ITERS
    keywords = dict(vectorize=vectorize, rows_held=held, cluster=1, chunk_vectors=chunk)
    if not backward and streams(N, dtype, target, vectorize, held):
        keywords.update(chunk_vectors=1, threads_per_row=STREAM_THREADS)
    return row_kernel(name, N, dtype, target, **keywords)


def streams(N: int, dtype: str, target, vectorize: bool, held: int) -> bool:
    """Whether a forward's row of N streams (HELD_BLOCK_MAX): read in vectors, the block the
    row chooser gives it held has more threads than that, each holding more than one."""
    if not vectorize:
        return False
    budget = RowBudget(words_per_elem=float(held), chunk_iters=CHUNK_ITERS)
    row = plan_rows(N, dtype, target, vectorize=vectorize, budget=budget, persistent=False,
                    cluster=1).row  # fmt: skip
    return row.block > HELD_BLOCK_MAX and (row.chunked or row.iters > 1)


def _gated(name: str, kind: str, layout: str, backward: bool, N, dtype, target, vectorize):
    """The gated kernels' shared body: `layout` "dense", "strided" or "fused" (module
    docstring), forward y = act(gate) up, or backward (dgate, dup) from gate, up and dy."""
    from kbuild.dsl import GroupedRows, RowTile, if_then, widen

    if layout == "strided":  # GroupedRows reads whole vectors only: scalars for a 4097
        vectorize = vectorize and N % (16 // ELEMENT_BYTES[dtype]) == 0
    k, row = _rows(name, N, dtype, target, vectorize, 3 if backward else 2, backward)
    with k:
        if layout == "fused":
            gate = up = k.ptr("gate_up")
        else:
            gate, up = k.ptr("gate"), k.ptr("up")
        dy = k.ptr("dy") if backward else None
        if not backward:
            names = ("y",)
        else:
            names = ("dgate_up",) if layout == "fused" else ("dgate", "dup")
        outs = [k.ptr(n) for n in names]
        t = RowTile(k, row, k.i64("M"))
        grouped = GroupedRows(k, N) if layout == "strided" else None
        # gate's and up's rows: of the (2M, I) view of gate_up, or this row (None)
        rows = (t.row * 2, t.row * 2 + 1) if layout == "fused" else (None, None)
        # where dgate and dup go: the two rows of d(gate_up), or this row of each
        targets = list(zip((outs[0], outs[0]) if layout == "fused" else outs, rows, strict=False))

        def read(base, r, c):  # gate's or up's f32 vectors at chunk c
            if r is None:
                return widen(t.load(base, dtype, c, grouped))
            return widen(t.load_row(base, r, dtype, c))

        def write(base, r, values, c):
            if r is None:
                return t.store(base, values, dtype, c)
            put = lambda: t.store_row(base, r, values, dtype, c)  # noqa: E731
            return put() if t.valid is None else if_then(t.valid, put)  # not a row past M

        def body(c, _):
            g, u = read(gate, rows[0], c), read(up, rows[1], c)
            if not backward:
                y = [activation(kind, a)[0] * b for a, b in zip(g, u, strict=True)]
                t.store(outs[0], y, dtype, c)
                return []
            dg, du = [], []
            for a, b, e in zip(g, u, widen(t.load(dy, dtype, c)), strict=True):  # dy dense
                act, slope = activation(kind, a, grad=True)
                dg.append(e * b * slope)
                du.append(e * act)
            for (base, r), values in zip(targets, (dg, du), strict=True):
                write(base, r, values, c)
            return []

        t.over_chunks(body)
    return k


def _gelu(name: str, tanh: bool, backward: bool, N, dtype, target, vectorize):
    """y = gelu(x), or dx = dy gelu'(x)."""
    from kbuild.dsl import RowTile, widen

    kind = gelu_kind(tanh)
    k, row = _rows(name, N, dtype, target, vectorize, 2 if backward else 1, backward)
    with k:
        x = k.ptr("x")
        dy = k.ptr("dy") if backward else None
        out = k.ptr("dx" if backward else "y")
        t = RowTile(k, row, k.i64("M"))

        def body(c, _):
            v = widen(t.load(x, dtype, c))
            if backward:
                d = widen(t.load(dy, dtype, c))
                got = [e * activation(kind, a, grad=True)[1] for a, e in zip(v, d, strict=True)]
            else:
                got = [activation(kind, a)[0] for a in v]
            t.store(out, got, dtype, c)
            return []

        t.over_chunks(body)
    return k


# ----------------------------------------------------------------------------- kernels
# N is I, the activation's width (the fused array's rows are 2N wide).


@kernel("swiglu_fwd", params=(*ROW, VECTORIZE), args=SPLIT_FWD_ARGS)
def build_swiglu_fwd(N, dtype, target, vectorize=True):
    """y = silu(gate) up, gate and up dense (M, N)."""
    return _gated("swiglu_fwd", "silu", "dense", False, N, dtype, target, vectorize)


@kernel("swiglu_bwd", params=(*ROW, VECTORIZE), args=SPLIT_BWD_ARGS)
def build_swiglu_bwd(N, dtype, target, vectorize=True):
    """dgate = dy up silu'(gate), dup = dy silu(gate), all dense (M, N)."""
    return _gated("swiglu_bwd", "silu", "dense", True, N, dtype, target, vectorize)


@kernel("swiglu_strided_fwd", params=(*ROW, VECTORIZE), args=(*SPLIT_FWD_ARGS, *GROUPED))
def build_swiglu_strided_fwd(N, dtype, target, vectorize=True):
    """swiglu_fwd with gate and up read at the rows' two-level stride (GroupedRows)."""
    return _gated("swiglu_strided_fwd", "silu", "strided", False, N, dtype, target, vectorize)


@kernel("swiglu_strided_bwd", params=(*ROW, VECTORIZE), args=(*SPLIT_BWD_ARGS, *GROUPED))
def build_swiglu_strided_bwd(N, dtype, target, vectorize=True):
    """swiglu_bwd with gate and up read at the rows' two-level stride (GroupedRows)."""
    return _gated("swiglu_strided_bwd", "silu", "strided", True, N, dtype, target, vectorize)


@kernel("swiglu_fused_fwd", params=(*ROW, VECTORIZE), args=FUSED_FWD_ARGS)
def build_swiglu_fused_fwd(N, dtype, target, vectorize=True):
    """y (M, N) = silu(gate) up from one gate_up (M, 2N)."""
    return _gated("swiglu_fused_fwd", "silu", "fused", False, N, dtype, target, vectorize)


@kernel("swiglu_fused_bwd", params=(*ROW, VECTORIZE), args=FUSED_BWD_ARGS)
def build_swiglu_fused_bwd(N, dtype, target, vectorize=True):
    """dgate_up (M, 2N) = (dgate, dup) from gate_up (M, 2N) and dy (M, N)."""
    return _gated("swiglu_fused_bwd", "silu", "fused", True, N, dtype, target, vectorize)


@kernel("geglu_fwd", params=(*ROW, TANH, VECTORIZE), args=SPLIT_FWD_ARGS)
def build_geglu_fwd(N, dtype, tanh, target, vectorize=True):
    """y = gelu(gate) up (tanh: GPT-2's approximation, else erf), dense (M, N)."""
    return _gated("geglu_fwd", gelu_kind(tanh), "dense", False, N, dtype, target, vectorize)


@kernel("geglu_bwd", params=(*ROW, TANH, VECTORIZE), args=SPLIT_BWD_ARGS)
def build_geglu_bwd(N, dtype, tanh, target, vectorize=True):
    """dgate = dy up gelu'(gate), dup = dy gelu(gate), all dense (M, N)."""
    return _gated("geglu_bwd", gelu_kind(tanh), "dense", True, N, dtype, target, vectorize)


@kernel("geglu_strided_fwd", params=(*ROW, TANH, VECTORIZE), args=(*SPLIT_FWD_ARGS, *GROUPED))
def build_geglu_strided_fwd(N, dtype, tanh, target, vectorize=True):
    """geglu_fwd with gate and up read at the rows' two-level stride (GroupedRows)."""
    kind = gelu_kind(tanh)
    return _gated("geglu_strided_fwd", kind, "strided", False, N, dtype, target, vectorize)


@kernel("geglu_strided_bwd", params=(*ROW, TANH, VECTORIZE), args=(*SPLIT_BWD_ARGS, *GROUPED))
def build_geglu_strided_bwd(N, dtype, tanh, target, vectorize=True):
    """geglu_bwd with gate and up read at the rows' two-level stride (GroupedRows)."""
    kind = gelu_kind(tanh)
    return _gated("geglu_strided_bwd", kind, "strided", True, N, dtype, target, vectorize)


@kernel("geglu_fused_fwd", params=(*ROW, TANH, VECTORIZE), args=FUSED_FWD_ARGS)
def build_geglu_fused_fwd(N, dtype, tanh, target, vectorize=True):
    """y (M, N) = gelu(gate) up from one gate_up (M, 2N)."""
    kind = gelu_kind(tanh)
    return _gated("geglu_fused_fwd", kind, "fused", False, N, dtype, target, vectorize)


@kernel("geglu_fused_bwd", params=(*ROW, TANH, VECTORIZE), args=FUSED_BWD_ARGS)
def build_geglu_fused_bwd(N, dtype, tanh, target, vectorize=True):
    """dgate_up (M, 2N) = (dgate, dup) from gate_up (M, 2N) and dy (M, N)."""
    kind = gelu_kind(tanh)
    return _gated("geglu_fused_bwd", kind, "fused", True, N, dtype, target, vectorize)


@kernel("gelu_fwd", params=(*ROW, TANH, VECTORIZE), args=GELU_FWD_ARGS)
def build_gelu_fwd(N, dtype, tanh, target, vectorize=True):
    """y = gelu(x) along rows of N (tanh: GPT-2's approximation, else erf)."""
    return _gelu("gelu_fwd", tanh, False, N, dtype, target, vectorize)


@kernel("gelu_bwd", params=(*ROW, TANH, VECTORIZE), args=GELU_BWD_ARGS)
def build_gelu_bwd(N, dtype, tanh, target, vectorize=True):
    """dx = dy gelu'(x), from the forward's input x."""
    return _gelu("gelu_bwd", tanh, True, N, dtype, target, vectorize)
