"""kbuild.nn.patching.patch on the GPU: Hugging Face models in bf16 on CUDA, every check passing
with kbuild's kernels, the patched model training as stock does (eager and torch.compile), and
the fused loss holding less memory than stock's logits.

Small configs with random weights (no download). What this catches: a check that refuses on
the GPU what it takes on CPU (kernels rounding differently from the torch reference), outputs
or gradients that drift from stock, a patched forward that breaks torch.compile's graph, and a
loss path that still builds the logits.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kbuild.cases import (
    PATCH_CAP,
    PATCH_HEAD_DIM,
    PATCH_INTER,
    PATCH_KINDS,
    PATCH_MEMORY_VOCAB,
    PATCH_VOCAB,
    PATCH_WIDTH,
)
from kbuild.nn.patching import patch

from .test_patch_cpu import hf_model

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

# the models' shapes: kbuild.cli.manifest's, which `kbuild warmup --manifest tests` warms
VOCAB = PATCH_VOCAB


def _model(kind: str, vocab: int = VOCAB):
    model = hf_model(transformers, kind, width=PATCH_WIDTH, inter=PATCH_INTER,
                     head_dim=PATCH_HEAD_DIM, vocab=vocab, cap=PATCH_CAP)  # fmt: skip
    model.config.use_cache = False
    return model.to(device="cuda", dtype=torch.bfloat16)


def _ids(seed=0, batch=2, seq=64, vocab=VOCAB):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), device="cuda", generator=g)


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("kind", PATCH_KINDS)
def test_patched_bf16_same_model(kind):
    stock = _model(kind)
    model = copy.deepcopy(stock)
    report = patch(model)
    assert report.kept == [], str(report)
    kinds = {s.kind for s in report.swaps}
    assert kinds == ({"norm", "mlp", "loss"} | ({"rope"} if kind != "gpt2" else set()))
    ids = _ids()
    assert _rel(model(input_ids=ids).logits, stock(input_ids=ids).logits) < 2e-2
    ours, ref = model(input_ids=ids, labels=ids), stock(input_ids=ids, labels=ids)
    assert ours.logits is None
    # kbuild's loss is rounded to bf16 once; stock's is fp32 from bf16 logits
    assert abs(ours.loss.item() - ref.loss.item()) < 1e-2 * ref.loss.item()
    ours.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(model.named_parameters(), stock.parameters(), strict=True):
        if q.grad is not None:
            assert _rel(p.grad, q.grad) < 5e-2, name


def _train(model, steps, compiled=False):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    forward = torch.compile(model) if compiled else model
    losses = []
    for _ in range(steps):
        loss = forward(input_ids=_ids(), labels=_ids()).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_trains_as_stock_eager_and_compiled(kind):
    """The patched model's losses follow stock's step by step, eagerly and under
    torch.compile, and it compiles with no more graph breaks than stock."""
    stock = _model(kind)
    model = copy.deepcopy(stock)
    patch(model)
    ids = _ids()
    breaks = []
    for m in (stock, model):
        torch._dynamo.reset()
        breaks.append(torch._dynamo.explain(m)(input_ids=ids, labels=ids).graph_break_count)
    torch._dynamo.reset()
    assert breaks[1] <= breaks[0], breaks
    reference = _train(copy.deepcopy(stock), 5)
    eager = _train(copy.deepcopy(model), 5)
    compiled = _train(copy.deepcopy(model), 5, compiled=True)
    torch._dynamo.reset()
    assert reference[-1] < reference[0]
    for a, b, c in zip(reference, eager, compiled, strict=True):
        assert abs(a - b) < 0.02 * a and abs(a - c) < 0.02 * a, (reference, eager, compiled)


def test_fused_loss_holds_less_memory():
    """With a 32k vocabulary, the patched forward and backward peak below stock's by at least
    the logits' size (B T V in bf16 plus stock's fp32 upcast)."""
    vocab = PATCH_MEMORY_VOCAB
    stock = _model("llama", vocab)
    model = copy.deepcopy(stock)
    patch(model)
    ids = _ids(batch=4, seq=256, vocab=vocab)
    peaks = []
    for m in (stock, model):
        m(input_ids=ids, labels=ids).loss.backward()  # warm: kernels, allocator
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        m(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        m.zero_grad(set_to_none=True)
    logits_bytes = ids.numel() * vocab * 2
    assert peaks[1] < peaks[0] - logits_bytes, (peaks, logits_bytes)
