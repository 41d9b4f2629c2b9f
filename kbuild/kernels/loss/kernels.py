"""Cross-entropy over rows of logits: the forward that also writes the gradient, and the
backward's row rescale (kbuild/kernels/loss/cross_entropy.py is the op and its design).

`cross_entropy_fwd`, one row per block (or cluster) as `row_plan.plan_rows` chooses, rows of
any width (odd V peeled by the row layer):

    x     = c tanh(x_in / c)          with a soft cap c (Gemma 2), else x = x_in
    m, s  = online (max, sum of exp(x - m)) over the row      (one reduction, softmax_pair)
    lse   = m + log(s)
    loss  = (1 - eps) (lse - x[t]) + eps (lse - mean(x)) + z lse^2
    dx_j  = g (p_j (1 + 2 z lse) - (1 - eps) [j == t] - eps / V),   p_j = exp(x_j - lse)
    dx_in = dx (1 - (x / c)^2)        with the soft cap (d/dx_in of c tanh(x_in / c))

eps the label smoothing (torch's definition), z the z-loss scale (PaLM's, Liger's
`lse_square_scale`), g the gradient scale the forward assumes (coefs[0]: 1 / n_valid for a
mean, 1 for a sum). A row whose target is ignore_index has loss 0 and dx 0. A target outside
[0, V) that is not ignore_index raises the int32 at `flag` to BAD_TARGET (dsl.report, an
atomic max) and the row is treated as ignored. The logits are read once where a row fits in
registers (twice for rows chunked through them: the second pass recomputes exp), dx written
once. `smoothing` / `z_loss` / `softcap` are compile-time switches for their terms (their
values are runtime, coefs[1], coefs[2] and coefs[3]: no recompile per value); `ignore_index`
is a runtime i64.

`dlogits` may be `logits` itself (the gradient written in place): every element of the row
body is read only by the thread that writes it, before it writes it. x[t] is read by one
thread of the block whose slice holds column t, followed by a block barrier (bar.sync: the
read is performed before any of the block's later stores), and reaches every other thread,
and the other blocks of a cluster, through the row's reduction as a sum with that one term:
no block reads an element another block writes. Rows past M (a block of several rows) read
what the real row's threads may have overwritten, but they store nothing.

`cross_entropy_rescale`: dx[r] *= dloss[r] / g in place, for the rows whose incoming gradient
differs from the g the forward assumed; a row where it is equal costs one scalar read (the
usual `loss.backward()` of a mean or a sum reads no logits' worth of memory at all).
"""

from __future__ import annotations

import functools
import itertools

from ...plan.rows import online_budget, plan_rows, row_kernel
from ...registry import Arg, Param, kernel
from ...targets import target_for_arch

BAD_TARGET = 1  # the flag's code for a target outside [0, V)
INDEX_DTYPES = ("i32", "i64")

ROW = (Param("N", "int", bounds=(2, None)), Param("dtype", "dtype"))
# Rows of logits `row_stride` elements apart (>= N), not N: a (M, V) view of wider rows, as
# the fused linear loss's chunks are (their rows padded to a multiple of 8 columns, so that
# cuBLAS writes and reads them with its aligned kernels: GPT-2's 50257), read and written in
# place. The stride is a launch argument: one kernel for every stride. Unkeyed: the dense
# kernels keep their specs.
STRIDED = Param("strided", "bool", False, keyed=False)
ROW_ALIGN = 8  # the fused loss pads its logits' rows to a multiple of this many columns
ROW_STRIDE = Arg("row_stride", "i64", when="strided")


def _pair_and_sums(a, b):
    """The merge of [m, s, x[t](, sum(x))]: online softmax's pair, and plain sums."""
    from kbuild.dsl import add, softmax_pair

    return softmax_pair(a[:2], b[:2]) + add(a[2:], b[2:])


def _within(values, inside):
    """Each vector of `values` where it lies inside the row's slice, 0 elsewhere (`inside`:
    RowTile.inside's flags, None for a vector wholly inside)."""
    from kbuild.dsl import select

    return [a if g is None else select(g, a, 0.0) for a, g in zip(values, inside, strict=True)]


@kernel(
    "cross_entropy_fwd",
    params=(*ROW, Param("index_dtype", "index"), Param("smoothing", "bool", False),
            Param("z_loss", "bool", False), Param("softcap", "bool", False),
            Param("grad", "bool", True),
            Param("vectorize", "bool", True), STRIDED),
    args=(Arg("logits"), Arg("target"), Arg("coefs"), Arg("loss"), Arg("lse"),
          Arg("dlogits", when="grad"), Arg("flag"), Arg("M", "i64"), Arg("ignore_index", "i64"),
          ROW_STRIDE),
    tunable=True,
)  # fmt: skip
def build_cross_entropy_fwd(N, dtype, index_dtype, target, smoothing=False, z_loss=False,
                            softcap=False, grad=True, vectorize=True, strided=False,
                            **overrides):  # fmt: skip
    """Per row: loss and lse (fp32), and with `grad` dlogits (dtype) scaled by coefs[0]
    (module docstring); without it (inference) the logits are read once and nothing else.
    `strided`: the logits (and dlogits, laid out alike) are rows `row_stride` elements apart
    (STRIDED). `overrides`: launch-plan keywords (cluster=, threads_per_row=), for benchmarks
    to time other plans than the one chosen."""
    from kbuild.dsl import RowTile, const, get_llvm_ptr, load, log, select

    k, row = row_kernel("cross_entropy_fwd", N, dtype, target, vectorize=vectorize,
                        online=True, **overrides)  # fmt: skip
    with k:
        logits, targets, coefs, loss_out, lse_out = (
            k.ptr(n) for n in ("logits", "target", "coefs", "loss", "lse")
        )  # the arguments in the table's order
        dlogits = k.ptr("dlogits") if grad else None
        flag, M, ignore = k.ptr("flag"), k.i64("M"), k.i64("ignore_index")
        t = RowTile(k, row, M, row_stride=k.i64("row_stride") if strided else None)
        skip, safe = _target(t, targets, index_dtype, flag, ignore, N)
        g, eps, z, cap = (
            load(get_llvm_ptr(coefs, const(i, "i64"), "f32"), "f32") for i in range(4)
        )
        capped = _capper(cap) if softcap else None
        v = _values(t, logits, dtype, capped)
        picked = _target_logit(k, t, logits, dtype, safe, capped, grad)
        totals = _totals(t, v, picked, smoothing)
        lse = totals[0] + log(totals[1])

        # loss = (1 - eps)(lse - x[t]) + eps (lse - mean x) + z lse^2
        nll = lse - totals[2]  # lse - x[t]
        loss = nll if not smoothing else (1.0 - eps) * nll + eps * (lse - totals[3] * (1.0 / N))
        if z_loss:
            loss = loss + z * lse * lse
        t.store_row_scalar(loss_out, select(skip, const(0.0), loss))
        t.store_row_scalar(lse_out, lse)
        if grad:
            _write_gradient(t, dlogits, dtype, v, lse, safe, select(skip, const(0.0), g),
                            eps if smoothing else None, z if z_loss else None,
                            cap if softcap else None, N)  # fmt: skip
    return k


def _target(t, targets, index_dtype, flag, ignore, N):
    """The row's target: (skip, safe): whether the row is ignored or its target outside [0, N)
    (reported into `flag`, then treated as ignored), and a column that exists (the target, or
    0 for a skipped row)."""
    from kbuild.dsl import const, eq, i64, report, select

    tid = i64(t.load_row_scalar(targets, index_dtype))
    ignored = eq(tid, ignore)
    bad = ~ignored & ((tid < 0) | (tid >= N))
    report(flag, bad, BAD_TARGET)  # a row past M repeats row M - 1: the same answer
    skip = ignored | bad
    return skip, select(skip, const(0, "i64"), tid)


def _capper(cap):
    """x = c tanh(x_in / c), c = coefs[3] (Gemma 2's logit soft cap)."""
    from kbuild.dsl import tanh

    inv_cap = 1.0 / cap
    return lambda a: cap * tanh(a * inv_cap)


def _values(t, logits, dtype, capped):
    """This thread's f32 logits as a function of a chunk's start (RowTile.values), past the
    row -inf (which exp makes 0); soft-capped where the row is, once where the row is held."""
    from kbuild.dsl import NEG_INF, select

    raw = t.values(logits, dtype, pad=NEG_INF)
    if capped is None:
        return raw

    def v(c):
        return [
            capped(a) if g is None else select(g, capped(a), NEG_INF)
            for a, g in zip(raw(c), t.inside(c), strict=True)
        ]

    if t.cfg.chunked:
        return v
    held = v(0)
    return lambda c: held


def _target_logit(k, t, logits, dtype, safe, capped, grad):
    """x[t] from one thread (lane 0) of the block whose slice holds column t, 0 from every
    other: the row's reduction sums it, so no thread reads an element another block may be
    writing; in training a block barrier follows, so the read is performed before any thread
    of the block overwrites its elements (in place; module docstring)."""
    from kbuild.dsl import const, eq, if_else, to_f32

    owner = eq(t.lane, 0)
    if t.cfg.cluster > 1:
        owner = owner & (safe >= t.first) & (safe < t.first + t.end)

    def read():
        x = to_f32(t.load_at(logits, safe, dtype))
        return x if capped is None else capped(x)

    picked = if_else(owner, read, lambda: const(0.0))
    if grad:
        k.barrier()
    return picked


def _totals(t, v, picked, smoothing):
    """The row's (max, sum of exp(x - max), x[t][, sum of x]): one pass of online softmax
    (softmax_pair) with plain sums beside it, reduced over the row."""
    from kbuild.dsl import NEG_INF, const, eq, exp, maximum, select, thread_max, thread_sum

    def own(c, state):  # this thread's totals so far
        values = v(c)
        m = maximum(state[0], thread_max(values))
        safe_m = select(eq(m, NEG_INF), 0.0, m)  # a thread holding only padding
        e = thread_sum([exp(a - safe_m) for a in values])
        out = [m, state[1] * exp(state[0] - safe_m) + e, state[2]]
        if smoothing:  # sum(x) over the row's own elements (the pad is -inf)
            out.append(state[3] + thread_sum(_within(values, t.inside(c))))
        return out

    start = [const(NEG_INF), const(0.0), picked] + ([const(0.0)] if smoothing else [])
    return t.reduce(t.over_chunks(own, start), _pair_and_sums)


def _write_gradient(t, dlogits, dtype, v, lse, safe, g, eps, z, cap, N) -> None:
    """dx_j = g (p_j (1 + 2 z lse) - (1 - eps)[j == t] - eps / V), times 1 - (x_j / c)^2
    with the soft cap; `g` already 0 on a skipped row; eps, z, cap None where off."""
    from kbuild.dsl import eq, exp, select

    p_scale = g if z is None else g * (1.0 + 2.0 * z * lse)
    hit = g if eps is None else g * (1.0 - eps)
    floor = None if eps is None else g * eps * (1.0 / N)
    inv_cap = None if cap is None else 1.0 / cap

    def write(c, _):
        out = []
        for a, col in zip(v(c), t.element_columns(c), strict=True):
            d = exp(a - lse) * p_scale - select(eq(col, safe), hit, 0.0)
            d = d if floor is None else d - floor
            out.append(d if inv_cap is None else d * (1.0 - a * inv_cap * (a * inv_cap)))
        t.store(dlogits, out, dtype, c)
        return []

    # Last chunk first: a row walked in chunks is read twice, and its last chunks are the
    # likeliest to be still in L2 (the forward walking forward twice read 67-69% of copy on
    # an H100, what two reads from memory and one write give).
    t.over_chunks(write, reverse=True)


@kernel(
    "cross_entropy_rescale",
    params=(*ROW, Param("vectorize", "bool", True), STRIDED),
    args=(Arg("dlogits"), Arg("dloss"), Arg("coefs"), Arg("M", "i64"), ROW_STRIDE),
)
def build_cross_entropy_rescale(N, dtype, target, vectorize=True, strided=False):
    """dlogits[r] *= dloss[r] / coefs[0] in place, skipping rows where the two are equal;
    `strided` as for the forward. A persistent grid of single blocks (no cluster: the
    rescale is elementwise), each walking row groups b, b + blocks, ...: the usual backward,
    which skips every row, costs one wave of blocks reading a few scalars each, where a
    block (cluster) per row scheduled M of them (8192 x 8 blocks at V = 128256) to read one
    scalar each: 80 us a call on an H100 (loss_profile_h100.log, 2026-12-07)."""
    from kbuild.dsl import RowTile, const, get_llvm_ptr, if_then, load, loop, ne, widen

    k, row = row_kernel("cross_entropy_rescale", N, dtype, target, vectorize=vectorize,
                        cluster=1)  # fmt: skip
    k.meta["grid"] = "persistent"
    with k:
        dlogits, dloss, coefs = k.ptr("dlogits"), k.ptr("dloss"), k.ptr("coefs")
        M = k.i64("M")
        stride = k.i64("row_stride") if strided else None
        g = load(get_llvm_ptr(coefs, const(0, "i64"), "f32"), "f32")
        inv_g = 1.0 / g
        groups = (M + (row.rows_per_block - 1)) / row.rows_per_block

        def group(r, _):
            t = RowTile(k, row, M, row_group=r, row_stride=stride)
            d = t.load_row_scalar(dloss, "f32")
            factor = d * inv_g

            def rescale():
                def body(c, _):
                    values = widen(t.load(dlogits, dtype, c))
                    t.store(dlogits, [a * factor for a in values], dtype, c)
                    return []

                t.over_chunks(body)

            if_then(ne(d, g), rescale)  # row-uniform: the whole row, or none of it
            return []

        loop(k.block_id(), groups, k.grid_size(), [], group)
    return k


# The forward's cluster for a call of many rows, measured on an H100 (2026-12-07, 8192 bf16
# rows, bench/bench_ce_clusters.py; bench/results/cross_entropy_cluster_table_h100_2026-12-07
# .json). With a block per row already many waves deep, splitting a row over a cluster only
# adds the exchange: one block a row, walking it in chunks, read 67-69% of copy at V = 32000,
# 128256, 151936, 256000 and 262144, where the chooser's cluster 8 read 41.6-63.4% (fwd +
# bwd through autograd: 37.7-46.2% against 29.0-43.4%). At 32768 cluster 8 stays ahead (63.5%
# against 51.6%). Fewer rows keep the chooser's plan where one block a row would leave SMs
# idle: at 512 rows one block a row still fills an H100 twice over (its blocks of 512 threads
# at 64 registers, two an SM; one at 100 with the soft cap: 3.9 waves), so the fused linear
# loss's chunks (512-1024 rows at the large heads: Gemma 3, Gemma 2, Qwen3, Llama 3) take it
# too. Not yet timed at those rows: bench_ce_clusters.py --rows 1024 times both plans.
MANY_ROWS = 512
MANY_ROWS_CLUSTER = {32768: 8}  # V -> the cluster measured best; every other V: 1
CLUSTER_TARGET = "sm_90"  # the cluster target the table was measured on (vocab_specs warms it)


@functools.cache
def _chosen_cluster(V: int, dtype: str, vectorize: bool, target) -> int:
    return plan_rows(V, dtype, target, vectorize=vectorize, budget=online_budget(dtype),
                     persistent=False).row.cluster  # fmt: skip


def forward_keywords(V: int, dtype: str, vectorize: bool, M: int, target) -> dict:
    """Plan keywords of the forward for a call of M rows of V on `target`: {} (the
    chooser's plan), or the cluster measured best for many rows where it differs."""
    if M < MANY_ROWS or target.max_cluster == 1:
        return {}
    want = MANY_ROWS_CLUSTER.get(V, 1)
    return {} if want == _chosen_cluster(V, dtype, vectorize, target) else {"cluster": want}


def vocab_specs(V: int, dtypes=("f32", "f16", "bf16")) -> list:
    """Every cross-entropy kernel a vocabulary of V launches from 16-byte-aligned logits of
    `dtypes`: each switch of the options (smoothing, z-loss, soft cap), training and
    inference, both id dtypes, and the rescale (`kbuild warmup --vocab V`), for calls of
    few rows and of many (`forward_keywords`); and where V is not a whole number of
    ROW_ALIGN columns, the same on rows padded to one (`strided`), which
    kbuild.linear_cross_entropy's chunks are."""
    cluster_target = target_for_arch(CLUSTER_TARGET)
    layouts = ({}, {"strided": True}) if V % ROW_ALIGN else ({},)
    specs = []
    for dtype, layout in itertools.product(dtypes, layouts):
        many = forward_keywords(V, dtype, True, MANY_ROWS, cluster_target)  # a cluster target
        for index in INDEX_DTYPES:
            for smoothing, z_loss, softcap in itertools.product((False, True), repeat=3):
                for grad in (True, False):
                    values = dict(
                        N=V,
                        dtype=dtype,
                        index_dtype=index,
                        smoothing=smoothing,
                        z_loss=z_loss,
                        softcap=softcap,
                        grad=grad,
                        vectorize=True,
                        **layout,
                    )
                    specs.append(build_cross_entropy_fwd.spec(**values))
                    if many:  # the plan of a call of many rows differs from the chooser's
                        specs.append(build_cross_entropy_fwd.spec(**values, **many))
        specs.append(build_cross_entropy_rescale.spec(N=V, dtype=dtype, vectorize=True, **layout))
    return specs
