"""Kernels on demand: memory tier -> disk tier -> compiler, for a spec on a device.

    launcher = get_launcher(key, device_index, make_spec)

`key` is the caller's cheap tuple of everything that picks the kernel, ending with the device
index; on a hit this is one dict lookup. On a miss `make_spec()` gives the KernelSpec, the disk
cache is asked for its binary (compiling it, once across processes, if absent and allowed),
and the binary is loaded into that device's context.
"""

from __future__ import annotations

import functools
import shlex
import threading
from collections.abc import Callable, Hashable

from . import env
from .artifact import Artifact
from .cache import DiskCache, MemoryCache, default_cache_dir, entry_key, toolchain_key
from .record import record
from .spec import KernelSpec
from .targets import Target, target_for_capability

_loaded = MemoryCache()
_loading = threading.Lock()
loaded = _loaded.get  # the hot path's one lookup: launcher for a key, or None
_forget_hooks: list[Callable[[], None]] = []


def on_forget(hook: Callable[[], None]) -> None:
    """Call `hook` whenever `forget_loaded` runs (the C++ hot path drops its records)."""
    _forget_hooks.append(hook)


def forget_loaded() -> None:
    """Forget every loaded kernel here and in the C++ hot path's records, so the next call of
    each loads it again from the disk tier. For tests; not while other threads launch."""
    _loaded.clear()
    for hook in _forget_hooks:
        hook()


class KernelNotCached(RuntimeError):
    """Offline, and the disk cache has no binary for this kernel."""


def warmup_command(spec: KernelSpec, target: Target, cache_dir: str | None = None) -> str:
    where = f" --cache-dir {shlex.quote(cache_dir)}" if cache_dir else ""  # pasteable
    return f"kbuild warmup --arch {target.arch}{where} --spec '{spec.canonical_json()}'"


def artifact_for(spec: KernelSpec, target: Target, cache: DiskCache | None = None) -> Artifact:
    """The binary of `spec` for `target`: from the disk cache, else compiled and stored."""
    offline = env.offline()
    # Offline, the cache is read-only: processes sharing it (DDP ranks) never delete or write.
    cache = cache or DiskCache(default_cache_dir(), read_only=offline)
    key = entry_key(spec, target)
    if offline:
        artifact = cache.get(key, None)
        if artifact is None:
            raise KernelNotCached(
                f"kernel {spec.short()} for {target.arch} is not in the cache at {cache.root} "
                f"and compiling is off (KBUILD_OFFLINE=1 or no MLIR installed). Warm it on a "
                f"machine with the compiler: {warmup_command(spec, target, str(cache.root))}"
            )
        return artifact
    return build_into(cache, spec, target)[0]


def build_into(cache: DiskCache, spec: KernelSpec, target: Target) -> tuple[Artifact, bool]:
    """The binary from `cache`, compiled and stored first if absent (once across processes);
    also whether this call compiled it."""
    from .compiler import compile_kernel, toolchain

    tools = toolchain(target.vendor)
    return cache.get_or_build(
        entry_key(spec, target), toolchain_key(tools), tools, lambda: compile_kernel(spec, target)
    )


def on_rocm() -> bool:
    """Whether torch drives AMD GPUs here (its "cuda" devices are HIP devices)."""
    import torch

    return torch.version.hip is not None


def device_target(device_index: int) -> Target:
    if env.interpret():
        from .interpret import interpret_target

        return interpret_target()
    if on_rocm():
        import torch

        from .runtime.hip import arch_of
        from .targets import target_for_arch

        return target_for_arch(arch_of(torch.cuda.get_device_properties(device_index).gcnArchName))
    from .runtime.cuda import device_attribute

    major = device_attribute(device_index, "COMPUTE_CAPABILITY_MAJOR")
    minor = device_attribute(device_index, "COMPUTE_CAPABILITY_MINOR")
    return target_for_capability(major, minor)


@functools.cache
def target_of(device_index: int) -> Target:
    """device_target, asked once per device (launch paths that choose by target)."""
    return device_target(device_index)


def _load(artifact: Artifact, device_index: int):
    """The vendor runtime's prepared launcher for a binary on a device."""
    if on_rocm():
        import torch

        from .runtime.hip import Launcher as HipLauncher

        units = torch.cuda.get_device_properties(device_index).multi_processor_count
        return HipLauncher(artifact, device_index, units)
    from .runtime.cuda import Launcher

    return Launcher(artifact, device_index)


def get_launcher(key: Hashable, device_index: int, make_spec: Callable[[], KernelSpec]):
    """The prepared launcher for `key` on `device_index` (loading it on first use)."""
    launcher = _loaded.get(key)
    if launcher is None:
        with _loading:  # two threads missing at once load the module once
            launcher = _loaded.get(key)
            if launcher is None:
                spec = make_spec()
                record(spec)  # KBUILD_RECORD: before the cache is asked, so misses show too
                if env.interpret():  # the builder's module, run by kbuild.interpret
                    from .interpret import Launcher as InterpretedLauncher

                    if device_index >= 0:
                        raise RuntimeError(
                            f"KBUILD_INTERPRET runs kernels on CPU tensors; {spec.short()} "
                            f"was asked for CUDA device {device_index}: unset KBUILD_INTERPRET "
                            "to run CUDA tensors on the GPU"
                        )

                    launcher = InterpretedLauncher(spec, device_target(device_index))
                else:
                    artifact = artifact_for(spec, device_target(device_index))
                    launcher = _load(artifact, device_index)
                _loaded.put(key, launcher)
    return launcher
