"""kbuild.cross_entropy's kernels on the GPU: values and gradients against fp64 torch, the
out-of-range report, and bitwise repeats. Kernels warmed with
`kbuild warmup --arch sm_90 --module kbuild.kernels.loss.cross_entropy` (its warmup_specs() lists
every case below: tests/test_cross_entropy_cpu.py checks it)."""

from __future__ import annotations

import pytest
import torch

from kbuild.cases import CE_GPU_DTYPES as GPU_DTYPES
from kbuild.cases import CE_GPU_OPTIONS as GPU_OPTIONS
from kbuild.cases import CE_GPU_V as GPU_V

pytestmark = pytest.mark.gpu

CASES = [
    (V, dtype, index, ls, z, cap)
    for V in GPU_V
    for dtype in GPU_DTYPES
    for index in (torch.int32, torch.int64)
    for ls, z, cap in GPU_OPTIONS
]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _case(V, dtype, index, M=37, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(M, V, device="cuda", generator=g) * 4).to(dtype)
    t = torch.randint(0, V, (M,), device="cuda", generator=g).to(index)
    t[3] = -100
    return x, t


def _fp64(x, t, reduction, ls, z, cap=None):
    from tests.test_cross_entropy_cpu import _fp64 as ref

    return ref(x, t, reduction, ls, z, cap=cap)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("V,dtype,index,ls,z,cap", CASES)
def test_values_and_gradients_match_fp64(V, dtype, index, ls, z, cap, reduction):
    """x scaled by 4 with a cap of 30: tanh bends the largest logits by a few percent, so a
    kernel without the cap (or its gradient factor) is far outside the tolerance."""
    import kbuild

    x, t = _case(V, dtype, index)
    x.requires_grad_()
    y = kbuild.cross_entropy(x, t, reduction=reduction, label_smoothing=ls, lse_square_scale=z,
                             softcap=cap)  # fmt: skip
    ref, xd = _fp64(x, t, reduction, ls, z, cap)
    w = torch.rand(y.shape, device="cuda", dtype=torch.float64) if reduction == "none" else 1.0
    (y.double() * w).sum().backward()
    (ref * w).sum().backward()
    tol = TOL[dtype]
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol)
    assert (x.grad.double() - xd.grad).abs().max() <= tol * xd.grad.abs().max()
    assert x.grad[3].abs().max() == 0


def test_inference_matches_training_loss():
    import kbuild

    x, t = _case(50257, torch.bfloat16, torch.int64)
    with torch.no_grad():
        a = kbuild.cross_entropy(x, t)
    b = kbuild.cross_entropy(x.requires_grad_(), t)
    assert torch.equal(a, b.detach())


def test_a_bad_target_raises():
    """Without waiting: the call returns, and kbuild.check_targets() (or the next call or
    backward once the kernel has run) raises."""
    import kbuild

    x, t = _case(4096, torch.bfloat16, torch.int32)
    t[5] = 4096
    kbuild.cross_entropy(x, t)
    with pytest.raises(ValueError, match="target must hold class ids"):
        kbuild.check_targets()
    torch.cuda.synchronize()  # the kernel has run: the next call raises
    kbuild.cross_entropy(x, t)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="target must hold class ids"):
        kbuild.cross_entropy(x, t[:0].new_zeros(x.shape[0]))
    kbuild.check_targets()  # nothing left pending


def test_checked_targets_make_no_host_synchronisation():
    """The default call (check_targets=True) reads its flag without waiting: no call that
    synchronises (sync debug mode "error" raises on one), forward or backward."""
    import kbuild

    x, t = _case(50257, torch.bfloat16, torch.int64)
    kbuild.cross_entropy(x.clone().requires_grad_(), t).backward()  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kbuild.cross_entropy(x.clone().requires_grad_(), t).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    kbuild.check_targets()


@pytest.mark.parametrize("V", [4096, 50257, 151936])
def test_bitwise_repeats(V):
    import kbuild

    x, t = _case(V, torch.bfloat16, torch.int64, M=256)
    outs = []
    for _ in range(3):
        xr = x.detach().clone().requires_grad_()
        y = kbuild.cross_entropy(xr, t, label_smoothing=0.1, lse_square_scale=1e-4)
        y.backward()
        outs.append((y.detach(), xr.grad))
    for y, g in outs[1:]:
        assert torch.equal(y, outs[0][0]) and torch.equal(g, outs[0][1])


@pytest.mark.parametrize("V", [1000, 50257, 151936])
@pytest.mark.parametrize("cap", [None, 30.0])
def test_inplace_backward_matches_and_holds_no_second_copy(V, cap):
    """inplace_backward: the same loss and gradient bitwise as the default path, and the
    gradient lives in the logits' own memory (no logits-sized tensor is kept)."""
    import kbuild

    x, t = _case(V, torch.bfloat16, torch.int64, M=64)
    w = x.detach().clone().requires_grad_()
    ref = kbuild.cross_entropy(w * 1, t, label_smoothing=0.1, softcap=cap)
    ref.backward()
    v = x.detach().clone().requires_grad_()
    logits = v * 1
    ptr = logits.data_ptr()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = kbuild.cross_entropy(logits, t, label_smoothing=0.1, softcap=cap, inplace_backward=True)
    held = torch.cuda.memory_allocated() - before
    assert held < logits.numel() * logits.element_size() // 4  # no second copy
    y.backward()
    assert logits.data_ptr() == ptr
    assert torch.equal(y, ref) and torch.equal(v.grad, w.grad)


@pytest.mark.parametrize("M", [64, 1024])  # the chooser's plan, and one block a row
@pytest.mark.parametrize("cap", [None, 30.0])
def test_inplace_backward_on_a_padded_vocabulary_view(M, cap):
    """inplace_backward on logits[:, :50257] of rows 50304 wide (llm.c's padded GPT-2
    vocabulary; the fused loss's chunks are such views): the dense call's loss and gradient
    within one bf16 rounding (the rows start at another phase of a vector, so each thread's
    share of the sums differs), the padding columns' gradient zero. Catches the strided
    kernels addressing rows N apart on the device, or a launch copying the view."""
    import kbuild

    x, t = _case(50257, torch.bfloat16, torch.int64, M=M)
    w = x.detach().clone().requires_grad_()
    ref = kbuild.cross_entropy(w * 1, t, label_smoothing=0.1, softcap=cap)
    ref.backward()
    wide = torch.zeros(M, 50304, device="cuda", dtype=torch.bfloat16)
    wide[:, :50257] = x
    wide.requires_grad_()
    y = kbuild.cross_entropy((wide * 1)[:, :50257], t, label_smoothing=0.1, softcap=cap,
                             inplace_backward=True)  # fmt: skip
    y.backward()
    one_rounding = dict(rtol=2**-7, atol=1e-30)
    assert torch.allclose(y.float(), ref.float(), **one_rounding)
    assert torch.allclose(wide.grad[:, :50257].float(), w.grad.float(), **one_rounding)
    assert not wide.grad[:, 50257:].any()


def test_check_targets_false_does_not_synchronise_and_ignores_the_row():
    import kbuild

    x, t = _case(4096, torch.bfloat16, torch.int32)
    t[5] = 4096
    rows = kbuild.cross_entropy(x, t, reduction="none", check_targets=False)
    assert rows[5] == 0


def test_captured_into_a_cuda_graph():
    """No host read and no host-to-device copy per call: the forward and backward capture,
    and replays give the eager values."""
    import kbuild

    x, t = _case(50257, torch.bfloat16, torch.int64, M=64)
    kbuild.cross_entropy(x.clone().requires_grad_(), t, label_smoothing=0.1)  # warm
    static = x.clone().requires_grad_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            static.grad = None
            kbuild.cross_entropy(static, t, label_smoothing=0.1).backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    static.grad = None
    with torch.cuda.graph(graph):
        y = kbuild.cross_entropy(static, t, label_smoothing=0.1)
        y.backward()
    graph.replay()
    ref_x = x.clone().requires_grad_()
    ref = kbuild.cross_entropy(ref_x, t, label_smoothing=0.1)
    ref.backward()
    torch.cuda.synchronize()
    assert torch.equal(y, ref) and torch.equal(static.grad, ref_x.grad)
