"""The launch plan of a row kernel, for any row family: the row's shape, a persistent grid or
one block (cluster) per row group, rows staged in shared memory ahead, the resident blocks
per multiprocessor asked of the register allocation, and how a cluster's blocks exchange
row states. Pure Python (no MLIR), so plans are tested on a CPU and read on a GPU machine.

A new family (a softmax, say) states what its rows need and calls `plan_rows`:

    plan = plan_rows(N, "bf16", target, staged=["bf16"],
                     stage_when=lambda row: row.cluster > 1,   # its own measured rule
                     **overrides)                              # tuning keywords, checked
    with Kernel(name, target, plan.row.block, plan.blocks_per_sm, cluster=plan.row.cluster,
                exchange=plan.exchange or "barrier") as k:
        walk = RowGroups(k, plan.row, rows) if plan.persistent else None
        ...  # RowTile(k, plan.row, rows, row_group=g).load(x, "bf16", pad=float("-inf"))

The norms' plans (plans.py) are the same pieces with their measured rules between them:
`plan_forward` calls `plan_rows`; `plan_backward`, whose grid is always persistent and whose
choices depend on each other more, calls the pieces below (`row_shape`, `check_stage`,
`can_stage`, `resident_blocks`, `cluster_exchange`, `with_rows_per_block`).

Every plan field a builder keyword can force names that keyword in its metadata
(`plan_field`, `override_keywords`), so a tuning manifest can name the alternatives; a
field not given is chosen in agreement with those given, and an override the shape or
target cannot honour raises ValueError naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

from ..dtypes import ELEMENT_BYTES
from ..targets import Target
from .config import (
    CHUNK_ITERS,
    FORWARD_BUDGET,
    MAX_THREADS,
    RowBudget,
    RowConfig,
    choose_row_config,
)

EXCHANGES = ("barrier", "mbarrier", "lagged")  # dsl.exchange.MODES (which imports MLIR)
SHARED_SLACK = 4 * 1024  # room kept for the row sums' slots and the like


def plan_field(*keywords: str):
    """A plan field and the builder keywords that override it."""
    return field(metadata={"keywords": keywords})


def override_keywords(plan: type) -> tuple[str, ...]:
    """The builder keywords that force fields of a plan class, in field order."""
    return tuple(k for f in fields(plan) for k in f.metadata["keywords"])


@dataclass(frozen=True)
class RowPlan:
    row: RowConfig = plan_field("threads_per_row", "cluster")
    persistent: bool = plan_field("persistent")  # each block (cluster) walks row groups
    stage: int = plan_field("stage")  # row groups copied into shared memory ahead (RowStage)
    blocks_per_sm: int | None = plan_field("blocks_per_sm")  # .minnctapersm; None: no cap
    exchange: str | None = plan_field("cluster_sync")  # EXCHANGES; None without a cluster


def plan_rows(
    N: int,
    dtype: str,
    target: Target,
    *,
    vectorize: bool = True,
    budget: RowBudget = FORWARD_BUDGET,
    register_scale: float = 1.0,
    staged: Sequence[str] = (),
    stage_when: Callable[[RowConfig], bool] | None = None,
    needs_persistent: bool = False,
    exchange: str = "mbarrier",
    resident_threads: int = 1024,
    threads_per_row: int | None = None,
    cluster: int | None = None,
    persistent: bool | None = None,
    stage: int | None = None,
    blocks_per_sm: int | None = None,
    cluster_sync: str | None = None,
) -> RowPlan:
    """The launch plan of rows of N elements of `dtype` (the widest the kernel reads or
    writes a row in: it sets the vector width) on `target`.

    What the family's rows need: `budget` (what a thread may hold of a row in registers,
    times `register_scale`: config.choose_row_config; rows that do not fit are split over a
    cluster where the target has them, else chunked); `staged`, the dtypes of the arrays a
    staged plan copies ahead (RowStage); `stage_when(row)`, the family's rule for staging
    one row group ahead where the target can (staging then takes a persistent grid);
    `needs_persistent`, a persistent grid for other reasons (parameters held across rows);
    `exchange`, the cluster exchange it prefers; `resident_threads`, the threads a
    multiprocessor should keep resident where rows need no predicates (64 registers each at
    1024; .minnctapersm).

    The rest are the tuning keywords (None: the chooser's): the row's `threads_per_row` and
    `cluster`, `persistent`, `stage` (row groups ahead), `blocks_per_sm`, `cluster_sync`."""
    row = row_shape(N, dtype, target, vectorize, budget, threads_per_row, cluster, register_scale)
    stage = check_stage(stage, target, row, list(staged))
    if stage and not staged:
        raise ValueError("stage needs the dtypes of the arrays to stage (staged=...)")
    wanted = bool(staged) and stage_when is not None and stage_when(row)
    picked_stage = int(wanted and can_stage(target, row, list(staged)))
    persistent, stage = grid_and_stage(persistent, stage, picked_stage, needs_persistent)
    blocks = resident_blocks(blocks_per_sm, target, row, row.exact, resident_threads)
    chosen_exchange = cluster_exchange(cluster_sync, row, exchange, target.warp_size)
    return RowPlan(row, persistent, stage, blocks, chosen_exchange)


def row_shape(
    N: int,
    dtype: str,
    target: Target,
    vectorize: bool,
    budget: RowBudget,
    threads_per_row: int | None,
    cluster: int | None,
    register_scale: float = 1.0,
) -> RowConfig:
    """config.choose_row_config within what `target` allows (its warp size, its clusters);
    `cluster` forced beyond them raises."""
    if cluster is not None and not 1 <= cluster <= target.max_cluster:
        raise ValueError(
            f"cluster must be from 1 to {target.max_cluster} blocks on {target.arch}, not {cluster}"
        )
    return choose_row_config(
        N,
        dtype,
        target.warp_size,
        vectorize,
        budget,
        max_cluster=target.max_cluster,
        threads_per_row=threads_per_row,
        cluster=cluster,
        register_scale=register_scale,
    )


def grid_and_stage(
    persistent: bool | None, stage: int | None, picked_stage: int, needs_persistent: bool = False
) -> tuple[bool, int]:
    """(persistent, stage) from those given (`stage` checked by check_stage) and the
    chooser's `picked_stage`: a grid is persistent where the staging given or picked, or
    `needs_persistent`, asks for it (an explicit `persistent=True` still lets the chooser
    stage rows); a staged plan needs a persistent grid."""
    if persistent is None:
        persistent = bool(picked_stage if stage is None else stage) or needs_persistent
    persistent = bool(persistent)
    if stage is None:
        stage = picked_stage if persistent else 0
    elif stage and not persistent:
        raise ValueError("stage needs a persistent grid (persistent=False was given)")
    return persistent, stage


def cluster_exchange(
    cluster_sync: str | None, row: RowConfig, preferred: str, warp_size: int
) -> str | None:
    """How the row sums of a row split over a cluster cross it, the kernel's exchange mode
    (dsl.exchange): `cluster_sync` if given (checked), else `preferred`; None without a
    cluster.

    The mbarrier exchange orders a block's reuse of its slots by the block barrier of the
    next row's reduction (dsl.row_reduce), which rows of one warp or less do not have: those
    keep the cluster barrier (only forced tuning shapes split such rows over a cluster)."""
    if cluster_sync is not None and cluster_sync not in EXCHANGES:
        raise ValueError(f"cluster_sync must be one of {EXCHANGES}, not {cluster_sync!r}")
    if cluster_sync is not None and row.cluster == 1:
        raise ValueError(f"cluster_sync={cluster_sync!r} needs rows split over a cluster")
    within_warp = row.threads_per_row <= warp_size
    if cluster_sync in ("mbarrier", "lagged") and within_warp:
        raise ValueError(
            f"cluster_sync={cluster_sync!r} needs rows of more than {warp_size} threads (a "
            f"block barrier per row); these rows take {row.threads_per_row}"
        )
    if row.cluster == 1:
        return None
    if within_warp:
        return "barrier"
    return cluster_sync or preferred


def can_stage(target: Target, row: RowConfig, dtypes: list[str], other_shared: int = 0) -> bool:
    """Whether rows of these arrays can be staged one group ahead (RowStage, depth 1) on
    `target`, next to `other_shared` bytes of shared memory the kernel already uses."""
    if not (target.async_copy and row.exact and vectors_of_16(row, dtypes)):
        return False
    staged = len(dtypes) * row.iters * 16 * row.block
    return staged + other_shared + SHARED_SLACK <= target.shared_bytes_per_block


def check_stage(stage, target: Target, row: RowConfig, dtypes: list[str]) -> int | None:
    """An explicit `stage` (True = 1), checked; None stays None (the chooser's)."""
    if stage is None:
        return None
    if not isinstance(stage, int) or stage < 0:
        raise ValueError(f"stage must be a number of row groups (0 = none), not {stage!r}")
    if stage == 0:
        return 0
    if not target.async_copy:
        raise ValueError(f"stage needs asynchronous copies (cp.async), which {target} lacks")
    if not (row.exact and vectors_of_16(row, dtypes)):
        raise ValueError(
            "stage needs rows held in registers, exactly, in 16-byte vectors; these rows "
            f"take {row.vec}-element vectors (chunked: {row.chunked}, exact: {row.exact})"
        )
    return int(stage)


def resident_blocks(
    given: int | None, target: Target, row: RowConfig, capped: bool, threads: int
) -> int | None:
    """The .minnctapersm hint: `given` (checked), else enough blocks for `threads` resident
    threads where `capped`, else None (no cap)."""
    if given is None:
        return max(1, threads // row.block) if capped else None
    if not isinstance(given, int) or given < 1:
        raise ValueError(f"blocks_per_sm must be a positive number of blocks, not {given!r}")
    if target.occupancy_attribute(given) is None:
        raise ValueError(f"blocks_per_sm needs a target with an occupancy hint, not {target}")
    return given


def with_rows_per_block(row: RowConfig, rows: int, warp_size: int) -> RowConfig:
    """`row` with `rows` rows per block (a tuning override): rows held whole by one block
    each (a chunked row adds into its workspace row as it goes, which the block's rows
    share), blocks of whole warps, at most MAX_THREADS threads."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows_per_block must be a positive number of rows, not {rows!r}")
    if row.cluster > 1 or (row.chunked and rows > 1):
        raise ValueError(
            "rows_per_block needs rows held by one block in registers (these take a cluster "
            f"of {row.cluster}, chunked: {row.chunked})"
        )
    block = row.threads_per_row * rows
    if block > MAX_THREADS or block % warp_size:
        raise ValueError(
            f"rows_per_block={rows} at {row.threads_per_row} threads a row makes blocks of "
            f"{block} threads; they must be whole warps of {warp_size}, at most {MAX_THREADS}"
        )
    return replace(row, rows_per_block=rows)


def vectors_of_16(row: RowConfig, dtypes: list[str]) -> bool:
    return all(row.vec * ELEMENT_BYTES[d] == 16 for d in dtypes)


def all_16_bit(dtypes: list[str]) -> bool:
    return all(ELEMENT_BYTES[d] == 2 for d in dtypes)


def wider(*dtypes: str | None) -> str:
    """The widest of several I/O dtypes: it sets the vector width a row tile uses."""
    return max((d for d in dtypes if d), key=lambda d: ELEMENT_BYTES[d])


# fp32 register words per element of a row kept in registers for an online (max, sum)
# reduction and a second pass over it (softmax, cross-entropy): its values and the passes'
# live temporaries, by the row's dtype. At one word the plans of 16-bit rows of 50257 and
# 256000 spilled 100-400 bytes (ptxas, sm_90), and fp32 rows of 50257 and 128256 still at
# two; at these, none from 1001 to 262144 (bench/NOTES.md). Not yet timed against one word.
ONLINE_WORDS = {"bf16": 1.25, "f16": 1.25, "f32": 2.5}


def online_budget(dtype: str) -> RowBudget:
    """The budget of a forward that holds a row of `dtype` for one online (max, sum-exp)
    reduction (softmax, cross-entropy; `row_kernel(..., online=True)`): ONLINE_WORDS words an
    element, and a peeled row its aligned width would chunk held by a wider cluster
    (RowBudget.split_to_hold)."""
    return RowBudget(words_per_elem=ONLINE_WORDS[dtype], split_to_hold=True)


def row_kernel(
    name: str, N: int, dtype: str, target: Target, *, vectorize: bool = True,
    rows_held: float = 1.0, chunk_vectors: int = CHUNK_ITERS, online: bool = False,
    **overrides,
):  # fmt: skip
    """A kernel of one row group per block (or cluster), its launch shape as `plan_rows`
    chooses for `rows_held` fp32 rows of `dtype` kept in registers (`overrides`: the tuning
    keywords); returns the dsl.Kernel, not yet entered, and the row's shape (for RowTile).
    A row too long for registers is walked in chunks of `chunk_vectors` vectors a thread
    (fewer for heavy per-element work: its temporaries live beside them). The row kernels
    written as users write theirs (softmax, cross-entropy) start here. `online`: a forward
    of one online (max, sum-exp) reduction, planned with `online_budget` (in place of
    `rows_held` and `chunk_vectors`), as its launch code may plan it too."""
    from ..dsl import Kernel  # MLIR: only builders reach this

    if online:
        budget = online_budget(dtype)
    else:
        budget = RowBudget(words_per_elem=float(rows_held), chunk_iters=int(chunk_vectors))
    plan = plan_rows(N, dtype, target, vectorize=vectorize, budget=budget, persistent=False,
                     **overrides)  # fmt: skip
    # Uncapped unless `blocks_per_sm` is given: the chooser's cap (64 registers a thread at
    # 1024 threads an SM) made ptxas (CUDA 13.0, sm_90) spill 20-204 bytes in 40 of the gated
    # activations', GELU's, softmax's and cross-entropy's bf16 kernels, 2026-12-07.
    blocks = plan.blocks_per_sm if overrides.get("blocks_per_sm") is not None else None
    k = Kernel(name, target, plan.row.block, blocks, cluster=plan.row.cluster,
               exchange=plan.exchange or "barrier")  # fmt: skip
    k.meta.update(rows_per_block=plan.row.rows_per_block, cluster=plan.row.cluster)
    return k, plan.row
