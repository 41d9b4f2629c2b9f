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

from ..artifact import Artifact
from .prepared import PreparedLaunch, fewest_clusters, launch_prototype


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


_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT


@functools.cache
def _libcuda_launch():
    _driver()  # cuInit
    return launch_prototype(ctypes.CDLL("libcuda.so.1").cuLaunchKernel)


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


class Launcher(PreparedLaunch):
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
            self.resident_clusters = max(self.resident_clusters, fewest_clusters(self.meta))
        finally:
            driver.cuCtxPopCurrent()
        self._context = context
        super().__init__(
            [kind for _, kind in artifact.meta["signature"]],
            self.names,
            int(self._function),
            self.block,
            self.dynamic_shared,
            _libcuda_launch(),
            retry=self._bind_context,
            fail=self._raise,
        )

    def _bind_context(self, err: int) -> bool:
        """A thread that has not touched CUDA yet (autograd's backward threads, user threads)
        has no current context: bind the device's primary one, and launch again."""
        if err != _INVALID_CONTEXT:
            return False
        _check(_driver(), _driver().cuCtxSetCurrent(self._context)[0], "cuCtxSetCurrent")
        return True

    def _raise(self, err: int) -> None:
        driver = _driver()
        _check(driver, driver.CUresult(err), f"launching {self.meta['spec']['kernel']}")
