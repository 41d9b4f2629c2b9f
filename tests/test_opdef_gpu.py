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

import math

import pytest
import torch

from .examples import import_example
from .gpu_utils import capture, rand

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


# The kernels' own accuracy, from their arithmetic (examples/custom_softmax.py; fp32 inside
# whatever the I/O dtype), as a first-order bound on each row's relative error by norm, u the
# unit roundoff (2^-24 for fp32) and u_out the output dtype's (2^-8 bf16, 2^-11 fp16, u fp32):
# - forward, y_j = exp(x_j - m_own) * exp(m_own - m) * (1 / s), s = sum of exp(x_k - m) built
#   by each thread's sum and merges (softmax_pair) over a tree: every subtraction a - b rounds
#   by u|a - b| <= u R (R: the row's range), which an exp turns into a relative u R; every exp
#   is within 3.5 ulp <= 7u (dsl.exp on the GPU's 2^x at 2 ulp, kbuild/dsl/math.py); a term
#   meets at most L rescales exp(m_a - m) on its way up (each 7u + a product u; their
#   arguments add up to at most R along the path, the maximum only growing), L <= 2 log2 N + 8
#   (warp, block, cluster trees and chunk passes); the N positive terms' additions <= (N - 1)u
#   in any order; then the reciprocal and two products. Per element, so by norm:
#   (N + 8L + 4R + 24) u + u_out.
# - backward, dx_j = y_j (dy_j - d), d = sum y_k dy_k, from the stored y (the contract): the
#   products and additions of d are within N u sum |y_k dy_k| in any order, then a subtraction
#   and a product (2u) and the output's rounding: by norm, N u kappa + 2u + u_out with
#   kappa = sum |y_k dy_k| ||y|| / ||dx|| (the dot product's condition for this row).
# torch's own error is no bound: it is another kernel's (it failed by 3%: 2.385e-5 for dx at
# (33, 1000) fp32 on an H100 against 1.5 x torch's 1.59e-5).
U_OUT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def softmax_bound(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per row of x (fp64 of the kernel's input), the forward's bound (comment above)."""
    u, N = 2.0**-24, x.shape[-1]
    finite = torch.where(torch.isfinite(x), x, float("nan"))
    R = finite.nan_to_num(float("-inf")).amax(-1) - finite.nan_to_num(float("inf")).amin(-1)
    L = 2 * math.ceil(math.log2(N)) + 8
    return (N + 8 * L + 4 * R + 24) * u + U_OUT[dtype]


def softmax_backward_bound(y: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per row, the backward's bound (comment above); y, dy fp64 of the stored y and dy."""
    u, N = 2.0**-24, y.shape[-1]
    dx = y * (dy - (y * dy).sum(-1, keepdim=True))
    kappa = (y * dy).abs().sum(-1) * y.norm(dim=-1) / dx.norm(dim=-1)
    return N * u * kappa + 2 * u + U_OUT[dtype]


def row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Each row's error relative to the row's norm (values near 1/N, 6.6e-6 at N = 151936,
    would pass an elementwise bound)."""
    rows = want.reshape(-1, want.shape[-1])
    return (got.double().reshape(rows.shape) - rows).norm(dim=-1) / rows.norm(dim=-1)


@pytest.mark.parametrize("shape, dtype", SHAPES, ids=lambda v: str(v))
def test_values_and_gradients_against_fp64(example, shape, dtype):
    x = rand(shape, dtype, seed=1, scale=4.0).requires_grad_()
    dy = rand(shape, dtype, seed=2)
    y = example.softmax(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    xd = x.detach().double().reshape(-1, shape[-1])
    y64 = torch.softmax(xd, -1)
    # the backward's contract: dx from the y the forward stored (as torch's softmax backward
    # does): from the exact y instead, a row dominated by one y near 1 loses (1 - y) to y's
    # rounding (2.5e-2 relative in bf16), the kernel's error hidden under the input's
    yd, dyd = y.detach().double().reshape(xd.shape), dy.double().reshape(xd.shape)
    dx64 = yd * (dyd - (yd * dyd).sum(-1, keepdim=True))
    for got, want, bound, name in (
        (y, y64, softmax_bound(xd, dtype), "y"),
        (dx, dx64, softmax_backward_bound(yd, dyd, dtype), "dx"),
    ):
        errors = row_errors(got, want)
        worst = (errors / bound).argmax()
        assert (errors <= bound).all(), (name, errors[worst].item(), bound[worst].item())
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
