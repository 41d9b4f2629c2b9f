"""RMSNorm, fused add + RMSNorm and LayerNorm. Kernels: kernels.py (declarations and builders),
forward.py and backward.py (the shared emitters). Ops: api.py (the public functions),
rmsnorm.py and layernorm.py (specs, launches, torch references), autograd.py, custom_ops.py
(the kbuild::* operators of the C++ hot path and torch.compile).
"""
