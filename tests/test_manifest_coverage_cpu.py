"""The manifests checked on CPU against the calls of the GPU tests and benchmarks.

The GPU machine has no compiler: it runs offline (KBUILD_OFFLINE=1) from a cache warmed here
from manifest("tests") and manifest("bench"), so a kernel that a GPU test or benchmark launches
and the manifest lacks fails only there, later. Here each GPU test file's calls run over its own
case lists (tests/gpu_cases.py, which the GPU tests iterate too) with CPU tensors that pretend
CUDA and a fake tier (launch_recorder.Tier) that records the spec of every kernel asked for.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F

import kbuild
from kbuild.cases import (
    BENCH_N,
    DTYPES,
    OFFSET_N,
    QK_HEADS,
    QK_N,
    STREAM_BENCH_N,
    STREAM_N,
    TEST_N,
    TINY_SHAPE,
    TRAIN_DTYPE,
    TRAIN_N,
)
from kbuild.cli.manifest import manifest
from kbuild.kernels.norms.rmsnorm import rmsnorm_fwd_spec

from . import multi_gpu_worker, test_multi_gpu, test_rmsnorm_bwd_gpu
from .gpu_cases import (
    DETERMINISTIC_N,
    LARGE_MEAN_N,
    RSTD_N,
    fused_cases,
    layernorm_cases,
    rmsnorm_cases,
)
from .launch_recorder import TORCH, Tier, install, layernorm, pretend_cuda, rmsnorm
from .launch_recorder import zeros as _t
from .test_rmsnorm_bwd_gpu import _Block as TrainBlock
from .test_rmsnorm_bwd_gpu import _Stream


@pytest.fixture
def tier(monkeypatch):
    fake = Tier()
    install(monkeypatch, fake.get_launcher, fake.loaded)
    pretend_cuda(monkeypatch)
    return fake


@functools.cache
def _manifest(name: str) -> frozenset:
    return frozenset(manifest(name))


def _rows(M: int) -> int:
    """A GPU test's rows on CPU: a kernel does not depend on M, but M = 0 (no launch) stays."""
    return min(M, 3)


def _x(M, N, dtype, grad=False):
    return _t((_rows(M), N), dtype).requires_grad_(grad)


def _p(N, dtype, grad=False):
    return None if dtype is None else _t((N,), dtype).requires_grad_(grad)


def _grad(outputs, inputs, grads):
    torch.autograd.grad(outputs, [t for t in inputs if t is not None], grads)


@contextlib.contextmanager
def _nothing_if_empty(tier, M):
    """M = 0 launches nothing, forward or backward (a launch of no rows is a wasted load or a
    zero-block grid error on the GPU)."""
    start = len(tier.requests)
    yield
    assert M != 0 or len(tier.requests) == start, [r[2].short() for r in tier.requests[start:]]


def _rmsnorm_gpu(tier):
    """tests/test_rmsnorm_gpu.py, test by test."""
    for N in TEST_N:
        for dtype in DTYPES:
            for M, w in rmsnorm_cases(dtype):  # test_forward_matches_reference (no grad)
                with _nothing_if_empty(tier, M):
                    kbuild.rmsnorm(_x(M, N, dtype), _p(N, w), eps=1e-6)
    for N in RSTD_N:
        for dtype in DTYPES:  # test_rstd_matches: the storing forward, called directly
            rmsnorm.rmsnorm_fwd(_x(37, N, dtype), _p(N, dtype), 1e-6, store_rstd=True)
    x, w = _x(64, 4096, "f32"), _p(4096, "f32")
    for eps in (1e-6, 1e-2):  # test_eps_is_honoured
        kbuild.rmsnorm(x, w, eps=eps)
    N, w = 4096, _p(4096, "bf16")  # test_unaligned_and_strided_inputs
    unaligned = torch.zeros(9 * N + 1, dtype=torch.bfloat16)[1:].view(9, N)
    assert unaligned.data_ptr() % 16 != 0  # 2 bytes past a 16-byte boundary: the scalar kernel
    for x in (unaligned, _t((N, 6), "bf16").t(), _t((2, 3, N), "bf16")):  # and strided, 3-d
        kbuild.rmsnorm(x, w)
    kbuild.rmsnorm(_x(1, N, "bf16"), w)  # test_beyond_2_31_elements, the device guard test


def _rmsnorm_bwd_gpu(tier):
    """tests/test_rmsnorm_bwd_gpu.py, test by test."""
    for N in TEST_N:
        for dtype in DTYPES:
            for M, w_dtype in rmsnorm_cases(dtype):  # test_rmsnorm_backward
                with _nothing_if_empty(tier, M):
                    x, w = _x(M, N, dtype, grad=True), _p(N, w_dtype, grad=True)
                    _grad(kbuild.rmsnorm(x, w, 1e-6), [x, w], _x(M, N, dtype))
            for M, w_dtype, residual, with_dres in fused_cases(dtype):  # test_fused_add_rmsnorm
                with _nothing_if_empty(tier, M):
                    x, r = _x(M, N, dtype, grad=True), _x(M, N, dtype, grad=True)
                    w, fp32 = _p(N, w_dtype, grad=True), residual == "f32"
                    out, res = kbuild.fused_add_rmsnorm(x, r, w, 1e-6, residual_in_fp32=fp32)
                    dy = _x(M, N, dtype)
                    if with_dres:
                        _grad([out, res], [x, r, w], [dy, torch.zeros_like(res)])
                    else:
                        _grad([out], [x, r, w], [dy])
    # test_frozen_weight_and_input_grads_respected: dx without dw, then dw without dx
    x, w, dy = _x(64, 4096, "bf16", grad=True), _p(4096, "bf16"), _x(64, 4096, "bf16")
    _grad(kbuild.rmsnorm(x, w), [x], dy)
    w.requires_grad_()
    _grad(kbuild.rmsnorm(x.detach(), w), [w], dy)
    for N in DETERMINISTIC_N:  # test_dw_bitwise_deterministic: only w needs a gradient
        x, r, dy = (_x(256, N, "bf16") for _ in range(3))
        w = _p(N, "bf16", grad=True)
        _grad(kbuild.rmsnorm(x, w), [w], dy)
        _grad(kbuild.fused_add_rmsnorm(x, r, w)[0], [w], dy)
    for N in OFFSET_N:  # test_weight_offset
        for w_dtype in ("bf16", "f32"):
            x, w, dy = _x(300, N, "bf16", grad=True), _p(N, w_dtype, grad=True), _x(300, N, "bf16")
            _grad(kbuild.rmsnorm(x, w, 1e-6, offset=1.0), [x, w], dy)
            y = kbuild.fused_add_rmsnorm(x, torch.zeros_like(x), w, 1e-6, False, offset=1.0)
            _grad(y, [x, w], dy)
            kbuild.rmsnorm(x.detach(), _p(N, "bf16"), 1e-6)  # the bf16-first variant
    for N, pad in test_rmsnorm_bwd_gpu.QK_CASES:  # test_qk_norm_in_place: q and k views
        B, T, H, width = test_rmsnorm_bwd_gpu.qk_case(N, pad)
        qkv = _t((1, 2, width), "bf16").requires_grad_()
        heads = qkv[..., : 3 * H * N].view(1, 2, 3, H, N)
        w = _p(N, "bf16", grad=True)
        for part in (0, 1):
            x = heads[:, :, part]
            _grad(kbuild.rmsnorm(x, w, 1e-6), [x, w], _t((1, 2, H, N), "bf16"))
    for width in STREAM_N:  # test_fp32_residual_stream_trains
        _Stream(width, 4, "kbuild")(_x(512, width, "bf16")).backward()
    # test_compiled_training_matches_eager's model, eagerly: torch.compile calls the kbuild::*
    # custom ops, which launch the same kernels (it cannot trace tensors that pretend CUDA).
    TrainBlock(TRAIN_N).to(TORCH[TRAIN_DTYPE])(_x(16, TRAIN_N, TRAIN_DTYPE)).backward()


def _layernorm_gpu(tier):
    """tests/test_layernorm_gpu.py, test by test."""
    for N in TEST_N:
        for dtype in DTYPES:
            for M, w_dtype, b_dtype in layernorm_cases(dtype):  # test_layernorm_forward_backward
                with _nothing_if_empty(tier, M):
                    x = _x(M, N, dtype, grad=True)
                    w, b = _p(N, w_dtype, grad=True), _p(N, b_dtype, grad=True)
                    _grad(kbuild.layernorm(x, w, b, 1e-5), [x, w, b], _x(M, N, dtype))
    # test_stats_match: the storing forward, called directly
    layernorm.layernorm_fwd(_x(33, 4096, "bf16"), None, None, 1e-5, store_stats=True)
    for N in LARGE_MEAN_N:  # test_large_mean_keeps_fp32_accuracy
        kbuild.layernorm(_x(64, N, "f32"), None, None, 1e-5)
    for N in DETERMINISTIC_N:  # test_dw_db_bitwise_deterministic: only w and b need gradients
        x, w, b = _x(256, N, "bf16"), _p(N, "bf16", grad=True), _p(N, "bf16", grad=True)
        _grad(kbuild.layernorm(x, w, b), [w, b], _x(256, N, "bf16"))
    for module in (kbuild.nn.LayerNorm(768), kbuild.nn.RMSNorm(768, eps=1e-6)):  # nn modules
        x = _x(16, 768, "f32", grad=True)
        _grad(module(x), [x, *module.parameters()], _x(16, 768, "f32"))
        module(x)


def _multi_gpu(tier):
    """tests/test_multi_gpu.py: its three CASES at its SHAPES, with and without autograd, and
    the DDP worker's model trained one step."""
    for N, dtype in test_multi_gpu.SHAPES:
        x, r = (_x(test_multi_gpu.M, N, dtype, grad=True) for _ in range(2))
        w, b = _p(N, dtype, grad=True), _p(N, dtype, grad=True)
        dy = _x(test_multi_gpu.M, N, dtype)
        _grad(kbuild.rmsnorm(x, w, 1e-6), [x, w], dy)
        _grad(kbuild.layernorm(x, w, b, 1e-5), [x, w, b], dy)
        _grad(list(kbuild.fused_add_rmsnorm(x, r, w, 1e-6)), [x, r, w], [dy, dy])
        with torch.no_grad():
            kbuild.rmsnorm(x, w, 1e-6)
            kbuild.layernorm(x, w, b, 1e-5)
            kbuild.fused_add_rmsnorm(x, r, w, 1e-6)
    torch.manual_seed(0)
    x, target = multi_gpu_worker.batch(0, 0, torch.device("cpu"))
    F.mse_loss(multi_gpu_worker.Block("kbuild")(x), target).backward()


def _bench(tier):
    """bench/bench_rmsnorm.py, bench_rmsnorm_bwd.py and bench_layernorm.py: their kbuild calls
    at every BENCH_N (one row: the GPU's BENCH_ELEMENTS // N rows run the same kernels)."""
    for N in BENCH_N:
        x, r, dy = (_x(1, N, "bf16") for _ in range(3))
        w, b = _p(N, "bf16"), _p(N, "bf16")
        kbuild.rmsnorm(x, w, 1e-6)  # the inference forwards
        kbuild.fused_add_rmsnorm(x, r, w)
        kbuild.layernorm(x, w, b)
        xg, rg, wg, bg = (t.clone().requires_grad_() for t in (x, r, w, b))
        _grad(kbuild.rmsnorm(xg, wg), [xg, wg], dy)
        _grad(list(kbuild.fused_add_rmsnorm(xg, rg, wg)), [xg, rg, wg], [dy, dy])
        _grad(kbuild.layernorm(xg, wg, bg), [xg, wg, bg], dy)
    for N in BENCH_N:  # bench_variants.py: the weight offset, inference and training
        x, w, dy = _x(1, N, "bf16"), _p(N, "bf16"), _x(1, N, "bf16")
        kbuild.rmsnorm(x, w, 1e-6, offset=1.0)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        _grad(kbuild.rmsnorm(xg, wg, 1e-6, offset=1.0), [xg, wg], dy)
    for N in QK_N:  # bench_variants.py: QK-norm rows, dense and a fused qkv's q view
        qkv = _t((2, 3 * QK_HEADS * N), "bf16").requires_grad_()
        q = qkv.view(2, 3, QK_HEADS, N)[:, 0]
        for x in (_x(1, N, "bf16", grad=True), q):
            w, dy = _p(N, "bf16", grad=True), torch.zeros(x.shape, dtype=x.dtype)
            kbuild.rmsnorm(x.detach(), w.detach(), 1e-6)
            _grad(kbuild.rmsnorm(x, w, 1e-6), [x, w], dy)
    for N in STREAM_BENCH_N:  # bench_variants.py: the fp32 residual stream
        x, r, w = _x(1, N, "bf16"), _x(1, N, "f32"), _p(N, "f32")
        kbuild.fused_add_rmsnorm(x, r, w, 1e-6)
        xg, rg, wg = (t.clone().requires_grad_() for t in (x, r, w))
        _grad(list(kbuild.fused_add_rmsnorm(xg, rg, wg, 1e-6)), [xg, rg, wg], [x, r])
    M, N = TINY_SHAPE  # bench_rmsnorm.host_overhead
    x, w = _x(M, N, "bf16"), _p(N, "bf16")
    kbuild.rmsnorm(x, w, 1e-6)
    rmsnorm.rmsnorm_fwd(x, w, 1e-6, False)
    # Specs the scripts load directly: host_overhead's raw launcher (TINY_SHAPE), and 4096 in
    # bench_rmsnorm.COLD_LOAD and bench/launch_probe.py.
    return [rmsnorm_fwd_spec(n, "bf16", "bf16", False, 1e-6) for n in (N, 4096)]


# name -> (drive, manifest, "kernel field=value ..." the drive must ask for: each special case
# is launched, so a drive cannot silently stop covering one)
GPU_RUNS = {
    "test_rmsnorm_gpu": (
        _rmsnorm_gpu,
        "tests",
        (
            "rmsnorm_fwd N=4096 dtype=f32 eps=0.01",
            "rmsnorm_fwd N=4096 dtype=bf16 vectorize=False",
            "rmsnorm_fwd N=65536 store_rstd=True",
        ),
    ),
    "test_rmsnorm_bwd_gpu": (
        _rmsnorm_bwd_gpu,
        "tests",
        (
            "rmsnorm_bwd N=4096 dtype=bf16 weight_dtype=bf16 compute_dw=False",
            "fused_add_rmsnorm_bwd has_dresidual_out=False residual_dtype=f32",
            "fused_add_rmsnorm_bwd has_dresidual_out=True dtype=f16",
            f"fused_add_rmsnorm_bwd N={TRAIN_N} dtype={TRAIN_DTYPE}",
            "rmsnorm_bwd N=128 offset=1.0 weight_dtype=f32",
            "fused_add_rmsnorm_fwd N=65536 offset=1.0 store_rstd=True",
            "fused_add_rmsnorm_fwd N=4096 residual_in_dtype=f32 weight_dtype=f32",
            "fused_add_rmsnorm_bwd N=1024 dresidual_dtype=f32 has_dresidual_out=True",
            "rmsnorm_fwd N=64 strided=True store_rstd=True",
            "rmsnorm_bwd N=128 strided=True vectorize=False",
        ),
    ),
    "test_layernorm_gpu": (
        _layernorm_gpu,
        "tests",
        (
            "layernorm_bwd dtype=bf16 compute_dw=True compute_db=False",
            "layernorm_fwd dtype=bf16 weight_dtype=f32 bias_dtype=f32",
            "layernorm_fwd dtype=f16 weight_dtype=f16 bias_dtype=None",
            "column_sum out_dtype=bf16 planes=2",
        ),
    ),
    "test_multi_gpu": (_multi_gpu, "tests", (f"layernorm_bwd N={TRAIN_N} dtype={TRAIN_DTYPE}",)),
    "bench": (
        _bench,
        "bench",
        (
            *(f"layernorm_bwd N={N} dtype=bf16" for N in BENCH_N),
            "rmsnorm_bwd N=65536 offset=1.0",
            "rmsnorm_bwd N=128 compute_dw=True",
        ),
    ),
}


@pytest.mark.parametrize("run", sorted(GPU_RUNS))
def test_gpu_run_finds_every_kernel_warmed(run, tier):
    """Each GPU test file (and the benchmarks) driven over its own case lists with tensors that
    pretend CUDA: every kernel asked for must be in the manifest the GPU cache is warmed from
    (a dropped frozen-weight, eps, unaligned, 2-plane column sum or shape spec fails here)."""
    drive, name, expected = GPU_RUNS[run]
    loaded_directly = drive(tier) or []
    asked = set(tier.specs) | set(loaded_directly)
    missing = sorted(spec.short() for spec in asked - _manifest(name))
    assert not missing, f"{len(missing)} kernels not in manifest({name!r}): {missing[:8]}"
    fields = [(spec.kernel, {f"{k}={v}" for k, v in spec.kwargs.items()}) for spec in asked]
    for want in expected:
        kernel, *want_fields = want.split()
        assert any(k == kernel and set(want_fields) <= f for k, f in fields), f"{run}: no {want}"
