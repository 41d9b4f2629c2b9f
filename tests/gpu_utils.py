"""Helpers for the GPU tests: tolerances per dtype, inputs, poisoned allocations."""

from __future__ import annotations

import torch

TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}

# Outputs are rounded once to the I/O dtype from fp32 math, so an element may differ from the
# fp32 reference by about one unit in the last place of that dtype (bf16 2^-8, fp16 2^-11).
FWD_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}
# Gradients add a row reduction and one more rounding.
BWD_TOL = {
    torch.float32: dict(rtol=1e-4, atol=1e-4),
    torch.float16: dict(rtol=5e-3, atol=5e-3),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
}


def poison_allocator(numel: int, dtype: torch.dtype, count: int = 4) -> None:
    """Fill soon-to-be-reused blocks of the caching allocator with NaN.

    The next allocations of this size get memory holding NaN, so an element a kernel forgets
    to write shows up as NaN instead of a stale plausible value.
    """
    blocks = [
        torch.full((max(numel, 1),), float("nan"), dtype=dtype, device="cuda") for _ in range(count)
    ]
    del blocks


def rand(shape, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * scale).to(dtype)


# Relative error (by norm) allowed for gradients: fp32 math, one rounding to the I/O dtype.
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def capture(step, warmup: int = 3):
    """(graph, its static outputs): `step()` warmed up on a side stream (kernels loaded,
    autograd and the allocator settled), as torch documents, then captured once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    return graph, static
