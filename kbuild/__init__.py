"""kbuild: GPU kernels written as Python MLIR builders, compiled, cached and called from PyTorch.

    import kbuild
    y = kbuild.rmsnorm(x, weight, eps=1e-6)

Importing kbuild imports neither MLIR nor torch until a torch-facing name is used: kernels
compile on first use (or ahead of time with `kbuild warmup`) and load from the disk cache
afterwards, and the cache and CLI work without torch.
"""

from __future__ import annotations

import importlib

# Declaring and launching kernels of your own (kbuild/registry.py): pure Python but
# `launch`, which is torch's.
_DECLARE = {"Arg": "registry", "Param": "registry", "kernel": "registry"}
# Describing an op (kbuild/op/opdef.py): torch's.
_OPDEF = ("Feature", "Ids", "Launch", "Like", "Op", "Out", "Rows", "Scalar", "Tensors")
# The ops, each in its family's package under kbuild/kernels/ (norms, loss, softmax, rope,
# activations, llmc): torch's.
_OPS = {
    "rmsnorm": "kernels.norms.api",
    "layernorm": "kernels.norms.api",
    "fused_add_rmsnorm": "kernels.norms.api",
    "RMSNormFunction": "kernels.norms.autograd",
    "LayerNormFunction": "kernels.norms.autograd",
    "FusedAddRMSNormFunction": "kernels.norms.autograd",
    "cross_entropy": "kernels.loss.cross_entropy",
    "check_targets": "kernels.loss.cross_entropy",
    "linear_cross_entropy": "kernels.loss.linear",
    "log_softmax": "kernels.softmax.op",
    "softmax": "kernels.softmax.op",
    "rope": "kernels.rope.op",
    "qk_norm_rope": "kernels.rope.qk_norm",
    "swiglu": "kernels.activations.op",
    "geglu": "kernels.activations.op",
    "gelu": "kernels.activations.op",
    "encoder": "kernels.llmc.op",
    "encoder_backward": "kernels.llmc.op",
    "bias_grad": "kernels.llmc.op",
    "linear": "kernels.llmc.op",
    "LinearFunction": "kernels.llmc.op",
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
    if name == "__version__":
        from .version import __version__

        return __version__
    if name in _DECLARE or name in _OPS:
        where = _DECLARE.get(name) or _OPS[name]
        value = getattr(importlib.import_module(f".{where}", __name__), name)
        globals()[name] = value
        return value
    if name in _OPDEF:
        value = getattr(importlib.import_module(".op.opdef", __name__), name)
        globals()[name] = value
        return value
    if name == "launch":
        value = importlib.import_module(".op.launch", __name__).launch_kernel
        globals()[name] = value
        return value
    if name == "nn":
        value = importlib.import_module(".nn", __name__)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module 'kbuild' has no attribute {name!r}")
