"""HIP runtime: load HSACO code objects into a ROCm device's context and launch them. No MLIR,
no torch (the caller gives the device's compute-unit count).

Written to the HIP module API (`hipModuleLoadData`, `hipModuleGetFunction`,
`hipModuleOccupancyMaxActiveBlocksPerMultiprocessor`, `hipModuleLaunchKernel`) through ctypes
on libamdhip64, the same prepared-launcher design as runtime/cuda.py (runtime/prepared.py:
arguments packed once into storage the `void**` kernel parameters point at; HIP fills the
code object's hidden arguments itself). HIP has no clusters; a persistent grid is the
resident blocks per compute unit (the occupancy query) times the compute units.

Not yet run on an AMD GPU: the loading and launch sequence is tested on CPU against a fake
libamdhip64 (tests/test_hip_runtime_cpu.py); the tests marked `rocm` run it where ROCm is.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re

from ..artifact import Artifact
from .prepared import PreparedLaunch, fewest_clusters, launch_prototype

HIP_SUCCESS = 0
_LIBRARIES = ("libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.7")


def arch_of(gcn_arch_name: str) -> str:
    """The kbuild arch of a device's `gcnArchName`: "gfx942:sramecc+:xnack-" -> "gfx942"."""
    match = re.fullmatch(r"(gfx[0-9a-f]+)(:.*)?", gcn_arch_name.strip())
    if match is None:
        raise ValueError(f"not an AMD GPU architecture name: {gcn_arch_name!r}")
    return match.group(1)


@functools.cache
def hip():
    """libamdhip64, initialised, with the prototypes kbuild calls."""
    last = None
    for name in (os.environ.get("KBUILD_LIBAMDHIP"), *_LIBRARIES):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError as err:
            last = err
    else:
        raise RuntimeError(f"cannot load the HIP runtime (libamdhip64): {last}")
    c_int, c_void_p, c_uint, c_size_t = (
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_uint,
        ctypes.c_size_t,
    )
    ptr = ctypes.POINTER
    protos = {
        "hipInit": [c_uint],
        "hipSetDevice": [c_int],
        "hipModuleLoadData": [ptr(c_void_p), c_void_p],
        "hipModuleGetFunction": [ptr(c_void_p), c_void_p, ctypes.c_char_p],
        "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor": [
            ptr(c_int),
            c_void_p,
            c_int,
            c_size_t,
        ],
        "hipFuncSetAttribute": [c_void_p, c_int, c_int],
        "hipGetErrorName": [c_int],
    }
    for name, args in protos.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_char_p if name == "hipGetErrorName" else c_int
    launch_prototype(lib.hipModuleLaunchKernel)
    _check(lib, lib.hipInit(0), "hipInit")
    return lib


def _check(lib, err: int, what: str) -> None:
    if err != HIP_SUCCESS:
        name = lib.hipGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if name else err}")


# hipFuncAttributeMaxDynamicSharedMemorySize, the value of CUDA's runtime enum as well.
_MAX_DYNAMIC_SHARED = 8


class Launcher(PreparedLaunch):
    """A code object loaded on one ROCm device, with its argument storage prepared."""

    def __init__(self, artifact: Artifact, device_index: int, compute_units: int, lib=None):
        lib = lib or hip()
        if artifact.format != "hsaco":
            raise ValueError(f"the HIP runtime loads HSACO code objects, not {artifact.format}")
        self.device_index = device_index
        self.meta = artifact.meta
        self.block = int(artifact.meta["block"])
        self.rows_per_block = int(artifact.meta.get("rows_per_block", 1))
        self.cluster = 1  # no clusters on AMD
        self.dynamic_shared = int(artifact.meta.get("dynamic_shared_bytes", 0))
        self.names = [name for name, _ in artifact.meta["signature"]]
        _check(lib, lib.hipSetDevice(device_index), f"hipSetDevice({device_index})")
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        image = ctypes.create_string_buffer(artifact.binary, len(artifact.binary))
        _check(lib, lib.hipModuleLoadData(ctypes.byref(module), image), f"loading {artifact.entry}")
        _check(
            lib,
            lib.hipModuleGetFunction(ctypes.byref(function), module, artifact.entry.encode()),
            f"hipModuleGetFunction({artifact.entry})",
        )
        self._module, self._image = module, image  # kept alive with the launcher
        if self.dynamic_shared:
            _check(
                lib,
                lib.hipFuncSetAttribute(function, _MAX_DYNAMIC_SHARED, self.dynamic_shared),
                f"reserving {self.dynamic_shared} bytes of LDS",
            )
        per_cu = ctypes.c_int()
        _check(
            lib,
            lib.hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(per_cu), function, self.block, self.dynamic_shared
            ),
            "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor",
        )
        self.resident_blocks = max(1, per_cu.value) * compute_units
        self.resident_clusters = max(self.resident_blocks, fewest_clusters(self.meta))
        super().__init__(
            [kind for _, kind in artifact.meta["signature"]],
            self.names,
            function.value or 0,
            self.block,
            self.dynamic_shared,
            lib.hipModuleLaunchKernel,
            fail=lambda err: _check(lib, err, f"launching {artifact.entry}"),
        )
