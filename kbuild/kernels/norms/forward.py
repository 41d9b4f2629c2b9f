"""The forward kernel shared by RMSNorm, fused add + RMSNorm and LayerNorm.

For one row of N elements, fp32 math whatever the I/O dtype:

    RMSNorm:    rstd = 1 / sqrt(sum(x^2) / N + eps),            y = x * rstd * (offset + w)
    LayerNorm:  mean = sum(x) / N
                rstd = 1 / sqrt(sum((x - mean)^2) / N + eps),   y = (x - mean) * rstd * w + b
    fused add:  s = round_to_residual_dtype(x + residual) is stored as residual_out and
                normalised in place of x (from exactly the stored values); the residual
                comes in x's dtype or, continuing an fp32 residual stream, in fp32

The LayerNorm variance is never taken as E[x^2] - mean^2, which loses all precision for rows
with a large mean: each thread centres its own elements on their mean (count, mean, M2), and
the row merges those states pairwise (Chan et al.), one reduction and one barrier. The
moments of fp32 rows are of x minus the row's first element, so the merges round at the
row's spread, not at its mean; the mean is rounded once at its own size, as x itself is. Chunked
rows (too long for registers) merge chunk by chunk, then take a second pass (mostly from
L2) to normalise.

One row per `threads_per_row` threads; M is a runtime argument; N, dtypes, eps and the flags
are compile-time constants. Stats (fp32, one per row) are written when asked for backward.

Grid: one block (cluster) per row group; or, for LayerNorm rows that take a whole 512-thread
block or a cluster, persistent: each block walks its row groups and copies the next group's
input into shared memory (`RowStage`, `cp.async`) while it reduces and writes the current one,
so its loads are always in flight (H200, bf16: N = 16384 85% -> 92% of copy, 65536 68% -> 87%).
Rows split over a cluster exchange their sums through mbarriers (dsl.exchange) and
hold their 16-bit w and b in registers for the whole loop (`resident_params`).
"""

from __future__ import annotations

from ...dsl import (
    GroupedRows,
    Kernel,
    RowGroups,
    RowStage,
    RowTile,
    Staged,
    V,
    cast,
    const,
    get_llvm_ptr,
    hsum,
    load,
    loop,
    opaque,
    rewiden_all,
    rsqrt,
    select,
    to_f32,
    widen,
)
from ...dsl.trace import Trace
from ...plan.norms import ForwardPlan, NormForward, plan_forward
from ...targets import Target


def build_norm_forward(
    p: NormForward,
    target: Target,
    vectorize: bool,
    *,
    trace: bool = False,
    **overrides: int | bool | str | None,
) -> Kernel:
    """Launch arguments: x, [residual], [weight], [bias], y, [residual_out], [mean], [rstd], M,
    [x_group, x_stride, x_group_magic] (a strided x: GroupedRows).
    Grid: one block per row group, times the cluster size; or, persistent, as many blocks
    (clusters) as the device holds at once, each walking row groups.

    `overrides`: launch-plan fields forced for tuning (the forward builders pass them
    through): the keywords of plans.ForwardPlan, checked by plans.plan_forward. `trace`: a
    diagnostic build of a persistent grid, per-row timestamps into an extra `trace`
    argument (dsl.trace)."""
    plan = plan_forward(p, target, vectorize, **overrides)
    if trace and not plan.persistent:
        raise ValueError("trace times the steps of a persistent grid's row loop")
    cfg = plan.row
    exchange = plan.exchange or "barrier"  # a kernel without clusters takes the default
    with Kernel(
        p.name, target, cfg.block, plan.blocks_per_sm, cluster=cfg.cluster, exchange=exchange
    ) as k:
        if trace:
            k.trace = Trace(k)
        f = _Forward(k, p, plan)
        if f.staging is not None:  # persistent, the next row group's inputs copied ahead
            f.staging.loop(f.walk, [], f.step)
        elif plan.persistent:  # each block (cluster) walks its row groups
            f.walk.loop([], f.step)
        else:  # one row group a block (cluster)
            f.row(RowTile(k, cfg, f.rows), None)
        grid = "persistent" if plan.persistent else "rows"
        k.meta.update(rows_per_block=cfg.rows_per_block, grid=grid, cluster=cfg.cluster)
    return k


class _Forward:
    """The kernel's arguments, the parameters it holds and the staging of its inputs, and
    the math of one row group. Made inside the kernel: the arguments are declared, and the
    held parameters loaded, in that order."""

    def __init__(self, k: Kernel, p: NormForward, plan: ForwardPlan) -> None:
        self.k, self.p, self.plan = k, p, plan
        cfg = self.cfg = plan.row
        fused = self.fused = p.residual_dtype is not None
        self.row_dtype = p.residual_dtype if fused else p.dtype  # the statistics are taken over it
        self.x_ptr = k.ptr("x")
        self.res_ptr = k.ptr("residual") if fused else None
        self.w_ptr = k.ptr("weight") if p.weight_dtype else None
        self.b_ptr = k.ptr("bias") if p.bias_dtype else None
        self.y_ptr = k.ptr("y")
        self.res_out_ptr = k.ptr("residual_out") if fused else None
        self.mean_ptr = k.ptr("mean") if p.store_stats and p.center else None
        self.rstd_ptr = k.ptr("rstd") if p.store_stats else None
        rows = self.rows = k.i64("M")
        self.x_rows = GroupedRows(k, p.N) if p.strided else None  # x's rows at a two-level stride
        self.inv_n = 1.0 / p.N
        self.walk = RowGroups(k, cfg, rows) if plan.persistent else None
        self.params = {"weight": (self.w_ptr, p.weight_dtype), "bias": (self.b_ptr, p.bias_dtype)}
        # Parameter name -> this thread's columns of it, raw in registers (a thread of a
        # persistent grid sees the same columns in every row).
        self.resident: dict[str, list[V]] = {}
        if plan.resident_params:
            home = RowTile(k, cfg, rows, row_group=self.walk.first)
            for name, (ptr, dtype) in self.params.items():
                if ptr is not None:
                    self.resident[name] = home.load_param(ptr, dtype)
        self.res_in_dtype = p.residual_in_dtype or p.dtype  # an fp32 residual stream comes in fp32
        inputs = [(self.x_ptr, p.dtype, self.x_rows)]
        inputs += [(self.res_ptr, self.res_in_dtype)] if fused else []
        self.staging = RowStage(k, cfg, inputs, plan.stage) if plan.stage else None
        # fp32 LayerNorm takes its moments of x - shift, shift = the row's first element
        # (one broadcast load): the merges then round at the row's spread, not at its mean
        # (x = 1000 + randn: 2^-24 * 1000 per merge level, which add up to 7x torch's
        # fp32 error). 16-bit inputs carry 2^-8 or 2^-11 of their own, far above any
        # merge rounding, and skip it (it costs 3-5% of bandwidth at N = 8192-16384).
        self.shifted_moments = p.center and p.dtype == "f32"

    def step(self, g: V, phase: V | None, _: list[V], staged: Staged | None = None) -> list[V]:
        """The row loop's step: row group g."""
        self.row(RowTile(self.k, self.cfg, self.rows, row_group=g), phase, staged)
        return []

    def row(self, t: RowTile, phase: V | None, staged: Staged | None = None) -> None:
        """One row group: statistics, normalised output, stats. `phase`: see RowGroups.
        `staged`: the row's inputs, from a RowStage (released once read)."""
        reused = phase is not None or self.plan.persistent  # the row sums' slots are used again
        shift = self.row_shift(t)
        normalize_row = self.chunked_row if self.cfg.chunked else self.held_row
        mean, rstd = normalize_row(t, staged, shift, reused, phase)
        if self.mean_ptr is not None:
            t.store_row_scalar(self.mean_ptr, mean)
        if self.rstd_ptr is not None:
            t.store_row_scalar(self.rstd_ptr, rstd)

    def held_row(self, t: RowTile, staged, shift, reused: bool, phase) -> tuple[V | None, V]:
        """A row held in registers: read once, its statistics, then its output. Returns the
        row's (mean, rstd)."""
        p = self.p
        x = self.row_input(t, staged)  # held raw, widened at each use (see dsl.rewiden)
        state = self.moments(t, shift, x) if p.center else [_sum_squares(widen(x))]
        if staged is not None:
            staged.release()  # x is in registers now: refill the buffer
        mean, rstd = self.statistics(t, state, shift, reused, phase)
        self.normalize(t, x, mean, rstd)
        return mean, rstd

    def chunked_row(self, t: RowTile, staged, shift, reused: bool, phase) -> tuple[V | None, V]:
        """A row too long for registers, in two passes over its chunks: its statistics, then
        its output (reading the row again, mostly from L2). Returns the row's (mean, rstd)."""
        p, cfg = self.p, self.cfg
        chunks = const(cfg.chunks, "i64")  # over this block's slice
        step, zero = const(1, "i64"), const(0, "i64")
        # The first pass makes residual_out; the second reads it back.
        if self.fused:
            source, source_dtype = self.res_out_ptr, self.row_dtype
        else:
            source, source_dtype = self.x_ptr, p.dtype
        source_rows = None if self.fused else self.x_rows

        def first(c: V, acc: list[V]) -> list[V]:
            x = self.row_input(t, staged, c * cfg.span)
            if p.center:
                return merge_moments(acc, self.moments(t, shift, x, c * cfg.span))
            return [acc[0] + _sum_squares(widen(x))]

        # LayerNorm's chunk counts differ when the last chunk is partial: carried as values.
        init = [const(0.0)] * (3 if p.center else 1)
        state = loop(zero, chunks, step, init, first)
        mean, rstd = self.statistics(t, state, shift, reused, phase)

        def write(c: V, _: list[V]) -> list[V]:
            x = t.load(source, source_dtype, c * cfg.span, source_rows)
            self.normalize(t, x, mean, rstd, c * cfg.span)
            return []

        loop(zero, chunks, step, [], write)
        return mean, rstd

    def row_input(self, t: RowTile, staged, start: V | int = 0) -> list[V]:
        """The row the statistics are taken over, raw in `row_dtype`; with the fused add,
        stored as residual_out first."""
        p = self.p
        if staged is not None:
            x = staged.values[0]
        else:
            x = t.load(self.x_ptr, p.dtype, start, self.x_rows)
        if not self.fused:
            return x
        if staged is not None:
            residual = widen(staged.values[1])
        else:
            residual = widen(t.load(self.res_ptr, self.res_in_dtype, start))
        row_dtype = self.row_dtype
        s = [cast(a + b, row_dtype) for a, b in zip(widen(x), residual, strict=True)]
        t.store(self.res_out_ptr, s, row_dtype, start)
        return s

    def row_shift(self, t: RowTile) -> V | None:
        """The row's first element in fp32, which shifted moments are taken about (see
        `shifted_moments`); None without them."""
        if not self.shifted_moments:
            return None
        p, x_rows = self.p, self.x_rows
        row_start = t.row * p.N if x_rows is None else x_rows.offset(t) - t.first
        return to_f32(load(get_llvm_ptr(self.x_ptr, row_start, p.dtype), p.dtype))

    def moments(self, t: RowTile, shift: V | None, x: list[V], start: V | int = 0) -> list[V]:
        """(count, mean, M2) of this thread's elements of one (chunk of a) row,
        shifted: the mean of its own x - shift, then squares centred on it."""
        shifted_moments = self.shifted_moments
        inside = t.inside(start)

        def shifted(values: list[V]) -> list[V]:  # x - shift; 0 past the row's end
            if not shifted_moments:
                return values  # padding loads as 0
            out = [v - shift for v in values]
            return [d if g is None else select(g, d, 0.0) for d, g in zip(out, inside, strict=True)]

        if all(g is None for g in inside):
            count = float(len(x) * self.cfg.vec)  # the same in every thread (dsl.reduce)
        else:
            count = const(0.0)
            for n in t.count_inside(start):
                count = count + n
        local_mean = _sum(shifted(widen(x))) * _reciprocal(count)
        # M2 is insensitive to where exactly it is centred (second order): one
        # rounded centre, one subtraction per element.
        centre = shift + local_mean if shifted_moments else local_mean
        m2 = const(0.0)
        for d, g in zip(rewiden_all(x, self.plan.word_widening), inside, strict=True):
            d = d - centre
            d = d if g is None else select(g, d, 0.0)
            m2 = m2 + hsum(d * d)
        return [count, local_mean, m2]

    def statistics(self, t: RowTile, state: list[V], shift, reused: bool, phase):
        """The row's mean (None for RMSNorm) and rstd = 1 / sqrt(M2 / N + eps), M2 =
        sum((x - mean)^2) (RMSNorm: sum(x^2)), from this thread's `state` reduced over the
        row."""
        p, mean = self.p, None
        if p.center:
            _, mean, m2 = t.reduce(state, merge_moments, reused, phase)
            if self.shifted_moments:
                mean = shift + mean  # rounded once, at the mean's size, as x is
        else:
            (m2,) = t.sum(*state, reused=reused, phase=phase)
        return mean, rsqrt(m2 * self.inv_n + p.eps)

    def param(self, t: RowTile, name: str, start: V | int) -> list[V]:
        """This thread's vectors of w or b, raw."""
        held = self.resident.get(name)
        if held is not None:  # widened afresh in each row, not hoisted: see opaque
            return [opaque(v) for v in held]
        ptr, dtype = self.params[name]
        return t.load_param(ptr, dtype, start)

    def normalize(self, t: RowTile, x: list[V], mean, rstd: V, start: V | int = 0) -> None:
        """y = (x - mean) * rstd (x * rstd for RMSNorm), times (offset +) w, plus b."""
        p = self.p
        xs = rewiden_all(x, self.plan.word_widening)
        y = [(v - mean) * rstd for v in xs] if mean is not None else [v * rstd for v in xs]
        if self.w_ptr is not None:
            w = widen(self.param(t, "weight", start))
            if p.offset:  # in fp32, never added to the stored 16-bit weight
                w = [wi + p.offset for wi in w]
            y = [yi * wi for yi, wi in zip(y, w, strict=True)]
        if self.b_ptr is not None:
            b = widen(self.param(t, "bias", start))
            y = [yi + bi for yi, bi in zip(y, b, strict=True)]
        t.store(self.y_ptr, y, p.dtype, start)


def _reciprocal(n: V | float) -> V | float:
    """1 / n, or 0 where n is 0 (a thread or chunk with no elements inside the row)."""
    if not isinstance(n, V):
        return 1.0 / n if n > 0 else 0.0
    return select(n > 0.0, 1.0 / n, 0.0)


def merge_moments(a: list[V], b: list[V]) -> list[V]:
    """Merge two (count, mean, M2) states (Chan et al.): the combined mean, and M2 grown by
    the squared gap between the means. Symmetric bit for bit, as dsl.row_reduce needs."""
    (na, ma, qa), (nb, mb, qb) = a, b
    n = na + nb
    inv = _reciprocal(n)
    gap = mb - ma
    return [n, (na * ma + nb * mb) * inv, qa + qb + gap * gap * (na * nb * inv)]


def _sum(x: list[V]) -> V:
    total = hsum(x[0])
    for v in x[1:]:
        total = total + hsum(v)
    return total


def _sum_squares(x: list[V]) -> V:
    total = hsum(x[0] * x[0])
    for v in x[1:]:
        total = total + hsum(v * v)
    return total
