"""Cross-entropy and the fused linear cross-entropy. Kernels: kernels.py. Ops: cross_entropy.py
(`kbuild.cross_entropy`), linear.py (`kbuild.linear_cross_entropy`), options.py (the options
both share).
"""
