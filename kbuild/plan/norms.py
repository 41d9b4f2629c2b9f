"""Launch plans of the norm kernels: every launch-shape decision of norm_forward.py and
norm_backward.py, in plain Python (no MLIR), so the choices can be tested on a CPU.

`plan_forward` and `plan_backward` return a frozen plan: the row's shape (config.RowConfig:
threads per row, vectors, cluster, rows per block), the grid, staging, prefetching, where the
backward's dw/db partials live, which parameters stay in registers, the resident blocks per
multiprocessor asked of the register allocation, and how a cluster's blocks exchange row sums.
Each rule sits with the measurement that chose it (H200, bf16; files in bench/results/,
reasoning in bench/NOTES.md). What any row family shares (the row's shape, the persistent
grid and staging, the register cap, the cluster exchange) is row_plan.py's: `plan_forward`
is `plan_rows` with the norms' rules around it; `plan_backward` composes its pieces.

Every plan field that a builder keyword can force names that keyword in its metadata
(`row_plan.override_keywords`): `threads_per_row` and `cluster` shape the row,
`cluster_sync` sets the exchange, the others have the field's name. A field not given is
chosen, in agreement with those given (an explicit `persistent=True` still lets the chooser
stage rows); an override the shape or target cannot honour raises ValueError naming it,
none is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..dtypes import ELEMENT_BYTES
from ..targets import Target
from .config import BACKWARD_ELEMS, BACKWARD_SHAPES, RMS_BACKWARD_SHAPES, RowBudget, RowConfig
from .rows import (
    SHARED_SLACK,
    all_16_bit,
    can_stage,
    check_stage,
    cluster_exchange,
    plan_field,
    plan_rows,
    resident_blocks,
    row_shape,
    vectors_of_16,
    wider,
    with_rows_per_block,
)

RESIDENT = (None, False, "registers")  # resident_params: chooser, read per row, held
# Largest shared-memory partials, leaving room for the row sums' slots: 128 KB, or less where
# the target allows less per block (99 KB on sm_86/89/120, 64 KB of LDS on most AMD GPUs).
SHARED_PARTIALS_MAX = 128 * 1024


@dataclass(frozen=True, kw_only=True)
class NormForward:
    """What a forward kernel computes (the launch shape is the plan's)."""

    name: str
    N: int
    dtype: str  # x, y
    weight_dtype: str | None = None
    bias_dtype: str | None = None
    residual_dtype: str | None = None  # fused add: the dtype residual_out is stored in
    residual_in_dtype: str | None = None  # fused add: the residual's, when not x's (fp32)
    center: bool = False  # LayerNorm
    store_stats: bool = False  # rstd (and mean, for LayerNorm)
    eps: float
    offset: float = 0.0  # y = x_hat * (offset + w): Gemma's 1 + w, added in fp32
    strided: bool = False  # x's rows grouped at a stride (dsl.GroupedRows)


@dataclass(frozen=True, kw_only=True)
class NormBackward:
    """What a backward kernel computes. A weight gradient needs a weight (the kernel table
    turns compute_dw off without one; a direct caller asking for it gets ValueError)."""

    name: str
    N: int
    dtype: str  # dy, dx
    x_dtype: str  # the normalised input (residual_out in the fused form)
    weight_dtype: str | None = None
    center: bool = False  # LayerNorm: subtract the mean
    has_dres: bool = False  # fused form with a gradient flowing into residual_out
    dres_dtype: str | None = None  # fused form: d(residual) written too, in this dtype
    compute_dw: bool = False
    compute_db: bool = False
    offset: float = 0.0  # the forward's weight offset: dx uses offset + w, dw does not change
    strided: bool = False  # x's rows grouped at a stride (dsl.GroupedRows)

    def __post_init__(self) -> None:
        if self.compute_dw and self.weight_dtype is None:
            raise ValueError(f"{self.name}: compute_dw needs a weight (weight_dtype is None)")


@dataclass(frozen=True)
class ForwardPlan:
    row: RowConfig = plan_field("threads_per_row", "cluster")
    persistent: bool = plan_field("persistent")  # each block (cluster) walks row groups
    stage: int = plan_field("stage")  # row groups copied into shared memory ahead (RowStage)
    resident_params: str | bool = plan_field("resident_params")  # "registers": w, b held raw
    blocks_per_sm: int | None = plan_field("blocks_per_sm")  # .minnctapersm; None: no cap
    exchange: str | None = plan_field("cluster_sync")  # EXCHANGES; None without a cluster
    word_widening: bool = plan_field("word_widening")  # bf16 widened again from packed words


@dataclass(frozen=True)
class BackwardPlan:
    row: RowConfig = plan_field("threads_per_row", "cluster", "rows_per_block")
    prefetch: bool = plan_field("prefetch")  # the next row's loads issued before this row's sum
    prefetch_l2: bool = plan_field("prefetch_l2")  # one thread asks the next row into L2
    shared_partials: bool = plan_field("shared_partials")  # dw/db partials in shared memory
    stage: int = plan_field("stage")  # rows of x and dy copied into shared memory ahead
    resident_params: str | bool = plan_field("resident_params")  # "registers": w held raw
    blocks_per_sm: int | None = plan_field("blocks_per_sm")
    exchange: str | None = plan_field("cluster_sync")


def plan_forward(
    p: NormForward,
    target: Target,
    vectorize: bool,
    *,
    threads_per_row: int | None = None,
    cluster: int | None = None,
    persistent: bool | None = None,
    stage: int | None = None,
    resident_params: str | bool | None = None,
    blocks_per_sm: int | None = None,
    cluster_sync: str | None = None,
    word_widening: bool | None = None,
) -> ForwardPlan:
    """The forward's launch plan (None: the chooser's pick)."""
    fused = p.residual_dtype is not None
    row_dtype = p.residual_dtype if fused else p.dtype  # what the statistics are taken over
    vectorize = vectorize and not _peeled_grouped(p, wider(p.dtype, row_dtype))
    # Register words per row element at the peak: the row (packed when bf16; the fused form
    # has x and residual in flight) plus fp32 parameters, whose loads are issued together.
    # LayerNorm widens its packed row at each use too, but its moments cost more: at 0.5 a
    # 65536 bf16 row takes 1024 threads and spills 288 bytes (440 before the one-pass
    # moments: 31% of copy, against 66% chunked). (2-byte weights are left out: counting
    # them pushes RMSNorm N = 65536 bf16 off the register path: 88% against 67% chunked.)
    row_words = 1.0 if fused or row_dtype != "bf16" else 0.625 if p.center else 0.5
    param_words = sum(0.5 for d in (p.weight_dtype, p.bias_dtype) if d == "f32")
    budget = RowBudget(words_per_elem=row_words + param_words)
    staged = [p.dtype] + ([p.residual_in_dtype or p.dtype] if fused else [])  # x (, residual)
    _check_resident(resident_params)
    if cluster_sync == "lagged":
        raise ValueError("cluster_sync='lagged' is the backward's (staged rows); not forward")

    def stage_when(row: RowConfig) -> bool:
        # LayerNorm rows of a whole 512-thread block or split over a cluster: a persistent
        # grid that copies the next row group into shared memory while the current one is
        # reduced and written (H200, bf16: N = 16384 86% -> 90% of copy, 65536 66% -> 82%;
        # h200_tune_stage_depth.json). More groups ahead, or the forward of shorter rows (the
        # block finishes its row soon enough), lose 3-11%.
        return p.center and not fused and (row.cluster > 1 or row.block >= 512)

    # Keep >= 1024 threads resident per SM (64 registers each) where the row needs no
    # predicates; the merge of LayerNorm's moments would otherwise take 72-73 registers and
    # halve the resident blocks at N = 8192-16384 (held parameters: 768, below).
    # Row sums cross the cluster through mbarriers: no cluster barrier per row, which would
    # also wait for the block's earlier stores to complete (H200, bf16, N = 65536: LayerNorm
    # 80-83% -> 83-86% of copy, fused add + RMSNorm 92% -> 99%; h200_tune_mbarrier*.json,
    # h200_tune_exchange*.json).
    rows = plan_rows(
        p.N,
        wider(p.dtype, row_dtype),
        target,
        vectorize=vectorize,
        budget=budget,
        register_scale=target.forward_register_scale,
        staged=staged,
        stage_when=stage_when,
        needs_persistent=bool(resident_params),  # held parameters need a persistent grid
        exchange="mbarrier",
        resident_threads=1024,
        threads_per_row=threads_per_row,
        cluster=cluster,
        persistent=persistent,
        stage=stage,
        blocks_per_sm=blocks_per_sm,
        cluster_sync=cluster_sync,
    )
    row, persistent, stage = rows.row, rows.persistent, rows.stage
    params = [d for d in (p.weight_dtype, p.bias_dtype) if d is not None]
    if resident_params is None:
        # Rows split over a cluster read w and b slices of 32 KB per block in every row: the
        # 4 blocks on an SM need 128 KB of them, which L1 does not keep next to the staged
        # rows, so the row's normalisation waited on L2 (2 us of a 3.8 us row step, measured
        # with bench/trace_rows.py). Held in registers (16-bit ones), raw, they cost 16 words
        # a parameter, with 3 blocks per SM (H200, bf16, N = 65536, kernel alone: w and b
        # 84% -> 90% of copy, w alone 90% -> 91%; at 4 blocks per SM w and b spill and w
        # alone runs 86-87%: h200_tune_resident.json).
        # Measured on 256-thread blocks; the 512-thread blocks of longer rows would drop to
        # one per SM (unmeasured): those keep reading w and b.
        held = persistent and stage and row.cluster > 1 and params and row.block <= 256
        resident_params = "registers" if held and all_16_bit(params) else False
    elif resident_params:
        if not (persistent and not row.chunked):
            raise ValueError(
                "resident_params='registers' needs a persistent grid and rows held in "
                f"registers (persistent={persistent}, chunked rows: {row.chunked})"
            )
        if not params:
            raise ValueError("resident_params='registers' needs a weight or bias to hold")
    if resident_params:  # held parameters leave room for 768 resident threads, not 1024
        blocks_per_sm = resident_blocks(blocks_per_sm, target, row, row.exact, 768)
    else:
        blocks_per_sm = rows.blocks_per_sm
    # The second widening of a held bf16 row (dsl.rewiden): from 16-bit halves, or straight
    # from the packed words (one integer op a value). The words for the plain RMSNorm's rows
    # of one block of 512 threads or more (H200, bf16, kernel alone, without / with rstd:
    # N = 16384 92.0 / 92.7% -> 93.6 / 93.2% of copy, 65536 89.8 / 89.6% -> 90.8 / 90.7%;
    # ptxas spilled 8 bytes there with the halves, 232 on sm_80;
    # h200_tune_word_widening_2026-12-04.json). Level within 0.7 points on shorter rows, so
    # they keep the halves, as LayerNorm (whose forward spilled 4-8 bytes with the words at
    # N = 4096-8192) and the fused form.
    if word_widening is None:
        plain_rms = not p.center and not fused and row_dtype == "bf16"
        one_block = row.cluster == 1 and row.block >= 512 and not row.chunked
        word_widening = plain_rms and one_block and target.vendor == "nvidia"
    elif word_widening and row_dtype != "bf16":
        raise ValueError(f"word_widening widens bf16 rows held packed; these are {row_dtype}")
    word_widening = bool(word_widening)
    return ForwardPlan(
        row, persistent, stage, resident_params, blocks_per_sm, rows.exchange, word_widening
    )


def plan_backward(
    p: NormBackward,
    target: Target,
    vectorize: bool,
    *,
    threads_per_row: int | None = None,
    cluster: int | None = None,
    rows_per_block: int | None = None,
    prefetch: bool | None = None,
    prefetch_l2: bool | None = None,
    shared_partials: bool | None = None,
    stage: int | None = None,
    resident_params: str | bool | None = None,
    blocks_per_sm: int | None = None,
    cluster_sync: str | None = None,
) -> BackwardPlan:
    """The backward's launch plan (None: the chooser's pick). Its grid is persistent."""
    io = wider(p.dtype, p.x_dtype)
    b = _BackwardRows(
        p=p,
        target=target,
        io=io,
        vectorize=vectorize and not _peeled_grouped(p, io),
        threads_per_row=threads_per_row,
        n_partials=int(p.compute_dw) + int(p.compute_db),
        plain_rms=not p.center and not p.has_dres,
        most=min(SHARED_PARTIALS_MAX, target.shared_bytes_per_block - SHARED_SLACK),
    )
    _check_resident(resident_params)
    row = _backward_row(b, cluster)
    ahead = _prefetch_beside_shared_partials(b, row)
    if _takes_lagged_rows(b, row, cluster_sync, stage, prefetch, blocks_per_sm):
        shared_partials = False if shared_partials is None else shared_partials
        blocks_per_sm = 1 if blocks_per_sm is None else blocks_per_sm
        stage = 2 if stage is None else stage
        cluster_sync = cluster_sync or "lagged"
    row, shared_partials = _place_partials(b, row, shared_partials, rows_per_block, ahead)
    row = _backward_rows_per_block(b, row, rows_per_block, shared_partials)
    arrays = [p.x_dtype, p.dtype]  # staged: x and dy
    stage = check_stage(stage, target, row, arrays)
    # Exact register-resident rows: ask for >= 1024 resident threads per SM (64 registers
    # each), enough loads in flight. Predicated and chunked rows would spill under that cap.
    # (LayerNorm with both partials in registers spills 144 bytes capped: it runs uncapped.)
    capped = row.exact and (not p.center or shared_partials or not b.n_partials)
    blocks_per_sm = resident_blocks(blocks_per_sm, target, row, capped, 1024)
    stage = _backward_stage(b, row, stage, prefetch, shared_partials, arrays)
    prefetch = _backward_prefetch(row, prefetch, stage, blocks_per_sm, ahead, shared_partials)
    prefetch_l2 = _backward_prefetch_l2(b, row, prefetch_l2, prefetch, ahead, arrays)
    resident_params = _backward_resident_params(b, row, resident_params)
    exchange = _backward_exchange(b, row, cluster_sync, stage)
    choices = (prefetch, prefetch_l2, shared_partials, stage, resident_params, blocks_per_sm)
    return BackwardPlan(row, *choices, exchange)


@dataclass(frozen=True, kw_only=True)
class _BackwardRows:
    """What the steps of `plan_backward` share: the kernel, the target, and how its rows
    are shaped."""

    p: NormBackward
    target: Target
    io: str  # the row's dtype: the wider of dy's and x's
    vectorize: bool  # off for grouped rows that are peeled (_peeled_grouped)
    threads_per_row: int | None  # forced, or None
    n_partials: int  # how many of dw and db: fp32 partials kept per row element
    plain_rms: bool  # RMSNorm without the fused add
    most: int  # the largest shared-memory partials a block may take, in bytes

    def shape(self, partial_words: float, blocks: int | None) -> RowConfig:
        """The row's shape, each element costing the row's register words plus
        `partial_words` (the partials held beside it), split over `blocks` blocks (None:
        the chooser's cluster)."""
        words = (2.0 if self.io == "f32" else 1.0) + partial_words
        shapes = RMS_BACKWARD_SHAPES if self.plain_rms else BACKWARD_SHAPES
        # Short rows (QK-norm's head_dim of 64-128): one vector per thread. At four, each
        # thread's x, dy and fp32 dw partials of 32 elements spilled under the 64-register
        # cap (bf16, N = 128: 1072 bytes, 22% of copy on an H200; one vector: none).
        budget = RowBudget(BACKWARD_ELEMS, words, tuple(range(1, 17)), shapes, short_iters=1)
        p, io, target = self.p, self.io, self.target
        return row_shape(p.N, io, target, self.vectorize, budget, self.threads_per_row, blocks)


def _backward_row(b: _BackwardRows, cluster: int | None) -> RowConfig:
    """The row's shape with its partials in registers; LayerNorm's bf16 rows split over a
    cluster (neither it nor the threads forced) take the fewest blocks of 512 threads that
    hold them."""
    p, io, n_partials = b.p, b.io, b.n_partials
    row = b.shape(float(n_partials), cluster)  # partials in registers
    if cluster is None and b.threads_per_row is None and p.center and io == "bf16":
        # LayerNorm rows split over a cluster: the fewest blocks that hold their slices in
        # 512 threads, in registers, with the partials in shared memory, so the rows can be
        # staged (below). H200, bf16, N = 16384, kernel alone (h200_tune_long_backward.json):
        # 2 x 512 threads, staged, 85.5% of copy; 4 x 256, 76.9%; 8 x 128, 81.5%. At N =
        # 65536 that is the 8 x 512 already chosen; other blocks than 512 keep the pick.
        c = 2
        while c < row.cluster:
            alone = b.shape(0.0, c)
            if alone.exact and alone.block == 512 and n_partials * alone.slice * 4 <= b.most:
                row = b.shape(float(n_partials), c)
                break
            c *= 2
    return row


def _prefetch_beside_shared_partials(b: _BackwardRows, row: RowConfig) -> bool:
    """`ahead`: whether the row's partials go to shared memory so that the registers they
    free hold the next row, prefetched."""
    # Plain RMSNorm rows of one 1024-thread block at two vectors a thread (bf16 N = 16384): dw
    # partials in shared memory free the registers to prefetch the next row (85% -> 91%,
    # with prefetch_l2 95%: h200_tune_long_backward.json). Measured on NVIDIA only.
    ahead = b.plain_rms and b.target.vendor == "nvidia" and row.cluster == 1
    ahead = ahead and row.block >= 1024 and row.iters <= 2
    return ahead and not row.chunked and b.n_partials > 0


def _takes_lagged_rows(
    b: _BackwardRows,
    row: RowConfig,
    cluster_sync: str | None,
    stage: int | None,
    prefetch: bool | None,
    blocks_per_sm: int | None,
) -> bool:
    """Whether the row takes the lagged exchange's plan by default (the fields not forced:
    partials in registers, one block an SM, rows staged two groups ahead)."""
    # Plain RMSNorm rows split over a cluster of 512-thread blocks at two vectors a thread
    # (bf16 N = 65536): one block an SM with its dw partials in registers, rows staged two
    # groups ahead, and the row sums exchanged a row late (dsl.exchange, "lagged"), so their
    # latency is spent on the next row. H200, kernel alone with its column sum: 84% of copy
    # -> 87-93% (h200_tune_lagged_2026-12-04.json; 88% without the lag). LayerNorm's rows, with
    # twice the work a row, lose with it (78% -> 60-73%): one block an SM then has no
    # slack for the cluster's slowest block, and the exchange adds no overlap.
    # Not where a forced field rules the plan out (unstaged rows, a register prefetch, two
    # blocks an SM: 216 bytes of spills).
    target = b.target
    return bool(
        b.plain_rms
        and b.n_partials
        and cluster_sync in (None, "lagged")
        and stage != 0
        and not prefetch
        and blocks_per_sm in (None, 1)
        and row.cluster > 1
        and row.block == 512
        and row.iters == 2
        and row.exact
        and b.io == "bf16"  # as measured (f16 rows widen to fp32 copies: 128 registers)
        and target.vendor == "nvidia"
        and target.async_copy
    )


def _place_partials(
    b: _BackwardRows,
    row: RowConfig,
    shared_partials: bool | None,
    rows_per_block: int | None,
    ahead: bool,
) -> tuple[RowConfig, bool]:
    """Where the dw/db partials live: (the row's shape, whether they are in shared memory).
    In shared memory, the row is shaped for itself alone, without them."""
    if shared_partials is None:
        # Measured on an H200 (bench/results/h200_tune_shared_partials.json): shared partials
        # win for the fused backward (97-103% of copy against 91-100%) and for every row split
        # over a cluster (LayerNorm N = 65536: 65% against 50%); a LayerNorm row that fits one
        # block runs best with register partials and prefetch, uncapped (88%).
        wanted = b.p.has_dres or row.cluster > 1 or ahead
    else:
        wanted = shared_partials
    if wanted and not b.n_partials:
        if shared_partials:
            raise ValueError("shared_partials needs dw or db partials (this kernel has none)")
        wanted = False
    if wanted:  # a shape for the row alone, partials off registers
        alone = b.shape(0.0, row.cluster)
        if rows_per_block is not None:
            alone = with_rows_per_block(alone, rows_per_block, b.target.warp_size)
        size = b.n_partials * alone.slice * alone.rows_per_block * 4
        wanted = not alone.chunked and size <= b.most
        if shared_partials and not wanted:
            raise ValueError(
                f"shared_partials needs rows held in registers and at most {b.most} bytes of "
                f"partials per block; these take {size} (chunked rows: {alone.chunked})"
            )
        row = alone if wanted else row
    return row, bool(wanted)


def _backward_rows_per_block(
    b: _BackwardRows, row: RowConfig, rows_per_block: int | None, shared_partials: bool
) -> RowConfig:
    """The row's shape with its rows per block: as forced, one for chunked rows, four for
    LayerNorm's 128-thread rows of two vectors a thread."""
    p, target = b.p, b.target
    if rows_per_block is not None:
        return with_rows_per_block(row, rows_per_block, target.warp_size)
    if row.chunked and row.rows_per_block > 1:
        # A chunked row adds into its workspace row as it goes; the block's rows share one.
        return replace(row, rows_per_block=1)
    if p.center and not shared_partials and b.io == "bf16" and target.max_cluster > 1:
        # LayerNorm rows of 128 threads at two vectors a thread (bf16 N = 2048): four to a
        # block leave a quarter of the partial rows for the column sum (H200, with the column
        # sum: 83% -> 86% of copy; h200_tune_short_rows_2026-12-04.json). Not at one vector (N =
        # 1024: 92 registers, one block per SM, 80% -> 72%) nor at 256 threads (N = 4096:
        # two rows a block spill); with 16-bit weights only (fp32 ones spill 16 bytes at the
        # 128 registers of 512 threads), on Hopper and later (sm_80 spills), as measured.
        w16 = p.weight_dtype is None or all_16_bit([p.weight_dtype])
        if w16 and row.cluster == 1 and row.block == 128 and row.iters == 2 and row.exact:
            return with_rows_per_block(row, 4, target.warp_size)
    return row


def _backward_stage(
    b: _BackwardRows,
    row: RowConfig,
    stage: int | None,
    prefetch: bool | None,
    shared_partials: bool,
    arrays: list[str],
) -> int:
    """The row groups of x and dy copied into shared memory ahead: as forced, none with a
    forced prefetch, else 1 for the long rows it was measured to lift."""
    if stage is None and prefetch:
        return 0  # the next row goes into registers, not shared memory
    if stage is not None:
        return stage
    # Measured on an H200 (h200_tune_stage_backward.json, h200_tune_exchange_staging.json):
    # staging lifts the fused backward's longest rows (N = 16384: 97% -> 99% of copy;
    # 65536: 90% -> 95%) and LayerNorm rows split over a cluster of 512-thread blocks
    # (N = 65536, with mbarrier exchanges: 70% -> 78%); it costs the plain RMSNorm
    # backward and LayerNorm's smaller blocks 1-5%.
    p = b.p
    partial_bytes = b.n_partials * row.slice * row.rows_per_block * 4 if shared_partials else 0
    long_fused = p.has_dres and (row.cluster > 1 or row.block >= 1024)
    long_center = p.center and row.cluster > 1 and row.block >= 512
    staged = (long_fused or long_center) and can_stage(b.target, row, arrays, partial_bytes)
    return int(staged)


def _backward_prefetch(
    row: RowConfig,
    prefetch: bool | None,
    stage: int | None,
    blocks_per_sm: int | None,
    ahead: bool,
    shared_partials: bool,
) -> bool:
    """Whether the next row's loads are issued into registers before this row's sum."""
    if prefetch is None:
        # The prefetched row doubles the raw row's registers: under the 64-register cap that
        # spills from two vectors per thread on (measured on an H200: 61-64% against 91-95%).
        fits = blocks_per_sm is None or row.iters == 1 or (ahead and shared_partials)
        prefetch = fits and not stage and not row.chunked
    elif prefetch and (stage or row.chunked):
        raise ValueError(
            "prefetch loads the next row into registers: not with staged rows (stage="
            f"{stage}) nor chunked ones (chunked rows: {row.chunked})"
        )
    return bool(prefetch)


def _backward_prefetch_l2(
    b: _BackwardRows,
    row: RowConfig,
    prefetch_l2: bool | None,
    prefetch: bool,
    ahead: bool,
    arrays: list[str],
) -> bool:
    """Whether one thread asks the next row into L2."""
    target = b.target
    if prefetch_l2 is None:
        # The plain RMSNorm backward's 16-bit rows of two or more vectors a thread, one row a
        # block: the next row asked into L2 (H200, bf16, kernel alone,
        # h200_tune_long_backward.json: N = 8192 95% -> 97% of copy, 16384 85% -> 93%, 65536
        # 85% -> 88%). LayerNorm loses 1-4% with it (8192-65536), as did the fused backward in
        # earlier sweeps (h200_tune_l2_persistent.json, h200_tune_cluster_sizes.json).
        wide = b.plain_rms and row.iters >= 2 and row.exact and row.rows_per_block == 1
        wide = wide and all_16_bit([b.io]) and (ahead or not prefetch)
        prefetch_l2 = wide and target.l2_prefetch and vectors_of_16(row, arrays)
    elif prefetch_l2 and not (target.l2_prefetch and vectors_of_16(row, arrays)):
        raise ValueError(f"prefetch_l2 needs 16-byte vectors on Hopper or later, not {target}")
    return bool(prefetch_l2)


def _backward_resident_params(
    b: _BackwardRows, row: RowConfig, resident_params: str | bool | None
) -> str | bool:
    """resident_params: "registers" where w is held raw in registers across the row loop,
    else False."""
    p = b.p
    if resident_params is None:
        # Rows split over a cluster: w is read for every row, and each row's sums wait for it
        # (from L2 where the partials and staged rows leave L1 too little room). Held raw in
        # registers instead (16-bit w: 8 words a thread at 512 threads). H200, bf16, N =
        # 65536, kernel alone: LayerNorm 75% -> 79% of copy, RMSNorm 82% -> 86%
        # (h200_tune_resident.json). bf16 rows only: they stay packed until used
        # (dsl.rewiden); f16 rows already spill at the cap and would spill more. Not the fused
        # form with a residual gradient: it gains 94% -> 96% but spills 4 bytes, and the
        # bench kernels stay spill-free (tests/test_kernels_ir.py).
        # Measured on 512-thread blocks; the 1024-thread blocks of some longer rows are not
        # (RMSNorm at N = 262144 spills more with it).
        w16 = p.weight_dtype is not None and all_16_bit([p.weight_dtype])
        split = row.cluster > 1 and row.block <= 512 and not row.chunked
        held = w16 and b.io == "bf16" and split and not p.has_dres
        return "registers" if held else False
    if resident_params:
        if row.chunked:
            raise ValueError("resident_params needs rows held in registers (this row is chunked)")
        if p.weight_dtype is None:
            raise ValueError("resident_params='registers' needs a weight to hold")
    return resident_params


def _backward_exchange(
    b: _BackwardRows, row: RowConfig, cluster_sync: str | None, stage: int | None
) -> str | None:
    """How a cluster's blocks exchange row sums (None without a cluster)."""
    # Measured on an H200 (bf16; h200_tune_mbarrier*.json, h200_tune_exchange_staging.json):
    # row sums through mbarriers lift RMSNorm N = 65536 from 75% to 84% of copy, LayerNorm
    # 16384 from 79% to 82-83% and, with staged rows, LayerNorm 65536 from 70% to 78%; the
    # fused backward's staged rows keep the cluster barrier (95% against 88%).
    preferred = "barrier" if stage and b.p.has_dres else "mbarrier"
    exchange = cluster_exchange(cluster_sync, row, preferred, b.target.warp_size)
    if exchange == "lagged" and not stage:
        raise ValueError(f"cluster_sync='lagged' needs staged rows (stage >= 1), not stage={stage}")
    return exchange


def _check_resident(resident_params: str | bool | None) -> None:
    if resident_params not in RESIDENT:
        raise ValueError(
            f"resident_params must be None, False or 'registers', not {resident_params!r}"
        )


def _peeled_grouped(p: NormForward | NormBackward, dtype: str) -> bool:
    """Grouped rows (a strided x) not a whole number of vectors long: x's rows and the dense
    ones would start at different phases (RowConfig.peel), so they take scalar accesses."""
    return getattr(p, "strided", False) and p.N % (16 // ELEMENT_BYTES[dtype]) != 0
