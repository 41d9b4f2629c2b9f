"""kbuild: GPU kernels written as Python MLIR builders, compiled, cached and called from PyTorch.

    import kbuild
    y = kbuild.rmsnorm(x, weight, eps=1e-6)

Importing kbuild imports neither MLIR nor torch until a torch-facing name is used: kernels
compile on first use (or ahead of time with `kbuild warmup`) and load from the disk cache
afterwards, and the cache and CLI work without torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
# Declaring and launching kernels of your own (kbuild/kernels/declare.py): pure Python but
# `launch`, which is torch's.
_DECLARE = {"Arg": "kernels.table", "Param": "kernels.table", "kernel": "kernels.declare"}
# Describing an op (kbuild/ops/opdef.py): torch's.
_OPDEF = ("Feature", "Ids", "Launch", "Like", "Op", "Out", "Rows", "Scalar", "Tensors")
# Losses (kbuild/ops/loss.py, linear_loss.py), softmax (ops/softmax.py), the transformer
# block's rotary embedding (ops/rope.py) and MLP activations (ops/activations.py): torch's.
_OPS = {
    "cross_entropy": "ops.loss",
    "check_targets": "ops.loss",
    "linear_cross_entropy": "ops.linear_loss",
    "log_softmax": "ops.softmax",
    "softmax": "ops.softmax",
    "rope": "ops.rope",
    "qk_norm_rope": "ops.qk_norm_rope",
    "swiglu": "ops.activations",
    "geglu": "ops.activations",
    "gelu": "ops.activations",
}
__all__ = [
    "Arg",
    "Feature",
    "Ids",
    "Launch",
    "Like",
    "Op",
    "Out",
    "Rows",
    "Scalar",
    "Tensors",
    "FusedAddRMSNormFunction",
    "LayerNormFunction",
    "LinearFunction",
    "RMSNormFunction",
    "bias_grad",
    "check_targets",
    "cross_entropy",
    "encoder",
    "encoder_backward",
    "fused_add_rmsnorm",
    "geglu",
    "gelu",
    "kernel",
    "launch",
    "layernorm",
    "linear",
    "linear_cross_entropy",
    "log_softmax",
    "nn",
    "Param",
    "qk_norm_rope",
    "rmsnorm",
    "rope",
    "softmax",
    "swiglu",
]


def __getattr__(name: str):
    if name in _DECLARE or name in _OPS:
        where = _DECLARE.get(name) or _OPS[name]
        value = getattr(importlib.import_module(f".{where}", __name__), name)
        globals()[name] = value
        return value
    if name in _OPDEF:
        value = getattr(importlib.import_module(".ops.opdef", __name__), name)
        globals()[name] = value
        return value
    if name in __all__:
        module = importlib.import_module(".nn" if name == "nn" else ".ops", __name__)
        value = module if name == "nn" else getattr(module, name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module 'kbuild' has no attribute {name!r}")
