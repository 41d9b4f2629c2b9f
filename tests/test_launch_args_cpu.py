"""The launch functions pass each kernel exactly the arguments its signature names, in order.

No GPU here, so the launcher is a recorder: `get_launcher` builds the real kernel (IR only,
no ptxas) to learn its signature, and the recorded call is checked name by name against the
tensors given. A pointer in the wrong slot would be a GPU fault or silent garbage on a GPU;
here it is a failed assertion.
"""

from __future__ import annotations

import functools

import pytest
import torch

import kbuild
from kbuild import compiler
from kbuild.targets import target_for_arch

from .launch_recorder import FakeLauncher, Tier, install, layernorm, pretend_cuda, rmsnorm

SM90 = target_for_arch("sm_90")


@functools.cache
def _signature(spec) -> tuple[tuple[str, str], ...]:
    return tuple(compiler.build(spec, SM90).signature())


class Recorder(FakeLauncher):
    """Stands in for runtime.cuda.Launcher: records (spec, grid, args) of every launch."""

    calls: list = []

    def __init__(self, spec):
        super().__init__(spec)
        self.signature = _signature(spec)

    def __call__(self, grid, stream, *args):
        assert len(args) == len(self.signature), (self.spec.short(), args)
        Recorder.calls.append(
            (self.spec, grid, dict(zip([n for n, _ in self.signature], args, strict=True)))
        )


@pytest.fixture
def recorder(monkeypatch):
    Recorder.calls = []
    install(monkeypatch, lambda key, device, make_spec: Recorder(make_spec()))
    return Recorder


def _t(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def _ptr(t):
    return t.data_ptr()


@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("store_rstd", [True, False])
def test_rmsnorm_fwd_arguments(recorder, with_weight, store_rstd):
    x, w = _t(5, 64), _t(64) if with_weight else None
    y, rstd = rmsnorm.rmsnorm_fwd(x, w, 1e-6, store_rstd)
    ((spec, grid, args),) = recorder.calls
    assert spec.kernel == "rmsnorm_fwd" and spec["store_rstd"] == store_rstd
    assert args.pop("x") == _ptr(x) and args.pop("y") == _ptr(y) and args.pop("M") == 5
    assert (args.pop("weight") == _ptr(w)) if with_weight else "weight" not in args
    assert (args.pop("rstd") == _ptr(rstd)) if store_rstd else "rstd" not in args
    assert not args and grid == 3  # ceil(5 / rows_per_block)


@pytest.mark.parametrize("with_weight", [True, False])
def test_rmsnorm_bwd_arguments(recorder, with_weight):
    x, dy, w = _t(5, 64), _t(5, 64), _t(64) if with_weight else None
    rstd = torch.rand(5)
    dx, dw = rmsnorm.rmsnorm_bwd(dy, x, w, rstd, need_dw=True)
    bwd = recorder.calls[0]
    spec, grid, args = bwd
    assert spec.kernel == "rmsnorm_bwd" and grid == 3  # min(groups, resident blocks)
    assert args.pop("x") == _ptr(x) and args.pop("dy") == _ptr(dy)
    assert args.pop("rstd") == _ptr(rstd) and args.pop("dx") == _ptr(dx) and args.pop("M") == 5
    if with_weight:
        assert args.pop("weight") == _ptr(w)
        partial = args.pop("dw_partial")
        ((sum_spec, _, sum_args),) = recorder.calls[1:]
        assert sum_spec.kernel == "column_sum" and sum_args["partial"] == partial
        assert sum_args["out"] == _ptr(dw) and sum_args["R"] == 3  # one row per block
    else:
        assert dw is None and len(recorder.calls) == 1
    assert not args


@pytest.mark.parametrize("with_dres", [True, False])
@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float32])
def test_fused_arguments(recorder, with_dres, residual_dtype):
    x, r, w = _t(4, 64), _t(4, 64), _t(64)
    y, res, rstd = rmsnorm.fused_add_rmsnorm_fwd(x, r, w, 1e-6, residual_dtype, True)
    spec, _, args = recorder.calls[0]
    assert spec.kernel == "fused_add_rmsnorm_fwd" and res.dtype == residual_dtype
    expected = {"x": x, "residual": r, "weight": w, "y": y, "residual_out": res, "rstd": rstd}
    assert {k: v for k, v in args.items() if k != "M"} == {k: _ptr(v) for k, v in expected.items()}
    recorder.calls.clear()
    dy = _t(4, 64)
    dres = torch.randn(4, 64).to(residual_dtype) if with_dres else None
    dsum, _, dw = rmsnorm.fused_add_rmsnorm_bwd(dy, dres, res, w, rstd, need_dw=True)
    spec, _, args = recorder.calls[0]
    assert spec.kernel == "fused_add_rmsnorm_bwd" and spec["has_dresidual_out"] == with_dres
    assert args.pop("x") == _ptr(res) and args.pop("weight") == _ptr(w)
    assert args.pop("dy") == _ptr(dy) and args.pop("rstd") == _ptr(rstd)
    assert args.pop("dx") == _ptr(dsum) and args.pop("M") == 4
    assert (args.pop("dresidual_out") == _ptr(dres)) if with_dres else "dresidual_out" not in args
    assert set(args) == {"dw_partial"}


@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, False)])
def test_layernorm_arguments(recorder, affine):
    x = _t(6, 64)
    w = _t(64) if affine[0] else None
    b = _t(64) if affine[1] else None
    y, mean, rstd = layernorm.layernorm_fwd(x, w, b, 1e-5, store_stats=True)
    spec, _, args = recorder.calls[0]
    expected = {"x": x, "weight": w, "bias": b, "y": y, "mean": mean, "rstd": rstd}
    want = {k: _ptr(v) for k, v in expected.items() if v is not None}
    assert {k: v for k, v in args.items() if k != "M"} == want and args["M"] == 6
    recorder.calls.clear()
    dy = _t(6, 64)
    dx, dw, db = layernorm.layernorm_bwd(dy, x, w, mean, rstd, True, b, True)
    spec, _, args = recorder.calls[0]
    assert spec["compute_dw"] == affine[0] and spec["compute_db"] == affine[1]
    expected = {"x": x, "weight": w, "dy": dy, "mean": mean, "rstd": rstd, "dx": dx}
    want = {k: _ptr(v) for k, v in expected.items() if v is not None}
    got = {k: v for k, v in args.items() if k not in ("M", "dw_partial", "db_partial")}
    assert got == want
    assert ("dw_partial" in args) == affine[0] and ("db_partial" in args) == affine[1]
    sums = [c for c in recorder.calls if c[0].kernel == "column_sum"]
    outs = [_ptr(g) for g in (dw, db) if g is not None]
    got = [c[2][name] for c in sums for name in ("out", "out1") if name in c[2]]
    assert got == outs
    if affine == (True, True):
        # dw and db (one dtype) sum in one launch over a [2, R, N] workspace whose planes
        # the backward kernel wrote: dw_partial is plane 0, db_partial plane 1.
        ((sum_spec, _, sum_args),) = sums
        assert sum_spec["planes"] == 2 and sum_args["partial"] == args["dw_partial"]
        assert args["db_partial"] - args["dw_partial"] == sum_args["R"] * 64 * 4


def test_strided_weight_is_made_dense():
    """Kernels read a weight as a dense (N,) array: a strided view is copied first."""
    from kbuild.op.tensors import check_param

    x = _t(3, 64)
    packed = _t(64, 2)
    weight = check_param("weight", packed[:, 0], x)
    assert weight.is_contiguous() and torch.equal(weight, packed[:, 0])


@pytest.mark.parametrize("store", [True, False])
def test_empty_rows_launch_nothing(recorder, store):
    """N == 0 (rows with no elements) and M == 0 launch nothing; stats of empty rows are NaN."""
    y, rstd = rmsnorm.rmsnorm_fwd(_t(3, 0), None, 1e-6, store)
    assert y.shape == (3, 0) and not recorder.calls
    assert (rstd.shape == (3,) and rstd.isnan().all()) if store else rstd is None
    y, mean, rstd = layernorm.layernorm_fwd(_t(0, 64), None, None, 1e-5, store)
    assert y.shape == (0, 64) and not recorder.calls
    dx, dw = rmsnorm.rmsnorm_bwd(_t(0, 64), _t(0, 64), _t(64), torch.rand(0), need_dw=True)
    assert dx.shape == (0, 64) and torch.equal(dw, torch.zeros(64, dtype=dw.dtype))
    assert not recorder.calls


@pytest.mark.parametrize("residual_grad", [True, False])
def test_fp32_stream_gradient_written_only_when_wanted(monkeypatch, residual_grad):
    """The backward of a call with an fp32 residual writes d(residual) in fp32 (4 bytes an
    element more) only when the residual needs a gradient (Python launch path)."""
    tier = Tier()
    install(monkeypatch, tier.get_launcher, tier.loaded)
    pretend_cuda(monkeypatch)
    x = torch.randn(4, 64).bfloat16().requires_grad_()
    r = torch.randn(4, 64).requires_grad_(residual_grad)
    w = torch.randn(64).bfloat16().requires_grad_()
    out, stream = kbuild.fused_add_rmsnorm(x, r, w)
    assert stream.dtype == torch.float32
    out.float().sum().backward()
    (bwd,) = [s for s in tier.specs if s.kernel == "fused_add_rmsnorm_bwd"]
    assert bwd.kwargs.get("dresidual_dtype") == ("f32" if residual_grad else None)
