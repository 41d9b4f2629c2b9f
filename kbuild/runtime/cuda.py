"""CUDA driver runtime: load binaries into a device's context and launch them. No MLIR, no torch.

Modules are loaded into the device's primary context, the one PyTorch uses, so a kernel runs
on the same streams and memory as the tensors it is given. A `Launcher` is prepared once per
(kernel, device): its argument storage is allocated and the `void*[]` array that the driver
reads is filled with the storage addresses, so a launch only writes the new values and makes
one driver call.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from typing import Any

from ..artifact import Artifact

# Every argument gets an 8-byte slot; one struct.pack_into fills them all per launch.
_FORMATS = {"ptr": "Q", "i64": "q", "f32": "f4x"}


@functools.cache
def _driver():
    from cuda.bindings import driver

    _check(driver, driver.cuInit(0)[0], "cuInit")
    return driver


def _check(driver, err, what: str) -> None:
    if err != driver.CUresult.CUDA_SUCCESS:
        name = driver.cuGetErrorName(err)[1]
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")


@functools.cache
def _primary_context(device_index: int):
    driver = _driver()
    err, device = driver.cuDeviceGet(device_index)
    _check(driver, err, f"cuDeviceGet({device_index})")
    err, context = driver.cuDevicePrimaryCtxRetain(device)
    _check(driver, err, f"cuDevicePrimaryCtxRetain({device_index})")
    return context


_ONE, _NULL = ctypes.c_uint(1), ctypes.c_void_p(0)
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT


@functools.cache
def _libcuda_launch():
    _driver()  # cuInit
    launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    launch.restype = ctypes.c_int
    return launch


def device_attribute(device_index: int, name: str) -> int:
    """A CUdevice_attribute by its short name, e.g. "MULTIPROCESSOR_COUNT"."""
    driver = _driver()
    attr = getattr(driver.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
    err, value = driver.cuDeviceGetAttribute(attr, device_index)
    _check(driver, err, f"cuDeviceGetAttribute({name})")
    return value


def _max_active_clusters(
    driver, function, block: int, shared: int, cluster: int, fallback: int
) -> int:
    """cuOccupancyMaxActiveClusters for a kernel with a compile-time cluster shape."""
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = cluster * fallback, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes = shared
    config.numAttrs = 0
    err, count = driver.cuOccupancyMaxActiveClusters(function, config)
    if err != driver.CUresult.CUDA_SUCCESS:  # a driver without the query: blocks / cluster
        return max(1, fallback)
    if count < 1:
        raise RuntimeError(
            f"a cluster of {cluster} blocks of {block} threads ({shared} bytes of dynamic "
            "shared memory each) cannot be resident on this device"
        )
    return count


class Launcher:
    """A kernel loaded on one device, with its argument storage prepared."""

    def __init__(self, artifact: Artifact, device_index: int):
        driver = _driver()
        self.device_index = device_index
        self.meta = artifact.meta
        self.block = int(artifact.meta["block"])
        self.rows_per_block = int(artifact.meta.get("rows_per_block", 1))
        self.cluster = int(artifact.meta.get("cluster", 1))  # blocks per cluster
        self.dynamic_shared = int(artifact.meta.get("dynamic_shared_bytes", 0))
        self.names = [name for name, _ in artifact.meta["signature"]]
        context = _primary_context(device_index)
        _check(driver, driver.cuCtxPushCurrent(context)[0], "cuCtxPushCurrent")
        try:
            err, self._module = driver.cuModuleLoadData(artifact.binary)
            _check(driver, err, f"loading {artifact.entry} ({artifact.format})")
            err, self._function = driver.cuModuleGetFunction(self._module, artifact.entry.encode())
            _check(driver, err, f"cuModuleGetFunction({artifact.entry})")
            if self.cluster > 8:  # past the portable cluster size: the kernel opts in
                attr = (
                    driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
                )
                err = driver.cuFuncSetAttribute(self._function, attr, 1)[0]
                _check(driver, err, f"allowing clusters of {self.cluster} blocks")
            if self.dynamic_shared:  # static + dynamic past 48 KB needs this; harmless below
                attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                err = driver.cuFuncSetAttribute(self._function, attr, self.dynamic_shared)[0]
                _check(driver, err, f"reserving {self.dynamic_shared} bytes of shared memory")
            err, per_sm = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                self._function, self.block, self.dynamic_shared
            )
            _check(driver, err, "cuOccupancyMaxActiveBlocksPerMultiprocessor")
            # Blocks (clusters) of this kernel the whole device runs at once: the size of a
            # persistent grid. Clusters are placed within a GPC, so fewer may fit than
            # blocks / cluster; the driver says how many.
            sms = device_attribute(device_index, "MULTIPROCESSOR_COUNT")
            self.resident_blocks = max(1, per_sm) * sms
            self.resident_clusters = self.resident_blocks // self.cluster
            if self.cluster > 1:
                self.resident_clusters = _max_active_clusters(
                    driver,
                    self._function,
                    self.block,
                    self.dynamic_shared,
                    self.cluster,
                    self.resident_clusters,
                )
        finally:
            driver.cuCtxPopCurrent()
        self._context = context
        kinds = [kind for _, kind in artifact.meta["signature"]]
        self._nargs = len(kinds)
        self._pack = struct.Struct("<" + "".join(_FORMATS[k] for k in kinds)).pack_into
        self._storage = ctypes.create_string_buffer(8 * max(1, len(kinds)))
        base = ctypes.addressof(self._storage)
        self._params = (ctypes.c_void_p * max(1, len(kinds)))(
            *[base + 8 * i for i in range(len(kinds))]
        )
        self._params_address = ctypes.addressof(self._params)
        # The launch itself goes through ctypes on libcuda with every argument prebuilt as a
        # ctypes object: measured 5.9 us a launch on the H200 machine against 6.7 us through
        # cuda-bindings, which converts and checks each handle on every call.
        self._launch = _libcuda_launch()
        self.function_handle = int(self._function)  # the CUfunction, for the C++ hot path
        self._c_function = ctypes.c_void_p(self.function_handle)
        self._c_block = ctypes.c_uint(self.block)
        self._c_shared = ctypes.c_uint(self.dynamic_shared)
        self._c_params = ctypes.c_void_p(self._params_address)
        self._grid, self._c_grid = 0, ctypes.c_uint(0)
        self._stream, self._c_stream = 0, ctypes.c_void_p(0)
        self._lock = threading.Lock()

    def __call__(self, grid: int, stream: int, *args: Any) -> None:
        """Launch on `grid` blocks with the kernel's arguments in signature order."""
        if len(args) != self._nargs:
            raise TypeError(f"kernel takes {', '.join(self.names)}; got {len(args)} arguments")
        with self._lock:  # the storage is shared: one launch fills it at a time
            self._pack(self._storage, 0, *args)
            if grid != self._grid:  # grid and stream rarely change: reuse their ctypes
                self._grid, self._c_grid = grid, ctypes.c_uint(grid)
            if stream != self._stream:
                self._stream, self._c_stream = stream, ctypes.c_void_p(stream)
            err = self._launch_now()
            if err == _INVALID_CONTEXT:
                # A thread that has not touched CUDA yet (autograd's backward threads, user
                # threads) has no current context: bind the device's primary one, retry once.
                _check(_driver(), _driver().cuCtxSetCurrent(self._context)[0], "cuCtxSetCurrent")
                err = self._launch_now()
        if err:
            driver = _driver()
            _check(driver, driver.CUresult(err), f"launching {self.meta['spec']['kernel']}")

    def _launch_now(self) -> int:
        one = _ONE
        return self._launch(
            self._c_function,
            self._c_grid,
            one,
            one,
            self._c_block,
            one,
            one,
            self._c_shared,
            self._c_stream,
            self._c_params,
            _NULL,
        )
