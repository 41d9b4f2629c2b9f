"""Launch shapes for the row kernels: how threads map onto a row. Pure Python (no MLIR).

Every norm kernel works on an (M, N) row-major matrix one row at a time. A row is handled by
`threads_per_row` consecutive threads; a block holds `rows_per_block` rows. Each thread owns
`iters` vectors of `vec` elements, at columns (i * threads_per_row + lane) * vec, so a warp's
accesses are contiguous 16-byte pieces (coalesced) and a thread sees the same columns in every
row (the backward kernels keep their dweight partials in registers because of it).

Rows that fit in registers stay there and are read once: a thread may hold `max_elems` fp32
words of row data (half that at 1024 threads, where a thread gets only 64 registers); bf16
rows are held packed, two to a word, and widened where used (dsl.rewiden).

Longer rows are split across a cluster of blocks where the target has clusters (Hopper on):
each block holds a contiguous slice, the row sums are merged through distributed shared
memory, and the row is read once. Measured on an H200 at N = 65536 against the chunked
form (bench/results/h200_tune_clusters.json, h200_tune_long_rows.json): backward RMSNorm
31% -> 75% of copy, fused 39% -> 89%, LayerNorm 20% -> 68%; fused forward 82% -> 94%,
LayerNorm forward 66% -> 68% (82% once the next row is staged in shared memory, see
plans.py). Exchanging the row sums through mbarriers instead of a cluster barrier
took them further (RMSNorm backward 83%, LayerNorm 74-79% with staged rows, fused forward
99%; h200_tune_exchange_staging.json). Eight blocks per row stays best with mbarriers too
(LayerNorm N = 65536, h200_tune_cluster_sizes.json: forward 78% and 83% with 2 or 4
larger blocks against 85%, backward 72% with 4 against 79%); clusters of 16 (non-portable)
and several rows per block of a cluster were slower (h200_tune_rows_per_block.json) and are
no longer offered.

Rows that fit one block stay in one: splitting them costs a cluster exchange per row
(RMSNorm forward N = 65536: 89% in one 1024-thread block, 79-84% split). Without clusters
(sm_80, AMD) long rows are walked in chunks, two passes, the second mostly served from L2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..dtypes import ELEMENT_BYTES

MAX_THREADS = 1024
MIN_BLOCK = 128
# Row elements a thread may hold as fp32 at <= 512 threads per block (128 registers each);
# at 1024 threads the register file allows 64 per thread, so half as many.
FORWARD_ELEMS = 64
BACKWARD_ELEMS = 64  # the same bound; their words per element count x, dy and partials
# Vectors per thread, in order of preference: 4 keeps several 16-byte loads in flight per
# thread without crowding the register file.
_ITERS_PREFERENCE = (4, 3, 5, 2, 6, 8, 7, 1, 16, 12, 10, 9, 11, 13, 14, 15)
# Backward kernels hold more per element (x, dy, w and dw partials), so few vectors per thread;
# measured on an H200 (bench/results/h200_tune_backward.json): two vectors per thread in
# blocks of 128-512 threads run at 86-98% of copy, one vector in 1024-thread blocks at
# 60-90%. The plain RMSNorm backward prefers one vector per thread up to 512 threads, where
# it can also prefetch the next row within 64 registers (99% at N = 2048, against 91%).
BACKWARD_SHAPES = ((2, 128, 512), (1, 1, 512), (2, 1, 1024), (1, 1, 1024))
RMS_BACKWARD_SHAPES = ((1, 128, 512), (2, 128, 512), (2, 1, 1024), (1, 1, 1024))
CHUNK_ITERS = 4


@dataclass(frozen=True)
class RowBudget:
    """What one thread may hold of a row, and the shapes choose_row_config tries first.

    `max_elems` bounds the fp32 words of row data a thread keeps in registers at <= 512
    threads (half that at 1024); `words_per_elem` is the register words one row element
    costs (None: 0.5 for packed bf16, else 1). `shapes` lists (iters, min threads, max
    threads) to try first, in order; then `iters_preference` orders the vectors-per-thread
    counts tried. `short_iters`: the vectors per thread of rows of at most that many warps'
    vectors (a slice of a warp per row, several rows per block); longer rows up to four
    warps' vectors take four per thread."""

    max_elems: int = FORWARD_ELEMS
    words_per_elem: float | None = None
    iters_preference: tuple[int, ...] = _ITERS_PREFERENCE
    shapes: tuple[tuple[int, int, int], ...] = ()
    short_iters: int = 4
    chunk_iters: int = CHUNK_ITERS  # vectors a thread takes per pass of a row walked in chunks
    # A peeled row that its aligned width's plan walks in chunks is held by a wider cluster
    # where one holds it (_held_in_a_wider_cluster): for the online forwards (softmax,
    # cross-entropy), where it was measured to pay.
    split_to_hold: bool = False


FORWARD_BUDGET = RowBudget()


@dataclass(frozen=True)
class RowConfig:
    N: int
    vec: int  # elements per vector access
    threads_per_row: int
    rows_per_block: int
    iters: int  # vectors per thread per row (per chunk when chunked)
    chunked: bool  # row too long for registers: loop over chunks, two passes
    cluster: int = 1  # blocks sharing a row, each a contiguous slice of it

    @property
    def block(self) -> int:
        return self.threads_per_row * self.rows_per_block

    @property
    def slice(self) -> int:
        """Elements of the row one block covers (the whole row without a cluster): N / cluster,
        rounded up to whole vectors where that does not divide (the last block's is short)."""
        if self.cluster == 1:
            return self.N
        return -(-self.N // (self.cluster * self.vec)) * self.vec

    @property
    def peel(self) -> bool:
        """Rows that are not a whole number of vectors: row r starts (r * N) % vec elements
        into a 16-byte vector, so each row's vectors are shifted back by that much (its
        `phase`) to stay aligned, and the first and last vector of a slice are partial,
        read and written element by element (dsl.RowTile)."""
        return self.vec > 1 and self.N % self.vec != 0

    @property
    def cover(self) -> int:
        """Columns the block's threads must cover: its slice, plus the vector a peeled row's
        phase may shift into view."""
        return self.slice + (self.vec - 1 if self.peel else 0)

    @property
    def span(self) -> int:
        """Elements covered by one pass of the block's threads over its slice."""
        return self.iters * self.threads_per_row * self.vec

    @property
    def chunks(self) -> int:
        """Passes over the slice (1 for a row held in registers)."""
        return -(-self.cover // self.span)

    @property
    def exact(self) -> bool:
        """No column predicates needed: the threads cover the slice exactly."""
        return not self.chunked and not self.peel and self.span == self.slice


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def vector_width(N: int, dtype: str, vectorize: bool = True) -> int:
    """Elements per access: 16 bytes when allowed (the arrays 16-byte aligned); rows that are
    not a whole number of vectors are peeled (RowConfig.peel)."""
    return 16 // ELEMENT_BYTES[dtype] if vectorize and N > 1 else 1


def choose_row_config(
    N: int,
    dtype: str,
    warp_size: int,
    vectorize: bool = True,
    budget: RowBudget = FORWARD_BUDGET,
    *,
    max_cluster: int = 1,
    threads_per_row: int | None = None,
    cluster: int | None = None,
    register_scale: float = 1.0,
) -> RowConfig:
    """Threads, vector width and rows per block for rows of N elements of `dtype`, within
    what `budget` lets a thread hold, times `register_scale` (for forward rows, the target's
    `forward_register_scale`).

    `threads_per_row` forces the row's thread count (a tuning override; rows that then do
    not fit are chunked). Rows that would be chunked are split over a cluster of up to
    `max_cluster` blocks instead (see `cluster_size`); `cluster` forces the number of blocks
    per row (a tuning override, 1 = none). A cluster's blocks hold one row each.

    Rows that are not a whole number of vectors are peeled (RowConfig.peel) where the
    row takes a block (or a cluster) of its own; shorter ones take scalar accesses: the rows
    sharing a block would each have their own phase, and a block's rows share its partials
    column by column.
    """
    cfg = _pick(N, dtype, warp_size, vectorize, budget, max_cluster, threads_per_row, cluster,
                register_scale)  # fmt: skip
    if cfg.peel and cfg.rows_per_block > 1:
        return _pick(N, dtype, warp_size, False, budget, max_cluster, threads_per_row, cluster,
                     register_scale)  # fmt: skip
    return cfg


def _pick(N, dtype, warp_size, vectorize, budget, max_cluster, threads_per_row, cluster,
          register_scale) -> RowConfig:  # fmt: skip
    """choose_row_config, before its rule for short peeled rows."""
    peel = vectorize and N % vector_width(N, dtype) != 0
    if peel and threads_per_row is None and cluster is None:
        return _peeled(N, dtype, warp_size, budget, max_cluster, register_scale)
    if cluster is None:
        one = _single_block(N, dtype, warp_size, vectorize, budget, threads_per_row, register_scale)
        if not one.chunked or max_cluster == 1:
            return one
        cluster = cluster_size(N, dtype, vectorize, max_cluster)
    if cluster == 1:
        return _single_block(
            N, dtype, warp_size, vectorize, budget, threads_per_row, register_scale
        )
    vec = vector_width(N, dtype, vectorize)
    whole = RowConfig(N, vec, 1, 1, 1, False, cluster)
    if vec == 1 or not whole.peel and N % (cluster * vec) or whole.slice * (cluster - 1) >= N:
        raise ValueError(f"a cluster of {cluster} cannot split rows of {N} into vectors")
    one = _single_block(
        N,
        dtype,
        warp_size,
        vectorize,
        budget,
        threads_per_row,
        register_scale,
        columns=whole.slice,
    )
    if one.threads_per_row < cluster:  # a block's first `cluster` threads share its sums
        raise ValueError(
            f"a cluster of {cluster} needs blocks of at least {cluster} threads; rows of {N} "
            f"split {cluster} ways take {one.threads_per_row}"
        )
    return RowConfig(N, one.vec, one.threads_per_row, 1, one.iters, one.chunked, cluster)


def _single_block(
    N: int,
    dtype: str,
    warp_size: int,
    vectorize: bool,
    budget: RowBudget,
    threads_per_row: int | None,
    register_scale: float = 1.0,
    columns: int | None = None,
) -> RowConfig:
    """choose_row_config for one block per row (per slice of `columns` of it, in a cluster)."""
    vec = vector_width(N, dtype, vectorize)
    cover = (N if columns is None else columns) + (vec - 1 if N % vec else 0)
    nv = -(-cover // vec)

    def fits(tpr: int, iters: int) -> bool:
        return _fits(tpr, iters, vec, dtype, budget, register_scale)

    if threads_per_row is not None:
        if threads_per_row % warp_size and threads_per_row > warp_size or threads_per_row < 1:
            raise ValueError(f"threads_per_row must be a multiple of {warp_size} or below it")
        if threads_per_row > MAX_THREADS:
            raise ValueError(
                f"threads_per_row must be at most {MAX_THREADS} (a block's threads), "
                f"not {threads_per_row}"
            )
        iters = -(-nv // threads_per_row)
        if fits(threads_per_row, iters):
            return _pack(N, vec, threads_per_row, iters, False)
        return _pack(N, vec, threads_per_row, budget.chunk_iters, True)

    for iters, lo, hi in budget.shapes:
        if nv % iters == 0:
            tpr = nv // iters
            if tpr % warp_size == 0 and lo <= tpr <= hi and fits(tpr, iters):
                return _pack(N, vec, tpr, iters, False)
    # Exact fits first: a whole number of warps, each thread the same number of vectors.
    for iters in budget.iters_preference:
        if nv % iters == 0:
            tpr = nv // iters
            if tpr % warp_size == 0 and fits(tpr, iters):
                return _pack(N, vec, tpr, iters, False)
    for short in dict.fromkeys((budget.short_iters, 4)):
        # Short rows: a power-of-two slice of a warp per row; `short_iters` vectors a thread
        # where the row is a power of two of them (no idle lanes), else four.
        if nv <= warp_size * short and (short == 4 or nv & (nv - 1) == 0):
            tpr = min(warp_size, _pow2_ceil(-(-nv // short)))
            return _pack(N, vec, tpr, -(-nv // tpr), False)
    tpr = min(MAX_THREADS, -(-nv // 4 // warp_size) * warp_size)
    iters = -(-nv // tpr)
    if fits(tpr, iters):
        return _pack(N, vec, tpr, iters, False)
    return _pack(N, vec, MAX_THREADS // 2, budget.chunk_iters, True)


def _fits(
    tpr: int, iters: int, vec: int, dtype: str, budget: RowBudget, register_scale: float
) -> bool:
    """Whether a thread of `tpr` per row holds `iters` vectors of the row within `budget`."""
    words_per_elem = budget.words_per_elem
    if words_per_elem is None:
        words_per_elem = 0.5 if dtype == "bf16" else 1.0
    limit = budget.max_elems if tpr <= MAX_THREADS // 2 else budget.max_elems // 2
    return tpr <= MAX_THREADS and iters * vec * words_per_elem <= limit * register_scale


def _peeled(
    N: int, dtype: str, warp_size: int, budget: RowBudget, max_cluster: int, register_scale: float
) -> RowConfig:
    """Rows not a whole number of vectors (RowConfig.peel): the shape of the aligned width
    below N (the same vectors per thread, cluster and chunking, so what was measured there
    holds), with threads added to cover the extra vector a row's phase brings into view."""
    vec = vector_width(N, dtype)
    same = dict(max_cluster=max_cluster, register_scale=register_scale)
    if N < 2 * vec:
        return choose_row_config(N, dtype, warp_size, False, budget, **same)
    aligned = choose_row_config(N - N % vec, dtype, warp_size, True, budget, **same)
    if aligned.rows_per_block > 1:  # rows sharing a block: choose_row_config's rule
        return replace(aligned, N=N)
    tpr, iters, chunked = aligned.threads_per_row, aligned.iters, aligned.chunked
    cfg = RowConfig(N, vec, tpr, 1, iters, chunked, aligned.cluster)
    if chunked and budget.split_to_hold:
        return _held_in_a_wider_cluster(N, dtype, warp_size, budget, max_cluster,
                                        register_scale, cfg)  # fmt: skip
    if chunked:
        return cfg  # the chunk loop covers the extra vector
    vectors = -(-cfg.cover // vec)
    while True:
        tpr = -(-vectors // iters // warp_size) * warp_size
        if tpr <= MAX_THREADS:
            break
        iters += 1
    if _fits(tpr, iters, vec, dtype, budget, register_scale):
        return RowConfig(N, vec, tpr, 1, iters, chunked, aligned.cluster)
    if aligned.cluster == 1 and max_cluster > 1:  # split the row rather than walk it twice
        c = cluster_size(N, dtype, True, max_cluster)
        return choose_row_config(N, dtype, warp_size, True, budget, cluster=c, **same)
    return RowConfig(N, vec, MAX_THREADS // 2, 1, budget.chunk_iters, True, aligned.cluster)


def _held_in_a_wider_cluster(N, dtype, warp_size, budget, max_cluster, register_scale,
                             chunked: RowConfig) -> RowConfig:  # fmt: skip
    """A peeled row whose aligned width's plan walks it in chunks (read twice), held instead
    by more blocks where that holds it: an aligned width's slices must be whole vectors,
    which can limit its cluster (50256 = 16 x 3141 splits 2 ways, not 8), a peeled row's
    slices are rounded up to whole vectors, so it splits as wide as the target allows.
    Measured on an H100 (2026-12-07, rows_h100.log in ../shared/measurements): softmax's
    forward at (4096, 50257) bf16 read 41.5% of copy as 50256's plan (cluster 2, chunked)
    and 66.3% with cluster 8, holding the row; its backward (two arrays a row) 68.8% as
    50256's plan and 65.7% at cluster 8, so only budgets that ask (`split_to_hold`: the
    online forwards) take it. Otherwise `chunked`, the chunk loop covering the extra
    vector."""
    c = cluster_size(N, dtype, True, max_cluster)
    if c <= chunked.cluster:
        return chunked
    wide = choose_row_config(N, dtype, warp_size, True, budget, cluster=c,
                             register_scale=register_scale, max_cluster=max_cluster)  # fmt: skip
    return chunked if wide.chunked else wide


def cluster_size(N: int, dtype: str, vectorize: bool, max_cluster: int) -> int:
    """Blocks per row: the most (a power of two up to `max_cluster`) whose slices are a
    whole number of vectors; 1 where none are. More, smaller blocks hide the per-row cluster
    barrier better (LayerNorm backward, N = 16384 on an H200: 68%, 76%, 76% of copy for
    2, 4, 8 blocks)."""
    vec = vector_width(N, dtype, vectorize)
    c = max_cluster
    if vec > 1 and N % vec:  # peeled rows: slices are rounded up to whole vectors
        while c > 1 and RowConfig(N, vec, 1, 1, 1, False, c).slice * (c - 1) >= N:
            c //= 2
        return c
    while c > 1 and (vec == 1 or N % (c * vec)):
        c //= 2
    return max(1, c)


def _pack(N: int, vec: int, tpr: int, iters: int, chunked: bool) -> RowConfig:
    rows = max(1, MIN_BLOCK // tpr)
    return RowConfig(N, vec, tpr, rows, iters, chunked)


# GPT-2's encoder backward (kernels/llmc/encoder.py): sorted positions per block of the dwte pass.
# Here, in pure Python, so the launch path (kernels/llmc/launch.py) reads it without importing MLIR.
ENCODER_CHUNK = 64
