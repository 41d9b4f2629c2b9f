"""kbuild.softmax / kbuild.log_softmax on CPU (the ops' references, which are the kernels'
contract) against fp64 torch, values and gradients: each dtype, odd widths, other dims, the
output dtype, M = 0; the checks' errors; the fake under torch.compile; the kernels built for
sm_90 (16-byte accesses in the PTX) and lowered for gfx942; the GPU cases' kernels
warmable."""

from __future__ import annotations

import re

import pytest
import torch

import kbuild
from kbuild import cases
from kbuild.kernels.softmax import op as sm

from .graph_recorder import KbuildGraphs
from .test_generic_native_cpu import paths  # noqa: F401 (the fixture: both launch paths)

NAMES = ("softmax", "log_softmax")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# one ulp of each dtype's result, relative: a reference computed in the storage dtype (or a
# wrong formula) is off by far more on the inputs below
TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _inputs(shape, dtype, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * scale).to(dtype)
    dy = torch.randn(shape, generator=g)
    return x, dy


def _fp64(name, x, dy, dim=-1):
    xd = x.detach().double().requires_grad_()
    y = getattr(torch, name)(xd, dim)
    (dx,) = torch.autograd.grad(y, xd, dy.double())
    return y, dx


def _errors(name, x, dy, dim=-1, dtype=None):
    """(relative y error, relative dx error) of kbuild's op against fp64 torch."""
    x = x.detach().requires_grad_()
    y = getattr(kbuild, name)(x, dim, dtype)
    (dx,) = torch.autograd.grad(y, x, dy.to(y.dtype))
    ref, dref = _fp64(name, x, dy.to(y.dtype), dim)
    scale = ref.abs().amax(dim, keepdim=True).clamp_min(1.0) if name == "log_softmax" else 1.0
    y_err = ((y.double() - ref).abs() / scale).max().item()
    # (N = 1: dx is exactly 0)
    dx_err = ((dx.double() - dref).abs().max() / dref.abs().max().clamp_min(1e-30)).item()
    return y, dx, y_err, dx_err


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 7, 33, 1001])
def test_values_and_gradients_match_fp64(name, dtype, N):
    """Odd widths (the kernels peel them), each dtype; random dy, so the row-sum term of the
    backward (sum(y dy), sum(dy)) moves dx far past the tolerance: dropping it fails (below)."""
    x, dy = _inputs((6, N), dtype)
    y, dx, y_err, dx_err = _errors(name, x, dy)
    assert y.dtype == dtype and dx.dtype == dtype and y.shape == x.shape
    assert y_err <= TOL[dtype] and dx_err <= 4 * TOL[dtype], (y_err, dx_err)
    if N > 1:  # the backward without its row sum is wrong by far more
        yd = y.double()
        wrong = yd * dy.double() if name == "softmax" else dy.double()
        _, dref = _fp64(name, x, dy)
        assert (wrong - dref).abs().max() > 100 * TOL[dtype] * dref.abs().max()


@pytest.mark.parametrize("name", NAMES)
def test_rounded_once_from_fp32(name):
    """bf16 x: y is fp32 math rounded once, so it equals the exact result rounded to bf16
    but for near-ties; a log-softmax whose lse is rounded to bf16 before x - lse (a double
    rounding) differs in many elements."""
    x, _ = _inputs((4, 513), torch.bfloat16, seed=1, scale=8.0)
    y = getattr(kbuild, name)(x)
    exact = getattr(torch, name)(x.double(), -1).to(torch.bfloat16)
    assert (y != exact).sum() <= 4
    if name == "log_softmax":
        lse = torch.logsumexp(x.float(), -1, keepdim=True).to(torch.bfloat16).float()
        twice = (x.float() - lse).to(torch.bfloat16)
        assert (twice != exact).sum() > 40


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape,dim", [((5, 7, 3), 0), ((5, 7, 3), 1), ((5, 7, 3), -2),
                                       ((4, 9), 0), ((6,), 0)])  # fmt: skip
def test_other_dims(name, shape, dim):
    x, dy = _inputs(shape, torch.float32)
    y, dx, y_err, dx_err = _errors(name, x, dy, dim)
    assert y.shape == x.shape and dx.shape == x.shape
    assert y_err <= 2e-6 and dx_err <= 1e-5
    assert torch.allclose(y, getattr(torch, name)(x, dim), atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_output_dtype_is_torchs(name, x_dtype, dtype):
    """dtype=: x cast to it before the op (torch's), y of that dtype, dx of x's. A float32
    output of 16-bit x keeps fp32's accuracy (not a 16-bit y widened)."""
    x, dy = _inputs((5, 301), x_dtype, seed=2)
    y, dx, y_err, dx_err = _errors(name, x, dy, -1, dtype)
    assert y.dtype == dtype and dx.dtype == x_dtype
    ref = getattr(torch, name)(x.double().to(dtype).double(), -1)  # x cast first
    scale = ref.abs().max() if name == "log_softmax" else 1.0
    assert (y.double() - ref).abs().max() <= TOL[dtype] * scale
    assert dx_err <= 4 * max(TOL[dtype], TOL[x_dtype])
    if dtype == torch.float32 and x_dtype != torch.float32:
        plain = getattr(kbuild, name)(x).double()  # 16-bit y: off by far more
        assert (plain - ref).abs().max() > 50 * TOL[dtype] * scale


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("x_dtype,dtype", [(torch.float32, torch.bfloat16),
                                           (torch.float16, torch.bfloat16),
                                           (torch.float32, torch.float16)])  # fmt: skip
def test_a_narrowing_dtype_rounds_x_first(name, x_dtype, dtype):
    """torch casts x to `dtype` before the op: on logits near 40, rounding x to bf16 moves
    them by up to 0.125 (to fp16: 0.016), which moves y past the tolerance; a softmax of the exact x
    (the kernel's cast, at the store only) fails."""
    g = torch.Generator().manual_seed(3)
    x = (40 + torch.rand(4, 64, generator=g) * (2 if dtype == torch.bfloat16 else 1)).to(x_dtype)
    y = getattr(kbuild, name)(x, -1, dtype)
    rounded_first = getattr(torch, name)(x.to(dtype).double(), -1)
    of_exact_x = getattr(torch, name)(x.double(), -1)
    scale = rounded_first.abs().max() if name == "log_softmax" else rounded_first.max()
    assert (y.double() - rounded_first).abs().max() <= TOL[dtype] * scale
    assert (of_exact_x - rounded_first).abs().max() > 2 * TOL[dtype] * scale


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape,dim", [((0, 7), -1), ((3, 0, 5), 1), ((4, 0), -1)])
def test_no_rows_and_empty_rows(name, shape, dim):
    """M = 0 (no rows) and N = 0 (rows of nothing): empty results of x's shape, gradients too."""
    x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    y = getattr(kbuild, name)(x, dim)
    assert y.shape == x.shape and y.dtype == x.dtype
    y2 = getattr(kbuild, name)(x, dim, torch.float32)
    assert y2.dtype == torch.float32
    assert y.requires_grad  # (an empty gradient: None, which autograd reads as zeros)
    (dx,) = torch.autograd.grad(y.sum(), x, allow_unused=True, materialize_grads=True)
    assert dx.shape == x.shape


@pytest.mark.parametrize("name", NAMES)
def test_masked_rows(name):
    """-inf columns give 0 (log: -inf); a row far below zero keeps its values (no NaN)."""
    x = torch.full((3, 9), float("-inf"))
    x[:, :2] = torch.tensor([-1000.0, -999.0])
    y = getattr(kbuild, name)(x)
    assert torch.allclose(y, getattr(torch, name)(x, -1), atol=1e-6) and not y.isnan().any()


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda f, x: f("x"), TypeError, "x must be a torch.Tensor"),
        (lambda f, x: f(x.long()), TypeError, "x must be torch.float32"),
        (lambda f, x: f(x[0, 0]), ValueError, "x must have at least one dimension"),
        (lambda f, x: f(x, 2), ValueError, r"dim must be in \[-2, 1\]"),
        (lambda f, x: f(x, -3), ValueError, "dim must be in"),
        (lambda f, x: f(x, 1.0), TypeError, "dim must be an int"),
        (lambda f, x: f(x, True), TypeError, "dim must be an int"),
        (lambda f, x: f(x, -1, torch.int64), TypeError, "dtype must be None"),
        (lambda f, x: f(x, -1, "float32"), TypeError, "dtype must be None"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("name", NAMES)
def test_checks_name_the_argument(name, call, error, message):
    with pytest.raises(error, match=message):
        call(getattr(kbuild, name), torch.randn(4, 10))


def test_the_ops_check_their_arguments():
    """The ops themselves (torch.ops.kbuild.*), as the declaration derives their checks."""
    op = sm.SOFTMAX
    with pytest.raises(TypeError, match="out_dtype must be a torch float dtype"):
        op(torch.randn(2, 3), torch.int32)
    with pytest.raises(ValueError, match="dy must"):
        op.backward(torch.randn(2, 3), torch.randn(2, 4))


def test_fake_gives_the_declared_outputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 50257, dtype=torch.bfloat16)
        for op in (torch.ops.kbuild.softmax, torch.ops.kbuild.log_softmax):
            assert op(x, None).dtype == torch.bfloat16
            y = op(x, torch.float32)
            assert y.shape == x.shape and y.dtype == torch.float32


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dim", [-1, 0])
def test_compiled_with_the_op_in_the_graph(name, dim):
    """The fake serves torch.compile: the forward op and its backward appear in the graphs
    (aot_autograd with recording compilers), and the values match eager's."""
    torch._dynamo.reset()
    graphs = KbuildGraphs()
    seen, backend = graphs.ops, graphs.backend
    f = getattr(kbuild, name)
    x, dy = _inputs((6, 51), torch.bfloat16)
    x.requires_grad_()
    g = torch.compile(lambda x: f(x, dim, torch.float32), backend=backend, fullgraph=True)
    y = g(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    x2 = x.detach().clone().requires_grad_()
    y2 = f(x2, dim, torch.float32)
    (dx2,) = torch.autograd.grad(y2, x2, dy)
    assert any(f"{name}.default" in n for n in seen["fw"]), seen
    assert any(f"{name}_backward" in n for n in seen["bw"]), seen
    assert torch.equal(y, y2) and torch.equal(dx, dx2)
    torch._dynamo.reset()


@pytest.mark.not_interpreted
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("N,make", [(256, "aligned"), (4097, "aligned"), (4096, "misaligned")])
def test_the_ops_run_on_the_generic_kernel(paths, name, N, make):  # noqa: F811
    """All four ops are declarations only: the C++ generic kernel runs them (no Python per
    call) and launches what the Python path launches (kernel, values, arguments), the output
    dtype keying the forward's kernel."""
    from .test_generic_native_cpu import NATIVE, _aligned, _both, _misaligned

    if NATIVE is None:
        pytest.skip("the C++ extension is unavailable")
    log, _, _ = paths
    op = {"softmax": sm.SOFTMAX, "log_softmax": sm.LOG_SOFTMAX}[name]
    assert op.generic_native and op.native_autograd and op.backward.generic_native
    x = {"aligned": _aligned, "misaligned": _misaligned}[make]((3, N), torch.bfloat16)
    for out in (None, torch.float32):
        cpp, py, (y,), _ = _both(op, (x, out), log)
        assert cpp == py and cpp[0][2] == ["x", "y", 3], cpp
        assert y.dtype == (out or x.dtype)
        assert ("out_dtype=f32" in cpp[0][0]) == (out is not None), cpp
        assert ("vectorize=False" in cpp[0][0]) == (make == "misaligned"), cpp
    cpp, py, _, _ = _both(op.backward, (y, torch.randn_like(y)), log)
    assert cpp == py and cpp[0][0].startswith(f"{name}_bwd")


# ----------------------------------------------------------------------------- kernels


def _ptx(spec):
    from kbuild.compiler import build
    from kbuild.targets import target_for_arch
    from kbuild.targets.nvidia import module_to_ptx

    sm90 = target_for_arch("sm_90")
    return module_to_ptx(build(spec, sm90).module, sm90).decode()


KERNELS = (sm.build_softmax_fwd, sm.build_log_softmax_fwd, sm.build_softmax_bwd,
           sm.build_log_softmax_bwd)  # fmt: skip


WIDTHS = [(4096, "bf16", None), (4097, "f16", None), (4097, "bf16", "f32"), (151936, "bf16", None)]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("N,dtype,out", WIDTHS)
def test_kernels_take_16_byte_accesses(kernel, N, dtype, out):
    """16-byte loads and stores for a held row, a peeled odd row (its body) and a chunked
    long row; a float32 output of 16-bit x too (the forwards)."""
    if out is not None and "fwd" not in kernel.name:
        pytest.skip("the backward has no out_dtype")
    spec = kernel.spec(N=N, dtype=dtype, **({"out_dtype": out} if out else {}))
    ptx = _ptx(spec)
    assert re.search(r"ld\.global(\.\w+)*\.v4\.(b32|u32|f32)", ptx), "16-byte loads"
    assert re.search(r"st\.global(\.\w+)*\.v4", ptx), "16-byte stores"
    if out == "f32":
        assert re.search(r"st\.global(\.\w+)*\.v4\.(b32|f32)", ptx), "float32 y"


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_kernels_lower_for_amd(kernel):
    from kbuild import compiler
    from kbuild.targets import target_for_arch

    gfx = target_for_arch("gfx942")
    for N, dtype in ((50257, "bf16"), (4096, "f32")):
        assert compiler.lower(kernel.spec(N=N, dtype=dtype), gfx)


def test_gpu_cases_are_warmable():
    """Every kernel tests/test_softmax_gpu.py launches is in warmup_specs() (the GPU machine
    runs offline from a cache warmed with `kbuild warmup --module kbuild.kernels.softmax.op`): each
    case's forward and backward, by the values the ops' own launches compute; the other-dim
    and misaligned cases too."""
    from . import test_softmax_gpu as gpu

    ops = {"softmax": sm.SOFTMAX, "log_softmax": sm.LOG_SOFTMAX}
    warm = set(sm.warmup_specs())

    def specs(op, x, out, aligned=True):
        y = torch.empty(x.shape, dtype=out or x.dtype, device="meta")
        both = op.kernel_values(x, out, aligned=aligned)
        both += op.backward.kernel_values(y, y, aligned=aligned)
        return [k.spec(*values) for k, values in both]

    for name, N, dtype, out in gpu.CASES:
        x = torch.empty(1, N, dtype=dtype, device="meta")
        for spec in specs(ops[name], x, out):
            assert spec in warm, spec
    N, dtype = cases.SOFTMAX_MISALIGNED
    for op in ops.values():
        x = torch.empty(1, N, dtype=dtype, device="meta")
        for spec in specs(op, x, None, aligned=False) + specs(op, x, None):
            assert spec in warm, spec
    assert 4097 in cases.SOFTMAX_GPU_N  # the other-dim cases' width
