"""GPT-2's encoder and the bias gradient on the GPU: against fp64 references, bitwise
deterministic gradients, int32 and int64 ids, ids that repeat, are absent or out of range,
and the modules under torch.compile and CUDA graphs."""

from __future__ import annotations

import pytest
import torch

import kbuild
from kbuild.cases import BIAS_OC, ENCODER_C, ENCODER_DTYPES

from .gpu_utils import BWD_TOL, FWD_TOL, TORCH_DTYPES, capture, poison_allocator, rand

pytestmark = pytest.mark.gpu

INDEX = {"i32": torch.int32, "i64": torch.int64}
VOCAB = 50257


def _tokens(B: int, T: int, V: int, index: torch.dtype, seed: int) -> torch.Tensor:
    """Ids with a frequent one (a third of the positions: runs across many chunks of the
    sorted order), rare ones and, with V large, most ids absent."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    tokens = torch.randint(0, V, (B, T), generator=g, device="cuda")
    frequent = torch.rand(B, T, generator=g, device="cuda") < 0.33
    return torch.where(frequent, torch.full_like(tokens, 7), tokens).to(index)


def _encoder_ref(tokens, wte, wpe, dout):
    """fp64 forward and gradients (autograd of wte[tokens] + wpe[:T])."""
    wte64 = wte.detach().double().requires_grad_()
    wpe64 = wpe.detach().double().requires_grad_()
    out = wte64[tokens.long()] + wpe64[: tokens.shape[1]]
    dwte, dwpe = torch.autograd.grad(out, (wte64, wpe64), dout.double())
    return out, dwte, dwpe


@pytest.mark.parametrize("index", ["i32", "i64"])
@pytest.mark.parametrize("dtype", ENCODER_DTYPES)
@pytest.mark.parametrize("C", ENCODER_C)
def test_encoder_forward_backward(C: int, dtype: str, index: str) -> None:
    tdtype = TORCH_DTYPES[dtype]
    B, T, positions = 16, 1024, 1024  # B * T = 16k positions
    tokens = _tokens(B, T, VOCAB, INDEX[index], seed=C)
    wte = rand((VOCAB, C), tdtype, seed=C + 1).requires_grad_()
    wpe = rand((positions, C), tdtype, seed=C + 2).requires_grad_()
    dout = rand((B, T, C), tdtype, seed=C + 3)
    poison_allocator(B * T * C, tdtype)
    out = kbuild.encoder(tokens, wte, wpe)
    dwte, dwpe = torch.autograd.grad(out, (wte, wpe), dout)
    ref, ref_dwte, ref_dwpe = _encoder_ref(tokens, wte, wpe, dout)
    what = f"C={C} {dtype} {index}"
    torch.testing.assert_close(out, ref.to(tdtype), **FWD_TOL[tdtype], msg=what)
    # Sums of up to ~5k rows (id 7): a tolerance scaled by the sum's size.
    scale = ref_dwte.abs().amax(1, keepdim=True).clamp_min(1.0)
    torch.testing.assert_close(dwte.double() / scale, ref_dwte / scale, **BWD_TOL[tdtype],
                               msg="dwte " + what)  # fmt: skip
    torch.testing.assert_close(dwpe, ref_dwpe.to(tdtype), **BWD_TOL[tdtype], msg="dwpe " + what)
    absent = torch.ones(VOCAB, dtype=torch.bool, device="cuda")
    absent[tokens.reshape(-1).long()] = False
    assert absent.any() and (dwte[absent] == 0).all(), "rows of absent ids must be zero"
    # Bitwise the same gradients on a second run (another allocation pattern, same bits).
    poison_allocator(VOCAB * C, tdtype)
    again = torch.autograd.grad(kbuild.encoder(tokens, wte, wpe), (wte, wpe), dout)
    assert torch.equal(again[0], dwte) and torch.equal(again[1], dwpe), what


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (64, 1024)])  # B * T up to 64k
def test_encoder_shapes_and_small_vocab(shape) -> None:
    """Few ids (V = 50, every chunk of the sorted order one or two long runs), B * T from 1
    to 64k: the chunk-crossing runs and their merge."""
    B, T = shape
    V, C = 50, 768
    tokens = _tokens(B, T, V, torch.int64, seed=B)
    wte = rand((V, C), torch.float32, seed=1).requires_grad_()
    wpe = rand((1024, C), torch.float32, seed=2).requires_grad_()
    dout = rand((B, T, C), torch.float32, seed=3)
    dwte, dwpe = torch.autograd.grad(kbuild.encoder(tokens, wte, wpe), (wte, wpe), dout)
    _, ref_dwte, ref_dwpe = _encoder_ref(tokens, wte, wpe, dout)
    torch.testing.assert_close(dwte, ref_dwte.float(), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(dwpe, ref_dwpe.float(), rtol=1e-5, atol=1e-4)


def test_encoder_bad_ids_and_accumulation() -> None:
    """An id outside [0, V): its row is NaN, the others are right, its gradient goes nowhere;
    check_ids raises. encoder_backward adds to existing gradients."""
    V, C = 100, 768
    tokens = _tokens(2, 64, V, torch.int64, seed=5)
    tokens[0, 3], tokens[1, 9] = V, -1
    wte, wpe = rand((V, C), torch.bfloat16, 6), rand((64, C), torch.bfloat16, 7)
    out = kbuild.encoder(tokens, wte, wpe)
    assert out[0, 3].isnan().all() and out[1, 9].isnan().all()
    good = torch.ones(2, 64, dtype=torch.bool, device="cuda")
    good[0, 3] = good[1, 9] = False
    ref = (wte.float()[tokens.clamp(0, V - 1)] + wpe.float()).to(torch.bfloat16)
    torch.testing.assert_close(out[good], ref[good], **FWD_TOL[torch.bfloat16])
    with pytest.raises(ValueError, match=r"tokens must be ids in \[0, 100\)"):
        kbuild.encoder(tokens, wte, wpe, check_ids=True)
    dout = rand((2, 64, C), torch.float32, 8)
    wte32, wpe32 = wte.float(), wpe.float()
    dwte, dwpe = torch.ones_like(wte32), torch.ones_like(wpe32)
    kbuild.encoder_backward(dout, tokens, dwte, dwpe)
    masked = dout * good[..., None]  # a bad id's row adds nothing to dwte (to dwpe it does)
    _, ref_dwte, _ = _encoder_ref(tokens.clamp(0, V - 1), wte32, wpe32, masked)
    _, _, ref_dwpe = _encoder_ref(tokens.clamp(0, V - 1), wte32, wpe32, dout)
    torch.testing.assert_close(dwte, 1 + ref_dwte.float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(dwpe, 1 + ref_dwpe.float(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ENCODER_DTYPES)
@pytest.mark.parametrize("OC", BIAS_OC)
def test_bias_grad(OC: int, dtype: str) -> None:
    tdtype = TORCH_DTYPES[dtype]
    for M in (1, 3, 100, 65536 + 17):
        dout = rand((M, OC), tdtype, seed=M + OC, scale=3.0)
        db = kbuild.bias_grad(dout)
        ref = dout.double().sum(0)
        scale = max(1.0, M**0.5)  # fp32 sums of M values of ~3: error grows like sqrt(M)
        torch.testing.assert_close(db / scale, (ref / scale).to(tdtype), **BWD_TOL[tdtype])
        assert db.dtype == tdtype and db.shape == (OC,)
        assert torch.equal(kbuild.bias_grad(dout), db), f"M={M}: not bitwise repeatable"
    assert (kbuild.bias_grad(rand((0, OC), tdtype, 1)) == 0).all()


def test_linear_and_modules_under_compile_and_graphs() -> None:
    """kbuild.nn.Linear and GPT2Embedding: torch's gradients, fullgraph torch.compile of both
    modules, and a CUDA-graph capture of forward + backward whose replays agree bitwise."""
    torch.manual_seed(0)
    C, OC = 768, 3072
    lin = kbuild.nn.Linear(C, OC, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.Linear(C, OC, device="cuda", dtype=torch.bfloat16)
    ref.load_state_dict(lin.state_dict())
    emb = kbuild.nn.GPT2Embedding(VOCAB, 1024, C, device="cuda", dtype=torch.bfloat16)
    tokens = _tokens(4, 256, VOCAB, torch.int64, seed=11)
    params = [lin.weight, lin.bias, emb.wte.weight, emb.wpe.weight]
    ref_params = [ref.weight, ref.bias, emb.wte.weight, emb.wpe.weight]

    def step(layer, embed, wrt):
        loss = layer(embed(tokens)).float().square().mean()
        return torch.autograd.grad(loss, wrt)

    def torch_embed(t):
        return emb.wte(t) + emb.wpe.weight[: t.shape[1]]

    got, want = step(lin, emb, params), step(ref, torch_embed, ref_params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=3e-2, atol=3e-3)
    compiled = step(torch.compile(lin, fullgraph=True), torch.compile(emb, fullgraph=True), params)
    for g, w in zip(compiled, got, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=3e-2, atol=3e-3)
    graph, captured = capture(lambda: step(lin, emb, params))
    graph.replay()
    first = [g.clone() for g in captured]
    graph.replay()
    for a, b, eager in zip(captured, first, got, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.float(), eager.float(), rtol=3e-2, atol=3e-3)
