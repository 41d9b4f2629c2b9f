"""Launch planning, pure Python (no MLIR, no torch): how threads map onto a row (config.py),
the launch plan of any row kernel (rows.py), and the norms' forward and backward plans
(norms.py). Builders read a plan to emit a kernel; the ops read the same plan to launch it.
"""
