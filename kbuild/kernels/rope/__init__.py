"""Rotary position embedding, alone and after QK-norm. Kernels: kernels.py, qk_norm_kernels.py.
Ops: op.py (`kbuild.rope`), qk_norm.py (`kbuild.qk_norm_rope`).
"""
