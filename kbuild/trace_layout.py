"""The layout of a diagnostic build's per-row timestamps (`trace=True`, kbuild.dsl.trace):
what the kernel writes and bench/trace_rows.py and bench/tune.py read.

A plain module with no imports, so a machine without MLIR or torch can read it, and part of
the kernel-source fingerprint (kbuild.cache.keys), since the kernels are built from it.
"""

from __future__ import annotations

# Five SM-cycle points of a row step, then the global timer (ns) at its start.
TRACE_POINTS = ("start", "landed", "block", "cluster", "end")
TRACE_WORDS = len(TRACE_POINTS) + 1
TRACE_ITERATIONS = 64  # row steps recorded per block
