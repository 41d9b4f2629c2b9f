"""GPT-2's encoder, kbuild.linear and the bias gradient without a GPU: the references
against torch, the argument errors, the custom ops' fakes and compile route, and the CUDA
launch path (specs, grids, argument order) through a fake kernel tier, against the manifest
the GPU tests warm."""

from __future__ import annotations

import pytest
import torch

import kbuild
from kbuild.cases import BIAS_OC, ENCODER_C, ENCODER_DTYPES
from kbuild.cli.manifest import manifest
from kbuild.kernels.llmc.launch import MIN_CHUNK_ROWS, bias_chunks
from kbuild.registry import INDEX_DTYPES

from .launch_recorder import TORCH, Tier, encoder, install

F = torch.nn.functional


def _case(B=3, T=5, V=11, C=8, P=7, dtype=torch.float32, index=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, T), generator=g).to(index)
    wte = torch.randn(V, C, generator=g).to(dtype).requires_grad_()
    wpe = torch.randn(P, C, generator=g).to(dtype).requires_grad_()
    return tokens, wte, wpe


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_encoder_matches_torch_forward_and_gradients(index):
    """Repeated ids (V = 4 over 40 positions) sum into one dwte row; absent ones stay zero."""
    tokens, wte, wpe = _case(B=4, T=10, V=6, P=12, index=index)
    tokens = tokens.clamp(max=3)  # ids 4 and 5 absent
    out = kbuild.encoder(tokens, wte, wpe)
    ref = F.embedding(tokens.long(), wte) + wpe[:10]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    dout = torch.randn_like(out)
    dwte, dwpe = torch.autograd.grad(out, (wte, wpe), dout)
    ref_dwte, ref_dwpe = torch.autograd.grad(ref, (wte, wpe), dout)
    torch.testing.assert_close(dwte, ref_dwte)
    torch.testing.assert_close(dwpe, ref_dwpe)
    assert (dwte[4:] == 0).all() and (dwpe[10:] == 0).all() and (dwte[:4] != 0).all()


def test_encoder_rounds_the_exact_sum_once():
    """bf16 wte + wpe: the exact sum, rounded once to bf16 (fp32 holds the sum of two bf16
    values exactly unless their exponents are 16 apart). A kernel that rounded wte's row to
    some other dtype first, or added in fp16, fails on these magnitudes."""
    g = torch.Generator().manual_seed(3)
    wte = (torch.randn(5, 64, generator=g) * 300).bfloat16()
    wpe = (torch.randn(9, 64, generator=g) * 2).bfloat16()
    tokens = torch.randint(0, 5, (2, 9), generator=g)
    out = kbuild.encoder(tokens, wte, wpe)
    exact = wte.double()[tokens] + wpe.double()
    torch.testing.assert_close(out, exact.bfloat16(), rtol=0, atol=0)
    assert not torch.equal(out, wte[tokens])  # wpe (about an ulp of wte) changes some


def test_dwte_accumulates_many_rows_in_fp32():
    """5000 bf16 gradients of 2^-8 into one id: a bf16 running sum stops growing at 2 (its
    ulp there exceeds 2^-8); fp32 sums give 5000 * 2^-8 = 19.53 (bf16: 19.5)."""
    V, C = 3, 8
    tokens = torch.ones(1, 5000, dtype=torch.int64)
    wte = torch.zeros(V, C, dtype=torch.bfloat16, requires_grad=True)
    wpe = torch.zeros(5000, C, dtype=torch.bfloat16, requires_grad=True)
    out = kbuild.encoder(tokens, wte, wpe)
    (dwte,) = torch.autograd.grad(out, wte, torch.full_like(out, 2**-8))
    assert dwte[1, 0].item() == 19.5 and (dwte[0] == 0).all()


def test_encoder_backward_adds_in_place():
    tokens, wte, wpe = _case()
    dout = torch.randn(3, 5, 8)
    dwte, dwpe = torch.ones_like(wte.detach()), torch.ones_like(wpe.detach())
    kbuild.encoder_backward(dout, tokens, dwte, dwpe)
    ref_dwte, ref_dwpe = torch.autograd.grad(F.embedding(tokens, wte) + wpe[:5], (wte, wpe), dout)
    torch.testing.assert_close(dwte, 1 + ref_dwte)
    torch.testing.assert_close(dwpe, 1 + ref_dwpe)


def test_linear_and_bias_grad_match_torch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, 8, generator=g, requires_grad=True)
    w = torch.randn(5, 8, generator=g, requires_grad=True)
    b = torch.randn(5, generator=g, requires_grad=True)
    y = kbuild.linear(x, w, b)
    dy = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad(y, (x, w, b), dy)
    want = torch.autograd.grad(F.linear(x, w, b), (x, w, b), dy)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e)
    torch.testing.assert_close(kbuild.bias_grad(dy), dy.sum((0, 1)))
    # bf16: fp32 sums rounded once. 300 x (1 + 2^-7) in bf16 steps loses the 2^-7s.
    d = torch.full((300, 4), 1 + 2**-7, dtype=torch.bfloat16)
    assert kbuild.bias_grad(d)[0].item() == torch.tensor(300 * (1 + 2**-7)).bfloat16().item()


def test_linear_under_autocast_keeps_fp32_master_weights():
    """bf16 autocast over fp32 x, weight and bias: the gradients come back in fp32 (the
    parameters' dtype) and equal torch's own linear under the same autocast."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 16, generator=g, requires_grad=True)
    w = torch.randn(8, 16, generator=g, requires_grad=True)
    b = torch.randn(8, generator=g, requires_grad=True)
    grads = []
    for fn in (kbuild.linear, F.linear):
        with torch.autocast("cpu", torch.bfloat16):
            y = fn(x, w, b)
        assert y.dtype == torch.bfloat16
        grads.append(torch.autograd.grad(y.float().square().sum(), (x, w, b)))
    for ours, theirs in zip(*grads, strict=True):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)


def test_nn_modules():
    torch.manual_seed(0)
    lin = kbuild.nn.Linear(8, 5)
    assert isinstance(lin, torch.nn.Linear) and set(lin.state_dict()) == {"weight", "bias"}
    emb = kbuild.nn.GPT2Embedding(11, 7, 8)
    assert set(emb.state_dict()) == {"wte.weight", "wpe.weight"}
    assert "num_embeddings=11, max_positions=7, embedding_dim=8" in repr(emb)
    tokens = torch.randint(0, 11, (2, 7))
    torch.testing.assert_close(emb(tokens), emb.wte(tokens) + emb.wpe.weight)


# ----------------------------------------------------------------------------- errors


@pytest.mark.not_interpreted
@pytest.mark.parametrize(
    "args, error, message",
    [
        (lambda t, e, p: (t.float(), e, p), TypeError, "tokens must be torch.int32 or torch.int64"),
        (lambda t, e, p: (t[0], e, p), ValueError, r"tokens must be \(B, T\)"),
        (lambda t, e, p: (t, e[0], p), ValueError, r"wte must be 2-D \(vocab_size, C\)"),
        (lambda t, e, p: (t, e, p.double()), TypeError, "wpe must be torch.float32"),
        (lambda t, e, p: (t, e, p.half()), TypeError, "wpe must have wte's dtype"),
        (lambda t, e, p: (t, e, p[:, :4]), ValueError, "wpe must have wte's embedding dim C = 8"),
        (lambda t, e, p: (t, e, p[:4]), ValueError, "sequence length T = 5 exceeds wpe's 4"),
        (lambda t, e, p: (t + 11, e, p), ValueError, r"tokens must be ids in \[0, 11\)"),
        (lambda t, e, p: (t - 11, e, p), ValueError, r"ids in \[0, 11\) \(wte's rows\); got -"),
        (lambda t, e, p: (t, e.to("meta"), p), ValueError, "wte must be on tokens' device"),
    ],
)
def test_encoder_errors(args, error, message):
    tokens, wte, wpe = _case()
    with pytest.raises(error, match=message):
        kbuild.encoder(*args(tokens, wte.detach(), wpe.detach()))


def test_encoder_backward_and_linear_errors():
    tokens, wte, wpe = _case()
    dout = torch.randn(3, 5, 8)
    with pytest.raises(ValueError, match=r"dout must be \(B, T, C\) = \(3, 5, C\)"):
        kbuild.encoder_backward(dout[:2], tokens, torch.zeros(11, 8))
    with pytest.raises(ValueError, match=r"dwte must be a contiguous \(rows, 8\) tensor"):
        kbuild.encoder_backward(dout, tokens, torch.zeros(11, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dwpe has 4 rows, fewer than T = 5"):
        kbuild.encoder_backward(dout, tokens, None, torch.zeros(4, 8))
    with pytest.raises(ValueError, match="dwte must be contiguous"):
        kbuild.encoder_backward(dout, tokens, torch.zeros(8, 11).t())
    x, w = torch.randn(2, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match=r"weight must be \(out_features, 8\)"):
        kbuild.linear(x, w.t())
    with pytest.raises(ValueError, match=r"bias must be \(5,\)"):
        kbuild.linear(x, w, torch.zeros(4))
    with pytest.raises(TypeError, match="bias must have x's dtype"):
        kbuild.linear(x, w, torch.zeros(5, dtype=torch.float16))
    with pytest.raises(TypeError, match="dout must be torch.float32"):
        kbuild.bias_grad(torch.zeros(3, 4, dtype=torch.int32))


# ----------------------------------------------------------------------------- ops, compile


def test_fakes_match_the_ops():
    tokens, wte, wpe = _case()
    dout = torch.randn(3, 5, 8)
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = [
        torch.ops.kbuild.encoder_fwd(tokens, wte, wpe),
        *torch.ops.kbuild.encoder_bwd(dout, tokens, 11, 7, True, True),
        *torch.ops.kbuild.encoder_bwd(dout, tokens, 11, 7, False, False),
        torch.ops.kbuild.bias_grad(dout),
    ]
    with FakeTensorMode() as mode:
        ft, fe, fp, fd = (mode.from_tensor(t) for t in (tokens, wte, wpe, dout))
        fake = [
            torch.ops.kbuild.encoder_fwd(ft, fe, fp),
            *torch.ops.kbuild.encoder_bwd(fd, ft, 11, 7, True, True),
            *torch.ops.kbuild.encoder_bwd(fd, ft, 11, 7, False, False),
            torch.ops.kbuild.bias_grad(fd),
        ]
    for r, f in zip(real, fake, strict=True):
        assert (r.shape, r.dtype) == (f.shape, f.dtype)
    for op in ("encoder_fwd", "encoder_bwd", "bias_grad"):
        torch.library.opcheck(
            getattr(torch.ops.kbuild, op),
            {"encoder_fwd": (tokens, wte, wpe), "encoder_bwd": (dout, tokens, 11, 7, True, True),
             "bias_grad": (dout,)}[op],
        )  # fmt: skip


def test_modules_compile_fullgraph_to_the_ops():
    """torch.compile(fullgraph=True) of the GPT-2 layers traces kbuild's ops (no breaks) and
    computes the eager gradients."""
    torch.manual_seed(0)
    emb, lin = kbuild.nn.GPT2Embedding(11, 7, 8), kbuild.nn.Linear(8, 5)
    tokens = torch.randint(0, 11, (3, 5))
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm

    from torch._dynamo.backends.common import aot_autograd

    model = torch.compile(lambda t: lin(emb(t)), backend=aot_autograd(fw_compiler=backend),
                          fullgraph=True)  # fmt: skip
    params = [emb.wte.weight, emb.wpe.weight, lin.weight, lin.bias]
    got = torch.autograd.grad(model(tokens).square().sum(), params)
    want = torch.autograd.grad(lin(emb(tokens)).square().sum(), params)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e)
    assert "kbuild.encoder_fwd.default" in seen and "kbuild.encoder_bwd.default" in seen
    assert "kbuild.bias_grad.default" in seen


# ----------------------------------------------------------------------------- launch path


def test_bias_chunks_cover_the_rows_in_fixed_chunks():
    for M in (1, 63, 64, 1000, 65553, 1 << 20):
        for column_blocks in (1, 3, 200):
            chunks, per = bias_chunks(M, column_blocks, 132)
            assert (chunks - 1) * per < M <= chunks * per, (M, column_blocks)
            assert per >= min(M, MIN_CHUNK_ROWS)
            assert chunks <= max(1, -(-4 * 132 // column_blocks))  # ~4 blocks per unit
            assert bias_chunks(M, column_blocks, 132) == (chunks, per)  # a function of the shape


class _Recording(Tier):
    def __init__(self):
        super().__init__()
        self.launches = []

    def get_launcher(self, key, device, make_spec):
        spec = make_spec()
        self.requests.append((key, device, spec))
        tier = self

        class Launcher:
            meta = {"columns_per_block": 256}

            def __call__(self, grid, stream, *args):
                tier.launches.append((spec.kernel, grid, args))

        return Launcher()


def _recorded(monkeypatch):
    tier = _Recording()
    install(monkeypatch, tier.get_launcher)
    monkeypatch.setattr(encoder, "multiprocessors", lambda device: 132)
    return tier


def test_the_launch_path_imports_no_mlir():
    """A GPU machine has no MLIR: its ops must import without it."""
    import subprocess
    import sys

    code = (
        "import builtins; real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name.split('.')[0] == 'mlir': raise ModuleNotFoundError(name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "import kbuild.kernels.llmc.op, kbuild.nn, kbuild.kernels.llmc.launch\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_launches_follow_the_table(monkeypatch):
    tier = _recorded(monkeypatch)
    B, T, V, C = 2, 100, 11, 768
    tokens = torch.randint(0, V, (B, T), dtype=torch.int32)
    wte, wpe = torch.zeros(V, C, dtype=torch.bfloat16), torch.zeros(128, C, dtype=torch.bfloat16)
    out = encoder.encoder_fwd(tokens, wte, wpe)
    name, grid, args = tier.launches[-1]
    assert (name, grid) == ("encoder_fwd", B * T)
    assert args == (tokens.data_ptr(), wte.data_ptr(), wpe.data_ptr(), out.data_ptr(), V, T, B * T)
    dout = torch.zeros(B * T, C, dtype=torch.bfloat16)
    dwte, dwpe = torch.zeros_like(wte), torch.zeros_like(wpe)
    encoder.encoder_bwd(dout, tokens, dwte, dwpe, add_to_dwpe=False)
    (wpe_k, g1, a1), (wte_k, g2, a2), (merge_k, g3, a3) = tier.launches[-3:]
    chunks = -(-B * T // encoder.CHUNK)
    assert (wpe_k, g1, a1) == ("encoder_bwd_wpe", T, (dout.data_ptr(), dwpe.data_ptr(), B, T))
    assert (wte_k, g2, merge_k, g3) == ("encoder_bwd_wte", chunks, "encoder_bwd_wte_merge", chunks)
    assert a2[2:4] == (dout.data_ptr(), dwte.data_ptr()) and a2[5:] == (V, B * T)
    assert a3[0] == a2[0] and a3[1] == a2[4] and a3[2:] == (dwte.data_ptr(), V, B * T)
    specs = tier.specs[-3:]
    assert [s["accumulate"] for s in specs if s.kernel == "encoder_bwd_wpe"] == [False]
    assert all(s["index_dtype"] == "i32" for s in specs if "wte" in s.kernel)
    d = torch.zeros(4096, 2304, dtype=torch.bfloat16)
    db = encoder.bias_grad(d)
    (bias_k, gb, ab), (sum_k, gs, as_) = tier.launches[-2:]
    chunks, per = bias_chunks(4096, 9, 132)
    assert (bias_k, gb) == ("bias_grad", chunks * 9) and ab[2:] == (4096, per)
    assert sum_k == "column_sum" and as_[1:] == (db.data_ptr(), chunks) and as_[0] == ab[1]


def test_the_gpu_tests_launch_only_warmed_kernels(monkeypatch):
    """Every spec the GPU tests' shapes ask for (test_llmc_gpu.py) is in manifest("tests")."""
    tier = _recorded(monkeypatch)
    for dtype in ENCODER_DTYPES:
        t = TORCH[dtype]
        for C in ENCODER_C:
            for index in INDEX_DTYPES:
                tokens = torch.zeros(
                    2, 64, dtype=getattr(torch, {"i32": "int32", "i64": "int64"}[index])
                )
                wte, wpe = torch.zeros(50, C, dtype=t), torch.zeros(64, C, dtype=t)
                encoder.encoder_fwd(tokens, wte, wpe)
                dout = torch.zeros(128, C, dtype=t)
                for add in (False, True):
                    encoder.encoder_bwd(dout, tokens, torch.zeros_like(wte), wpe.clone(), add)
        for OC in BIAS_OC:
            encoder.bias_grad(torch.zeros(3, OC, dtype=t))
    warmed = set(manifest("tests"))
    missing = [s.short() for s in tier.specs if s not in warmed]
    assert not missing, missing
