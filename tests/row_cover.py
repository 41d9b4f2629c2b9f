"""A model of which columns of a row RowTile's threads touch (dsl/rows.py), for the tests of
the row plans (tests/test_peeled_rows_cpu.py, the example's in test_user_kernels_cpu.py)."""

from __future__ import annotations

from kbuild.plan.config import RowConfig


def covered(cfg: RowConfig, phase_of_row) -> list[list[int]]:
    """For each row phase: how often each column of the row is touched by the threads'
    guarded elements, as RowTile computes them (columns shifted back by the phase, elements
    kept where 0 <= column < the slice's end); asserts every vector access is aligned."""
    from kbuild.dsl.rows import thread_columns  # imports MLIR, which the GPU machine lacks

    counts = []
    for phase in range(cfg.vec) if cfg.peel else [0]:  # aligned rows all start at 0
        hits = [0] * cfg.N
        for rank in range(cfg.cluster):
            first = rank * cfg.slice
            end = min(cfg.slice, cfg.N - first)
            offset = phase_of_row(phase) + first  # the slice's start, in elements
            assert offset % cfg.vec == phase  # slices start at the row's phase
            for start in range(0, cfg.chunks * cfg.span, cfg.span):
                for lane in range(cfg.threads_per_row):
                    for col in thread_columns(cfg, lane, start):
                        col -= phase if cfg.peel else 0
                        assert (offset + col) % cfg.vec == 0, "a vector access off alignment"
                        for c in range(col, col + cfg.vec):
                            if 0 <= c < end:
                                hits[first + c] += 1
        counts.append(hits)
    return counts
