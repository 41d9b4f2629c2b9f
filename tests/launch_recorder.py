"""Stand-ins for the CUDA side of the launch path, shared by the CPU launch tests.

`install` routes every kernel request of the ops to a fake `get_launcher(key, device,
make_spec)` (the memory tier's signature) and makes every stream 0; `pretend_cuda` makes CPU
tensors take the CUDA route of the public API and autograd (kbuild.rmsnorm, the backward
Functions), so a GPU test's whole call sequence runs here against the fake launcher.
"""

from __future__ import annotations

import importlib
import math

import torch

from kbuild import jit

# The modules (by import_module: a package attribute may be a function of the same name).
rmsnorm = importlib.import_module("kbuild.kernels.norms.rmsnorm")
layernorm = importlib.import_module("kbuild.kernels.norms.layernorm")
launch = importlib.import_module("kbuild.op.launch")
encoder = importlib.import_module("kbuild.kernels.llmc.launch")
OPS_MODULES = (rmsnorm, layernorm, launch, encoder)
TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class FakeLauncher:
    """What the launch path reads of a runtime.cuda.Launcher (launch shape); launches nothing."""

    rows_per_block = 2
    cluster = 1
    resident_blocks = resident_clusters = 3

    def __init__(self, spec):
        self.spec = spec
        self.meta = {"columns_per_block": 32}

    def __call__(self, grid, stream, *args):
        pass


class Tier:
    """A fake memory tier: every request as (key, device, spec), make_spec() only (nothing is
    built: no MLIR). `loaded` always misses, so every call shows the spec it asks for."""

    def __init__(self):
        self.requests: list = []
        self.looked_up: list = []

    def get_launcher(self, key, device, make_spec):
        self.requests.append((key, device, make_spec()))
        return FakeLauncher(self.requests[-1][2])

    def loaded(self, key):
        self.looked_up.append(key)
        return None

    @property
    def specs(self) -> list:
        return [spec for _, _, spec in self.requests]


def zeros(shape, dtype, offset: bool = False):
    """Zeros of `shape` in `dtype` (a torch dtype or its kernel name; None gives None);
    `offset`: a view one element into its storage, so its address is not 16-byte aligned."""
    if dtype is None:
        return None
    dtype = TORCH.get(dtype, dtype)
    if not offset:
        return torch.zeros(shape, dtype=dtype)
    return torch.zeros(math.prod(shape) + 1, dtype=dtype)[1:].view(shape)


def install(monkeypatch, get_launcher, loaded=lambda key: None) -> None:
    """Every module that imported get_launcher / loaded / stream_of gets the fakes (patching
    kbuild.jit alone would not reach the names the ops modules bound at import)."""
    fakes = {"get_launcher": get_launcher, "loaded": loaded, "stream_of": lambda device: 0}
    for module in (*OPS_MODULES, jit):
        for name, fake in fakes.items():
            if hasattr(module, name) and not (module is jit and name == "stream_of"):
                monkeypatch.setattr(module, name, fake)


def pretend_cuda(monkeypatch) -> None:
    """Every tensor says is_cuda (also the gradients autograd makes), and the current device is
    -1, the index CPU tensors report, so the API takes its CUDA route without a device guard."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    # The Python launch path: the C++ one dispatches by the real device (see test_native_cpu).
    monkeypatch.setattr(importlib.import_module("kbuild.kernels.norms.api"), "_native", None)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
