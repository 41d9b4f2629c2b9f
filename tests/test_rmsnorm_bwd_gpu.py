"""RMSNorm and fused add + RMSNorm training on the GPU: gradients against fp64 autograd,
bitwise-deterministic dw, and a model trained under torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch

import kbuild
from kbuild.cases import DTYPES, OFFSET_N, QK_N, STREAM_N, TEST_N, TRAIN_DTYPE, TRAIN_N

from .gpu_cases import DETERMINISTIC_N, fused_cases, rmsnorm_cases
from .gpu_utils import FWD_TOL, GRAD_TOL, TORCH_DTYPES, poison_allocator, rand
from .reference import assert_close_rel, dx_terms, rmsnorm_grads

pytestmark = pytest.mark.gpu


def _weight(N, w_dtype, seed):
    if w_dtype is None:
        return None
    return (1.0 + rand((N,), TORCH_DTYPES[w_dtype], seed, scale=0.5)).requires_grad_()


@pytest.mark.parametrize("N", TEST_N)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_backward(N: int, dtype: str) -> None:
    tdtype = TORCH_DTYPES[dtype]
    for M, w_dtype in rmsnorm_cases(dtype):
        x = rand((M, N), tdtype, seed=N + M).requires_grad_()
        w = _weight(N, w_dtype, seed=N)
        dy = rand((M, N), tdtype, seed=N + M + 1)
        poison_allocator(M * N, tdtype)
        y = kbuild.rmsnorm(x, w, 1e-6)
        grads = torch.autograd.grad(y, [t for t in (x, w) if t is not None], dy)
        ref_y, ref_dx, ref_dw, _ = rmsnorm_grads(x.detach(), w, dy, 1e-6)
        what = f"M={M} N={N} {dtype} w={w_dtype}"
        assert grads[0].dtype == tdtype
        floor = dx_terms(x, w, dy, 1e-6)
        assert_close_rel(grads[0], ref_dx, GRAD_TOL[tdtype], "dx " + what, floor)
        if w is not None:
            assert grads[1].dtype == w.dtype
            assert_close_rel(grads[1], ref_dw, GRAD_TOL[w.dtype] + GRAD_TOL[tdtype], "dw " + what)


def test_frozen_weight_and_input_grads_respected() -> None:
    x = rand((64, 4096), torch.bfloat16, seed=1).requires_grad_()
    w = 1.0 + rand((4096,), torch.bfloat16, seed=2)  # no grad: no dw work
    dy = rand((64, 4096), torch.bfloat16, seed=3)
    (dx,) = torch.autograd.grad(kbuild.rmsnorm(x, w), [x], dy)
    assert_close_rel(dx, rmsnorm_grads(x.detach(), w, dy, 1e-6)[1], GRAD_TOL[torch.bfloat16])
    w.requires_grad_()
    x2 = x.detach()  # only the weight needs a gradient
    (dw,) = torch.autograd.grad(kbuild.rmsnorm(x2, w), [w], dy)
    assert_close_rel(dw, rmsnorm_grads(x2, w, dy, 1e-6)[2], 2 * GRAD_TOL[torch.bfloat16])


@pytest.mark.parametrize("N", TEST_N)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rmsnorm(N: int, dtype: str) -> None:
    tdtype = TORCH_DTYPES[dtype]
    for M, w_dtype, residual_dtype, with_dres in fused_cases(dtype):
        x = rand((M, N), tdtype, seed=N + M).requires_grad_()
        r = rand((M, N), tdtype, seed=N + M + 7).requires_grad_()
        w = _weight(N, w_dtype, seed=N)
        fp32 = residual_dtype == "f32"
        out, res = kbuild.fused_add_rmsnorm(x, r, w, 1e-6, residual_in_fp32=fp32)
        assert res.dtype == TORCH_DTYPES[residual_dtype] and out.dtype == tdtype
        dy = rand((M, N), tdtype, seed=N + 2)
        dres = rand((M, N), res.dtype, seed=N + 3) if with_dres else None
        outputs, grads_in = ([out, res], [dy, dres]) if with_dres else ([out], [dy])
        dx, dr, dw = torch.autograd.grad(outputs, [x, r, w], grads_in)
        # The reference normalises the stored residual_out, as the kernel must.
        res_ref = (x.detach().double() + r.detach().double()).to(res.dtype)
        torch.testing.assert_close(res, res_ref, rtol=0, atol=0)
        ref_y, ref_d, ref_dw, _ = rmsnorm_grads(res_ref, w, dy, 1e-6, dresidual_out=dres)
        what = f"M={M} N={N} {dtype} w={w_dtype} res={residual_dtype} dres={with_dres}"
        tol = GRAD_TOL[tdtype]
        assert_close_rel(out, ref_y.to(tdtype), tol, "out " + what)
        floor = dx_terms(res_ref, w, dy, 1e-6)
        assert_close_rel(dx, ref_d, tol, "dx " + what, floor)
        assert torch.equal(dx, dr), "dx and dresidual must be the same values"
        assert_close_rel(dw, ref_dw, GRAD_TOL[w.dtype] + tol, "dw " + what)


@pytest.mark.parametrize("N", DETERMINISTIC_N)
def test_dw_bitwise_deterministic(N: int) -> None:
    # N = 65536 splits each row over a cluster of blocks (Hopper): fewer, longer rows.
    x = rand((256 if N == 65536 else 4096, N), torch.bfloat16, seed=4)
    w = _weight(N, "bf16", seed=5)
    dy = rand(x.shape, torch.bfloat16, seed=6)
    runs = [torch.autograd.grad(kbuild.rmsnorm(x, w), [w], dy)[0] for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    r = rand(x.shape, torch.bfloat16, seed=7)
    fused = [
        torch.autograd.grad(kbuild.fused_add_rmsnorm(x, r, w)[0], [w], dy)[0] for _ in range(3)
    ]
    assert all(torch.equal(fused[0], f) for f in fused[1:])


class _Block(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.norm1 = torch.nn.Parameter(torch.ones(n))
        self.norm2 = torch.nn.Parameter(torch.ones(n))
        self.fc1 = torch.nn.Linear(n, n)
        self.fc2 = torch.nn.Linear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(kbuild.rmsnorm(x, self.norm1))
        normed, residual = kbuild.fused_add_rmsnorm(h, x, self.norm2)
        return (self.fc2(normed) + residual).square().mean()


def test_compiled_training_matches_eager() -> None:
    torch.manual_seed(0)
    dtype = TORCH_DTYPES[TRAIN_DTYPE]
    eager = _Block(TRAIN_N).cuda().to(dtype)
    compiled_model = _Block(TRAIN_N).cuda().to(dtype)
    compiled_model.load_state_dict(eager.state_dict())
    step = torch.compile(compiled_model, fullgraph=True, dynamic=True)
    opt_e = torch.optim.SGD(eager.parameters(), lr=1e-2)
    opt_c = torch.optim.SGD(compiled_model.parameters(), lr=1e-2)
    for i, batch in enumerate((16, 16, 24, 40)):  # dynamic M: no recompile per batch size
        x = rand((batch, TRAIN_N), dtype, seed=100 + i)
        for model, fn, opt in ((eager, eager, opt_e), (compiled_model, step, opt_c)):
            opt.zero_grad()
            loss = fn(x)
            loss.backward()
            opt.step()
            if model is eager:
                eager_loss = loss.item()
        torch.testing.assert_close(loss.item(), eager_loss, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(eager.named_parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("N", OFFSET_N)
@pytest.mark.parametrize("w_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("fused", [False, True], ids=["rmsnorm", "fused"])
def test_weight_offset(N: int, w_dtype: str, fused: bool) -> None:
    """Gemma's x_hat * (1 + w) with w small (|w| < 2^-7, as Gemma's weights start at 0):
    adding 1 to a bf16 w before widening would round w away (bf16 spacing at 1 is 2^-7), a
    visible error at these tolerances. Forward and gradients against fp64; dw is of w alone."""
    M, dtype = 300, torch.bfloat16
    x = rand((M, N), dtype, seed=N).requires_grad_()
    g = torch.Generator(device="cuda").manual_seed(N + 1)
    w = ((torch.rand(N, generator=g, device="cuda") - 0.5) * 2**-6).to(TORCH_DTYPES[w_dtype])
    w.requires_grad_()
    dy = rand((M, N), dtype, seed=N + 2)
    poison_allocator(M * N, dtype)
    if fused:
        zero = torch.zeros_like(x)
        y = kbuild.fused_add_rmsnorm(x, zero, w, 1e-6, prenorm=False, offset=1.0)
    else:
        y = kbuild.rmsnorm(x, w, 1e-6, offset=1.0)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    ref_y, ref_dx, ref_dw, _ = rmsnorm_grads(x.detach(), w, dy, 1e-6, offset=1.0)
    torch.testing.assert_close(y, ref_y.to(dtype), **FWD_TOL[dtype])
    wrong = kbuild.rmsnorm(x.detach(), (w.detach().to(dtype) + 1).to(dtype), 1e-6)
    assert (wrong != ref_y.to(dtype)).double().mean() > 4 * (y != ref_y.to(dtype)).double().mean()
    floor = dx_terms(x, w + 1.0, dy, 1e-6)
    assert_close_rel(dx, ref_dx, GRAD_TOL[dtype], f"dx N={N} w={w_dtype}", floor)
    assert dw.dtype == w.dtype
    assert_close_rel(dw, ref_dw, GRAD_TOL[w.dtype] + GRAD_TOL[dtype], f"dw N={N} w={w_dtype}")


class _Stream(torch.nn.Module):
    """A pre-norm stack whose residual stream is fp32 while the sublayers run in bf16: each
    layer adds its input h to the stream, normalises it (weight fp32) and its sublayer (a
    bf16 linear) makes the next h. `impl`: "kbuild" (fused_add_rmsnorm with
    residual_in_fp32, the stream chained from call to call) or "torch" (the same math)."""

    def __init__(self, width: int, layers: int, impl: str):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.impl = impl
        self.norms = torch.nn.ParameterList(
            torch.nn.Parameter(1 + 0.1 * torch.randn(width, generator=g)) for _ in range(layers)
        )
        self.mats = torch.nn.ParameterList(
            torch.nn.Parameter((torch.randn(width, width, generator=g) / width**0.5).bfloat16())
            for _ in range(layers)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        stream = h
        for w, m in zip(self.norms, self.mats, strict=True):
            if self.impl == "kbuild":
                out, stream = kbuild.fused_add_rmsnorm(h, stream, w, 1e-6, residual_in_fp32=True)
            else:
                stream = stream.float() + h.float()
                out = (
                    torch.nn.functional.rms_norm(stream, (h.shape[-1],), eps=1e-6) * w
                ).bfloat16()
            h = out @ m
        return h.float().square().mean() + stream.square().mean()


@pytest.mark.parametrize("width", STREAM_N)
def test_fp32_residual_stream_trains(width: int) -> None:
    """4 layers, fp32 residual stream chained through fused_add_rmsnorm(residual_in_fp32=True)
    (its later calls take the fp32 stream as their residual, and return its gradient in
    fp32): 8 SGD steps track torch's same model within bf16 noise, and the stream is fp32."""
    x = rand((512, width), torch.bfloat16, seed=width)
    losses = {}
    for impl in ("kbuild", "torch"):
        model = _Stream(width, 4, impl).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses[impl] = []
        for _ in range(8):
            loss = model(x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[impl].append(loss.item())
            assert all(
                p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters()
            )
    torch.testing.assert_close(losses["kbuild"], losses["torch"], rtol=2e-2, atol=0)
    assert losses["kbuild"][-1] < losses["kbuild"][0]  # it trains


QK_SHAPE = (4, 300, 8)  # B, T, heads: 9600 rows of head_dim


def qk_case(N: int, pad: int) -> tuple[int, ...]:
    """(B, T, H, width) of a fused qkv projection whose q and k views a QK-norm reads;
    `pad` elements after each token's q, k and v (an odd one: a stride of no whole vectors)."""
    return (*QK_SHAPE, 3 * QK_SHAPE[2] * N + pad)


QK_CASES = [(N, 0) for N in QK_N] + [(QK_N[1], 1)]


@pytest.mark.parametrize("N, pad", QK_CASES)
def test_qk_norm_in_place(N: int, pad: int) -> None:
    """QK-norm on the (B, T, H, D) q and k views of a fused qkv projection (Qwen3, Gemma 3):
    forward, dx and dw against fp64, with no copy of the view on the way (no aten::clone or
    copy_ in the forward or the backward: the kernels read the rows at their stride)."""
    B, T, H, width = qk_case(N, pad)
    dtype = torch.bfloat16
    qkv = rand((B, T, width), dtype, seed=N + pad).requires_grad_()
    heads = qkv[..., : 3 * H * N].view(B, T, 3, H, N)
    w = _weight(N, "bf16", seed=N)
    dy = rand((B, T, H, N), dtype, seed=N + 1)
    for part in (0, 1):  # q, k
        x = heads[:, :, part]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y = kbuild.rmsnorm(x, w, 1e-6)
            dx, dw = torch.autograd.grad(y, [x, w], dy)
        copies = [e.name for e in prof.events() if e.name in ("aten::clone", "aten::copy_")]
        assert not copies, f"the strided view was copied: {copies}"
        ref_y, ref_dx, ref_dw, _ = rmsnorm_grads(x.detach().contiguous(), w, dy, 1e-6)
        torch.testing.assert_close(y, ref_y.to(dtype), **FWD_TOL[dtype])
        floor = dx_terms(x.detach().contiguous(), w, dy, 1e-6)
        assert_close_rel(dx, ref_dx, GRAD_TOL[dtype], f"dx N={N} pad={pad}", floor)
        assert_close_rel(dw, ref_dw, 2 * GRAD_TOL[dtype], f"dw N={N} pad={pad}")
