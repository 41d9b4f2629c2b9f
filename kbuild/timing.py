"""GPU timing helpers shared by `kbuild demo` and bench/: CUDA events, medians, copy bandwidth.

Bandwidth is bytes the kernel must move over the median time. Inputs of 128 MB and more are
L2-cold by size (an H200's L2 is 60 MB), so no flush is needed between repetitions.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(
    fn: Callable[[], object],
    reps: int = 50,
    warmup_ms: float = 200.0,
    prepare: Callable[[], object] | None = None,
) -> float:
    """Median device time of one call of `fn`, CUDA events around each call.

    Calls are queued back to back (no host sync between them) after a warm-up of about
    `warmup_ms` of device work, so the GPU runs at its sustained clocks, not idle ones.
    `prepare`, where given, runs before every call outside the events: for a call that
    overwrites its own inputs (a loss writing its gradient over the logits), restoring them
    so that every timed call reads the same data.
    """
    prepare = prepare or (lambda: None)
    prepare()
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_ms / 1e3:
        for _ in range(10):
            prepare()
            fn()
        torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends, strict=True):
        prepare()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def copy_gbps(nbytes: int = 1 << 30, device: str = "cuda") -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), in GB/s."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def host_us_per_call(fn: Callable[[], object], calls: int = 2000, warmup: int = 50) -> float:
    """Host microseconds per call of a tiny launch: many calls, one synchronize."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / calls


def _profiled(fn: Callable[[], object], reps: int, warmup: int):
    """A torch.profiler record (CUDA activity) of `reps` calls of `fn`, after `warmup`."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return prof


def kernel_device_us(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> dict[str, float]:
    """Device us per call of `fn` of each CUDA kernel it launches, by kernel name."""
    totals: dict[str, float] = {}
    for event in _profiled(fn, reps, warmup).events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time
    return {name: us / reps for name, us in sorted(totals.items())}


def device_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """GPU time of the kernels one call of `fn` launches (profiler), per call.

    For calls whose host side is slower than their kernels (a backward pass through the
    autograd engine), event timing measures the host: this sums device time alone.
    """
    prof = _profiled(fn, reps, warmup=3)
    total_us = 0.0
    for event in prof.key_averages():
        total_us += getattr(event, "self_device_time_total", 0.0) or 0.0
    return total_us / reps / 1e3
