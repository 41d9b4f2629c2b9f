"""An op declared with kbuild.Op on the GPU: the example's softmax (examples/custom_softmax.py)
through the C++ generic kernel and the C++ generic autograd kernel (kbuild/native/generic.h),
against fp64 torch, against its own Python launch path, and captured in a CUDA graph.

What this catches that the CPU tests cannot: a launch the C++ generic kernel makes wrongly on
a real device (a grid or slot the launch hook's recording hid, the wrong stream, a stale
record), gradients the C++ autograd node hands the backward op wrongly on CUDA tensors, and
a generic launch that breaks graph capture (a record resolved, or an output allocated, outside
the graph's pool). Shapes: the example's `warmup_specs()` (warm with
`kbuild warmup --module examples/custom_softmax.py`), aligned rows.
"""

from __future__ import annotations

import pytest
import torch

from .examples import import_example
from .gpu_utils import GRAD_TOL, capture, rand

pytestmark = pytest.mark.gpu

# (rows, N, dtype): rows held in registers (4096; f32 at 1000), split over a cluster
# (32768), walked chunk by chunk (151936, a vocabulary's width); rows not a whole number of
# vectors, peeled (dsl.rows), over every phase (37 rows): held (4097, f32 3001), split over a
# cluster (GPT-2's 50257)
SHAPES = [
    ((64, 4096), torch.bfloat16),
    ((3, 5, 4096), torch.bfloat16),
    ((16, 32768), torch.bfloat16),
    ((4, 151936), torch.bfloat16),
    ((33, 1000), torch.float32),
    ((37, 4097), torch.bfloat16),
    ((37, 50257), torch.bfloat16),
    ((37, 3001), torch.float32),
]


@pytest.fixture(scope="module")
def example():
    return import_example()  # its kernels stay registered: the cache finds their builders


def test_the_example_runs_on_the_generic_cpp_kernels(example):
    """Where the extension loads (a CUDA torch), the example's op runs its CUDA kernel and its
    autograd in C++: the routes the benchmarks and users take."""
    from kbuild import native

    if native.load() is None:
        pytest.skip("the C++ extension is unavailable here")
    assert example.softmax.generic_native and example.softmax.backward.generic_native
    assert example.softmax.native_autograd


@pytest.mark.parametrize("shape, dtype", SHAPES, ids=lambda v: str(v))
def test_values_and_gradients_against_fp64(example, shape, dtype):
    x = rand(shape, dtype, seed=1, scale=4.0).requires_grad_()
    dy = rand(shape, dtype, seed=2)
    y = example.softmax(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    y64 = torch.softmax(x.detach().double(), -1)
    # the backward's contract: dx from the y the forward stored (as torch's softmax backward
    # does): from the exact y instead, a row dominated by one y near 1 loses (1 - y) to y's
    # rounding (2.5e-2 relative in bf16), the kernel's error hidden under the input's
    yd, dyd = y.detach().double(), dy.double()
    dx64 = yd * (dyd - (yd * dyd).sum(-1, keepdim=True))
    # torch's own softmax on the same input, held to the same references: its error is
    # the bound where it exceeds the dtype's tolerance (fp32 at (33, 1000): 2.4e-5 for dx)
    y_torch = torch.softmax(x.detach(), -1)
    dx_torch = torch._softmax_backward_data(dy, y_torch, -1, dtype)
    yt = y_torch.double()
    dx64_torch = yt * (dyd - (yt * dyd).sum(-1, keepdim=True))

    def error(got, want):  # relative, by norm, per row: values near 1/N (6.6e-6 at N =
        rows = want.reshape(-1, want.shape[-1])  # 151936) would pass an elementwise bound
        return ((got.double().reshape(rows.shape) - rows).norm(dim=-1) / rows.norm(dim=-1)).max()

    for got, want, theirs, name in ((y, y64, error(y_torch, y64), "y"),
                                    (dx, dx64, error(dx_torch, dx64_torch), "dx")):  # fmt: skip
        bound = max(GRAD_TOL[dtype], 1.5 * theirs.item())
        assert error(got, want).item() < bound, (name, error(got, want).item(), bound)
    assert y.dtype == dtype and dx.dtype == dtype and y.is_contiguous()


@pytest.mark.parametrize("N", [4096, 4097, 151936])
def test_masked_rows_far_below_zero(example, N):
    """Rows of -inf (masked) entries beside finite ones around -200: a thread holding only
    -inf values must add nothing (its rescale exp(m_own - m) is 0; exp(0 - m) overflowed to
    inf, and 0 * inf wrote NaN), and a row that is all -inf is NaN, as torch's is."""
    x = rand((8, N), torch.float32, seed=9) - 200.0
    x[:, 5:] = float("-inf")  # all but the first thread or two hold only -inf
    x[-1] = float("-inf")
    y = example.softmax(x)
    want = torch.softmax(x.double(), -1)
    assert torch.isnan(y[-1]).all() and torch.isnan(want[-1]).all()
    assert not torch.isnan(y[:-1]).any()
    torch.testing.assert_close(y[:-1].double(), want[:-1], rtol=1e-5, atol=1e-9)


def test_the_cpp_and_python_launch_paths_agree_bit_for_bit(example):
    """The same kernels by two routes: the C++ generic kernel and the Python launch path
    (what runs without the extension) give the same bits, forward and backward."""
    x = rand((64, 4096), torch.bfloat16, seed=3, scale=4.0)
    dy = rand((64, 4096), torch.bfloat16, seed=4)
    y = example.softmax.overload(x)
    assert torch.equal(y, example.softmax._launch_cuda(x))
    dx = example.softmax.backward.overload(y, dy)
    assert torch.equal(dx, example.softmax.backward._launch_cuda(y, dy))


def test_bitwise_deterministic_and_captured_in_a_graph(example):
    """Two eager calls give the same bits, and forward + backward captured in a CUDA graph and
    replayed on new inputs gives the eager bits (a launch outside the capture's stream, or a
    record resolved inside it, would break this)."""
    shape, dtype = (64, 4096), torch.bfloat16
    x = rand(shape, dtype, seed=5, scale=4.0).requires_grad_()
    dy = rand(shape, dtype, seed=6)

    def step():
        y = example.softmax(x)
        return (y.detach(), *torch.autograd.grad(y, x, dy))

    first, second = step(), step()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    graph, static = capture(step)
    with torch.no_grad():
        x.copy_(rand(shape, dtype, seed=7, scale=4.0))
        dy.copy_(rand(shape, dtype, seed=8))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    assert all(torch.equal(a, b) for a, b in zip(static, eager, strict=True))
