"""CUDA graphs: every public op, forward and backward, captured with torch.cuda.graph and
replayed on new inputs gives bitwise the results of an eager call on them.

Capture follows torch's documented pattern (warm-up iterations on a side stream, then capture
into static tensors). What this catches: a launch that does not follow torch's current stream
(it would run outside the graph, once, at capture), a workspace or output allocated outside
the graph's pool and reused stale, a host-side value baked into the graph that should change
per call (M, pointers), and a kernel whose first load inside a capture breaks it.
Shapes: N = 4096 bf16 from the `tests` manifest.
"""

from __future__ import annotations

import pytest
import torch

import kbuild
from kbuild import jit

from .gpu_utils import capture, rand

pytestmark = pytest.mark.gpu

M, N = 64, 4096
BF16 = torch.bfloat16


def _leaf(shape, seed, scale=1.0):
    return rand(shape, BF16, seed, scale).requires_grad_()


def _case(op: str):
    """(inputs requiring grad, the op's differentiable output as a function of them)."""
    x, w = _leaf((M, N), 1), _leaf((N,), 2, 0.5)
    if op == "rmsnorm":
        return [x, w], lambda: kbuild.rmsnorm(x, w, 1e-6)
    if op == "layernorm":
        b = _leaf((N,), 3)
        return [x, w, b], lambda: kbuild.layernorm(x, w, b, 1e-5)
    r = _leaf((M, N), 4)

    def fused():
        out, residual_out = kbuild.fused_add_rmsnorm(x, r, w, 1e-6)
        return out + residual_out  # both outputs carry gradient

    return [x, r, w], fused


def _step(inputs, fn, dy):
    y = fn()
    return (y.detach(), *torch.autograd.grad(y, inputs, dy))


@pytest.mark.parametrize("op", ["rmsnorm", "layernorm", "fused_add_rmsnorm"])
def test_forward_backward_graph_replays_bitwise(op: str) -> None:
    inputs, fn = _case(op)
    dy = rand((M, N), BF16, 9)
    graph, static = capture(lambda: _step(inputs, fn, dy))
    for seed in (11, 12):  # new values in the static inputs, then replay
        with torch.no_grad():
            for i, t in enumerate(inputs):
                t.copy_(rand(t.shape, BF16, seed * 10 + i))
            dy.copy_(rand(dy.shape, BF16, seed))
        graph.replay()
        torch.cuda.synchronize()
        eager = _step(inputs, fn, dy)
        for name, got, want in zip(["y", "dx", "d1", "d2"], static, eager, strict=False):
            assert torch.equal(got, want), f"{op}: {name} differs after replay (seed {seed})"


def test_first_call_inside_a_capture_loads_and_replays() -> None:
    """A kernel whose module is not loaded yet when the capture starts: loading is not a
    stream operation, so the capture stays valid and the replay computes the op."""
    x = rand((M, N), BF16, 5)
    w = rand((N,), BF16, 6)
    kbuild.rmsnorm(x, w, 1e-6)  # torch's own lazy set-up (allocator, handles) outside
    jit.forget_loaded()  # every kbuild module unloaded from the memory tier
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kbuild.rmsnorm(x, w, 1e-6)
    x.copy_(rand((M, N), BF16, 7))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, kbuild.rmsnorm(x, w, 1e-6))
