"""CPU tests of the autograd layer: the kbuild::* custom ops pass torch.library.opcheck,
kbuild.fused_add_rmsnorm's values and gradients match the fp64 reference, and a module using
the norms compiles under torch.compile(fullgraph=True) and trains like eager.

On CPU the custom ops run the torch reference (kbuild/kernels/norms/rmsnorm.py), so everything here
checks the op contracts (schemas, fake kernels, autograd wiring) that the CUDA kernels share.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import kbuild
import kbuild.kernels.llmc.op  # registers the kbuild::* custom ops (llm.c's)
import kbuild.kernels.norms.api  # registers the kbuild::* custom ops (the norms')

from .gpu_utils import FWD_TOL, GRAD_TOL
from .reference import assert_close_rel, rmsnorm_grads, rmsnorm_ref

OPS = torch.ops.kbuild
EPS = 1e-6
N = 16


def _randn(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _weight(kind: str | None, dtype: torch.dtype) -> torch.Tensor | None:
    """kind: None (no weight), "same" (x's dtype) or "f32"."""
    if kind is None:
        return None
    return _randn((N,), dtype if kind == "same" else torch.float32, seed=1)


def _rstd(x: torch.Tensor) -> torch.Tensor:
    """(M,) fp32, as the forward ops store it."""
    return torch.rsqrt(x.float().square().mean(-1) + EPS).reshape(-1)


def _cases(dtypes=(torch.float32, torch.bfloat16), weights=("same", "f32", None), fp32_too=False):
    """(dtype, weight kind[, residual dtype]) without the duplicates fp32 x brings."""
    cases = []
    for dtype in dtypes:
        for weight in weights:
            if dtype == torch.float32 and weight == "f32":
                continue  # the same as "same"
            residuals = [dtype] + ([torch.float32] if fp32_too and dtype != torch.float32 else [])
            cases += [(dtype, weight, r) if fp32_too else (dtype, weight) for r in residuals]
    return cases


def _case_id(*parts) -> str:
    return "-".join(str(p).replace("torch.", "") for p in parts)


# --- opcheck: schema, fake kernel, autograd registration, AOT dispatch ----------------------
#
# Forward samples require grad exactly when they store rstd: that is the ops' contract (the
# public functions pass store_rstd=needs_grad), since the backward reads the saved rstd. The
# backward ops have no derivative of their own (no double backward), so their inputs never
# require grad. With that, all four opcheck sub-tests apply to every sample.


def _grad(t: torch.Tensor | None, requires: bool) -> torch.Tensor | None:
    return None if t is None else t.clone().requires_grad_(requires)


@pytest.mark.parametrize("store_rstd", [True, False], ids=["store_rstd", "no_rstd"])
@pytest.mark.parametrize("dtype, weight", _cases(), ids=_case_id)
def test_opcheck_rmsnorm_fwd(dtype, weight, store_rstd):
    x = _grad(_randn((4, N), dtype, seed=0), store_rstd)
    w = _grad(_weight(weight, dtype), store_rstd)
    torch.library.opcheck(OPS.rmsnorm_fwd.default, (x, w, EPS, store_rstd))


@pytest.mark.parametrize("need_dx, need_dw", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("dtype, weight", _cases(), ids=_case_id)
def test_opcheck_rmsnorm_bwd(dtype, weight, need_dx, need_dw):
    x, dy = _randn((4, N), dtype, seed=0), _randn((4, N), dtype, seed=2)
    args = (dy, x, _weight(weight, dtype), _rstd(x), need_dx, need_dw)
    torch.library.opcheck(OPS.rmsnorm_bwd.default, args)


@pytest.mark.parametrize("store_rstd", [True, False], ids=["store_rstd", "no_rstd"])
@pytest.mark.parametrize("dtype, weight, residual_dtype", _cases(fp32_too=True), ids=_case_id)
def test_opcheck_fused_add_rmsnorm_fwd(dtype, weight, residual_dtype, store_rstd):
    x = _grad(_randn((4, N), dtype, seed=0), store_rstd)
    residual = _grad(_randn((4, N), dtype, seed=3), store_rstd)
    w = _grad(_weight(weight, dtype), store_rstd)
    args = (x, residual, w, EPS, residual_dtype, store_rstd)
    torch.library.opcheck(OPS.fused_add_rmsnorm_fwd.default, args)


@pytest.mark.parametrize("has_dres", [True, False], ids=["dresidual_out", "no_dresidual_out"])
@pytest.mark.parametrize("dtype, weight, residual_dtype", _cases(fp32_too=True), ids=_case_id)
def test_opcheck_fused_add_rmsnorm_bwd(dtype, weight, residual_dtype, has_dres):
    residual_out, dy = _randn((4, N), residual_dtype, seed=0), _randn((4, N), dtype, seed=2)
    dres = _randn((4, N), residual_dtype, seed=4) if has_dres else None
    w = _weight(weight, dtype)
    for need_dw in (True, False):
        args = (dy, dres, residual_out, w, _rstd(residual_out), need_dw)
        torch.library.opcheck(OPS.fused_add_rmsnorm_bwd.default, args)


# (..., N) inputs of rank 3: the ops see them as (M, N) rows and return rstd as (M,).
@pytest.mark.parametrize(
    "op, make_args",
    [
        ("rmsnorm_fwd", lambda x, r, w: (x, w, EPS, True)),
        ("rmsnorm_bwd", lambda x, r, w: (r, x, w, _rstd(x), True, True)),
        ("fused_add_rmsnorm_bwd", lambda x, r, w: (r, r, x, w, _rstd(x), True)),
        pytest.param(
            "fused_add_rmsnorm_fwd",
            lambda x, r, w: (x, r, w, EPS, torch.float32, True),
        ),
    ],
    ids=["rmsnorm_fwd", "rmsnorm_bwd", "fused_add_rmsnorm_bwd", "fused_add_rmsnorm_fwd"],
)
def test_opcheck_rank_3_inputs(op, make_args):
    x, r = _randn((3, 5, N), torch.float32, seed=0), _randn((3, 5, N), torch.float32, seed=3)
    w = _weight("same", torch.float32)
    forward = op.endswith("_fwd")
    args = make_args(*(t.requires_grad_(forward) for t in (x, r, w)))
    results = torch.library.opcheck(getattr(OPS, op).default, args, raise_exception=False)
    assert all(r == "SUCCESS" for r in results.values()), results


# --- fused_add_rmsnorm: values ----------------------------------------------------------------

FUSED_CASES = _cases(dtypes=(torch.float32, torch.float16, torch.bfloat16), fp32_too=True)


@pytest.mark.parametrize("dtype, weight_kind, residual_dtype", FUSED_CASES, ids=_case_id)
def test_fused_add_rmsnorm_matches_fp64_reference(dtype, weight_kind, residual_dtype):
    x, residual = _randn((3, 5, N), dtype, seed=0), _randn((3, 5, N), dtype, seed=3)
    weight = _weight(weight_kind, dtype)
    out, residual_out = kbuild.fused_add_rmsnorm(
        x, residual, weight, EPS, residual_in_fp32=residual_dtype == torch.float32
    )
    assert out.shape == residual_out.shape == x.shape
    assert out.dtype == dtype
    assert residual_out.dtype == residual_dtype
    # x + residual is exact in fp64, so the stored sum is that value rounded once.
    expected_sum = (x.double() + residual.double()).to(residual_dtype)
    torch.testing.assert_close(residual_out, expected_sum, rtol=0, atol=0)
    # out is the norm of exactly the stored residual_out (what the backward pass reads).
    expected = rmsnorm_ref(residual_out, weight, EPS).to(dtype)
    torch.testing.assert_close(out, expected, **FWD_TOL[dtype])


def test_fused_add_rmsnorm_prenorm_false_returns_only_out():
    x, residual = _randn((4, N), torch.float32, seed=0), _randn((4, N), torch.float32, seed=3)
    weight = _weight("same", torch.float32)
    out = kbuild.fused_add_rmsnorm(x, residual, weight, prenorm=False)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, kbuild.fused_add_rmsnorm(x, residual, weight)[0])


# --- fused_add_rmsnorm: gradients -------------------------------------------------------------


@pytest.mark.parametrize("with_dresidual_out", [True, False], ids=["dres", "no_dres"])
@pytest.mark.parametrize("dtype, weight_kind, residual_dtype", FUSED_CASES, ids=_case_id)
def test_fused_add_rmsnorm_gradients_match_fp64_autograd(
    dtype, weight_kind, residual_dtype, with_dresidual_out
):
    x = _randn((3, 5, N), dtype, seed=0).requires_grad_()
    residual = _randn((3, 5, N), dtype, seed=3).requires_grad_()
    weight = _weight(weight_kind, dtype)
    if weight is not None:
        weight.requires_grad_()
    dy = _randn(x.shape, dtype, seed=2)
    dres = _randn(x.shape, residual_dtype, seed=4) if with_dresidual_out else None
    out, residual_out = kbuild.fused_add_rmsnorm(
        x, residual, weight, EPS, residual_in_fp32=residual_dtype == torch.float32
    )
    if dres is None:
        out.backward(dy)  # residual_out unused: no gradient flows into it
    else:
        torch.autograd.backward([out, residual_out], [dy, dres])
    _, dx, dw, _ = rmsnorm_grads(x, weight, dy, EPS, residual=residual, dresidual_out=dres)
    assert x.grad.dtype == residual.grad.dtype == dtype
    torch.testing.assert_close(x.grad, residual.grad, rtol=0, atol=0)
    assert_close_rel(x.grad, dx, GRAD_TOL[dtype], "dx")
    if weight is not None:
        assert weight.grad.dtype == weight.dtype
        # dw is taken over residual_out as stored (rounded to residual_dtype), the reference
        # over the exact sum, so the coarser of the two roundings bounds the error.
        tol = max(GRAD_TOL[residual_dtype], GRAD_TOL[weight.dtype])
        assert_close_rel(weight.grad, dw, tol, "dweight")


def test_fused_add_rmsnorm_gradient_through_residual_out_alone():
    x = _randn((4, N), torch.float32, seed=0).requires_grad_()
    residual = _randn((4, N), torch.float32, seed=3).requires_grad_()
    weight = _weight("same", torch.float32).requires_grad_()
    dres = _randn((4, N), torch.float32, seed=4)
    _, residual_out = kbuild.fused_add_rmsnorm(x, residual, weight)
    residual_out.backward(dres)  # out unused: d(x + residual) is exactly dres
    torch.testing.assert_close(x.grad, dres, rtol=0, atol=0)
    torch.testing.assert_close(residual.grad, dres, rtol=0, atol=0)
    assert weight.grad is None or not weight.grad.any()


# --- needs_input_grad ---------------------------------------------------------------------


def test_frozen_weight_gets_no_gradient():
    x = _randn((4, N), torch.float32, seed=0).requires_grad_()
    residual = _randn((4, N), torch.float32, seed=3)
    weight = _weight("same", torch.float32)
    out, residual_out = kbuild.fused_add_rmsnorm(x, residual, weight)
    (out.sum() + residual_out.sum()).backward()
    kbuild.rmsnorm(x, weight).sum().backward()
    assert x.grad is not None
    assert weight.grad is None and residual.grad is None


def test_residual_alone_requiring_grad():
    x = _randn((4, N), torch.float32, seed=0)
    residual = _randn((4, N), torch.float32, seed=3).requires_grad_()
    weight = _weight("same", torch.float32)
    dy = _randn((4, N), torch.float32, seed=2)
    kbuild.fused_add_rmsnorm(x, residual, weight, prenorm=False).backward(dy)
    assert x.grad is None and weight.grad is None
    dx = rmsnorm_grads(x, weight, dy, EPS, residual=residual)[1]
    assert_close_rel(residual.grad, dx, GRAD_TOL[torch.float32], "dresidual")


def test_nothing_requiring_grad_builds_no_graph():
    x, residual = _randn((4, N), torch.float32, seed=0), _randn((4, N), torch.float32, seed=3)
    weight = _weight("same", torch.float32)
    out, residual_out = kbuild.fused_add_rmsnorm(x, residual, weight)
    assert out.grad_fn is None and residual_out.grad_fn is None
    assert not out.requires_grad
    assert kbuild.rmsnorm(x, weight).grad_fn is None


# --- torch.compile ------------------------------------------------------------------------

HIDDEN = 64


class _Block(torch.nn.Module):
    """A pre-norm residual step: h = proj(x); (y, r) = fused_add_rmsnorm(h, x); rmsnorm(y + r)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.norm1 = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN, generator=g))
        self.norm2 = torch.nn.Parameter(1 + 0.1 * torch.randn(HIDDEN, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # eps spelled out: a default eps trips the symbolic-float bug under dynamic=True
        # (test_symbolic_eps_compiles below).
        y, residual = kbuild.fused_add_rmsnorm(self.proj(x), x, self.norm1, eps=1e-6)
        return kbuild.rmsnorm(y + residual, self.norm2, eps=1e-6)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _loss(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (model(x) - target).square().mean()


def _kbuild_ops_in(counter: CompileCounterWithBackend) -> set[str]:
    return {
        str(node.target)
        for gm in counter.graphs
        for node in gm.graph.nodes
        if str(node.target).startswith("kbuild.")
    }


def test_compiled_training_matches_eager(fresh_dynamo):
    torch.manual_seed(0)
    eager = _Block()
    compiled = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("inductor")
    compiled_fn = torch.compile(compiled, backend=counter, fullgraph=True)
    x, target = _randn((8, HIDDEN), torch.float32, 6), _randn((8, HIDDEN), torch.float32, 7)

    explanation = torch._dynamo.explain(compiled)(x)
    assert explanation.graph_count == 1
    assert explanation.graph_break_count == 0

    losses = {}
    for name, model, fn in (("eager", eager, eager), ("compiled", compiled, compiled_fn)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses[name] = []
        for _ in range(3):
            loss = _loss(fn, x, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert counter.frame_count == 1
    assert "kbuild.fused_add_rmsnorm_fwd.default" in _kbuild_ops_in(counter)
    torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=name)


def test_dynamic_batch_size_does_not_recompile(fresh_dynamo):
    torch.manual_seed(0)
    eager = _Block()
    compiled = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("inductor")
    compiled_fn = torch.compile(compiled, backend=counter, fullgraph=True, dynamic=True)
    for batch in (3, 10):
        x, target = _randn((batch, HIDDEN), torch.float32, 6), torch.zeros(batch, HIDDEN)
        for model in (compiled, eager):
            model.zero_grad()
        loss = _loss(compiled_fn, x, target)
        loss.backward()
        expected = _loss(eager, x, target)
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
        for p, q in zip(compiled.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_compiled_fused_add_rmsnorm_on_rank_3_input(fresh_dynamo):
    # The fake rstd is (M,), the CPU op returns (B, T): inductor's output size assert trips.
    x = _randn((2, 3, HIDDEN), torch.float32, 6).requires_grad_()
    residual = _randn((2, 3, HIDDEN), torch.float32, 7)
    fn = torch.compile(kbuild.fused_add_rmsnorm, fullgraph=True)
    out, residual_out = fn(x, residual)
    torch.testing.assert_close(out, kbuild.fused_add_rmsnorm(x, residual)[0])


@pytest.mark.parametrize("fn", ["rmsnorm", "fused_add_rmsnorm"])
@pytest.mark.parametrize("how", ["default-eps-dynamic", "changing-eps"])
def test_symbolic_eps_compiles(fresh_dynamo, fn, how):
    counter = CompileCounterWithBackend("aot_eager")
    norm = getattr(kbuild, fn)

    def call(x: torch.Tensor, eps: float | None) -> torch.Tensor:
        args = (x, None) if fn == "rmsnorm" else (x, x, None)
        out = norm(*args) if eps is None else norm(*args, eps=eps)
        return out if fn == "rmsnorm" else out[0]

    dynamic = True if how == "default-eps-dynamic" else None
    compiled = torch.compile(call, backend=counter, fullgraph=True, dynamic=dynamic)
    for batch, eps in ((3, 1e-6), (5, 1e-5)):
        x = _randn((batch, HIDDEN), torch.float32, 6)
        eps = None if how == "default-eps-dynamic" else eps
        torch.testing.assert_close(compiled(x, eps), call(x, eps))


# --- argument checks ----------------------------------------------------------------------

X = torch.randn(3, N)
R = torch.randn(3, N)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(residual=torch.randn(3, N + 1)), ValueError, "residual"),
        (dict(residual=torch.randn(1, 3, N)), ValueError, "residual"),
        (dict(residual=R.bfloat16()), TypeError, "residual"),
        (dict(residual=torch.empty(3, N, device="meta")), ValueError, "residual"),
        (dict(residual=R.tolist()), TypeError, "residual"),
        (dict(weight=torch.ones(N - 1)), ValueError, "weight"),
        (dict(weight=torch.ones(N, dtype=torch.float16)), TypeError, "weight"),
        (dict(prenorm=1), TypeError, "prenorm"),
        (dict(prenorm=None), TypeError, "prenorm"),
        (dict(residual_in_fp32="yes"), TypeError, "residual_in_fp32"),
        (dict(eps=-1.0), ValueError, "eps"),
    ],
    ids=[
        "residual-shape",
        "residual-rank",
        "residual-dtype",
        "residual-device",
        "residual-list",
        "weight-length",
        "weight-dtype",
        "prenorm-int",
        "prenorm-None",
        "residual_in_fp32-str",
        "eps-negative",
    ],
)
def test_fused_add_rmsnorm_bad_arguments(kwargs, error, name):
    kwargs = dict(residual=R) | kwargs
    with pytest.raises(error, match=rf"\b{name}\b"):
        kbuild.fused_add_rmsnorm(X, **kwargs)


def test_fused_add_rmsnorm_residual_device_message_names_both_devices():
    with pytest.raises(ValueError, match=r"residual.*cpu.*meta"):
        kbuild.fused_add_rmsnorm(X, torch.empty(3, N, device="meta"))
