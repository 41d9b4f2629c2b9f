"""kbuild in Hugging Face models on the GPU: swap_norms on Llama, GPT-2 and Gemma configs,
training under torch.compile(mode="reduce-overhead") (CUDA graphs), and graph breaks.

Small configs with random weights (no download), width 768 bf16, whose norm kernels the
`tests` manifest warms. What this catches: swap_norms deciding by name (Gemma's (1 + w)
swapped as plain RMSNorm instead of with offset=1.0, or Llama's norm left alone), a
swapped model whose outputs or gradients drift from stock, a kbuild op that breaks a graph
stock does not, and a launch path that CUDA graph trees (reduce-overhead) cannot capture or
replays stale.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kbuild.nn

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

WIDTH = 768


def _model(kind: str):
    common = dict(vocab_size=512, max_position_embeddings=128)
    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=WIDTH, intermediate_size=1024, num_hidden_layers=2,
            num_attention_heads=12, num_key_value_heads=12, rms_norm_eps=1e-6, **common,
        )  # fmt: skip
    elif kind == "gpt2":
        config = transformers.GPT2Config(
            n_embd=WIDTH,
            n_layer=2,
            n_head=12,
            n_positions=128,
            vocab_size=512,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )  # fmt: skip  (no dropout: comparable)
    else:
        config = transformers.GemmaConfig(
            hidden_size=WIDTH, intermediate_size=1024, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, head_dim=192, rms_norm_eps=1e-6,
            **common,
        )  # fmt: skip
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():  # norm weights away from their init (1 or 0), so the math shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model.to(device="cuda", dtype=torch.bfloat16)


def _ids(seed=0, batch=2, seq=64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 512, (batch, seq), device="cuda", generator=g)


def _norms(model) -> list[str]:
    return [n for n, m in model.named_modules() if "Norm" in type(m).__name__]


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma"])
def test_swap_norms_swaps_every_norm_and_keeps_the_model(kind):
    stock = _model(kind)
    swapped = copy.deepcopy(stock)
    names = kbuild.nn.swap_norms(swapped)
    assert names == _norms(stock) and len(names) == 5
    kinds = {type(swapped.get_submodule(n)) for n in names}
    assert kinds <= {kbuild.nn.RMSNorm, kbuild.nn.LayerNorm}
    # Gemma scales by (1 + weight): its norms become RMSNorm(offset=1.0), the others 0.
    offsets = {getattr(swapped.get_submodule(n), "offset", 0.0) for n in names}
    assert offsets == {1.0 if kind == "gemma" else 0.0}
    ids = _ids()
    out_stock = stock(input_ids=ids, labels=ids)
    out_ours = swapped(input_ids=ids, labels=ids)
    # bf16 activations through 2 layers: logits agree to bf16 noise, the loss closely.
    torch.testing.assert_close(out_ours.logits, out_stock.logits, rtol=0.05, atol=0.05)
    assert abs(out_ours.loss.item() - out_stock.loss.item()) < 1e-2
    out_stock.loss.backward()
    out_ours.loss.backward()
    pairs = zip(stock.named_parameters(), swapped.named_parameters(), strict=True)
    for (name, p), (_, q) in pairs:
        if p.grad is not None:
            g, h = p.grad.float(), q.grad.float()
            err = (g - h).norm() / g.norm().clamp_min(1e-12)
            assert err < 0.05, (name, err.item())


def _train(model, steps, compile_mode=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    forward = torch.compile(model, mode=compile_mode) if compile_mode else model
    losses = []
    for _ in range(steps):
        if compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        ids = _ids()  # one batch, so the loss falls step by step
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_reduce_overhead_training_with_kbuild_norms():
    """torch.compile(mode="reduce-overhead") trains the swapped Llama: CUDA graph trees
    capture the kbuild ops forward and backward, and the losses follow eager training."""
    model = _model("llama")
    assert kbuild.nn.swap_norms(model)
    eager = _train(copy.deepcopy(model), 6)
    torch._dynamo.reset()
    compiled = _train(copy.deepcopy(model), 6, "reduce-overhead")
    torch._dynamo.reset()
    assert compiled[-1] < compiled[0]  # it trains
    for a, b in zip(eager, compiled, strict=True):
        assert abs(a - b) < 0.05 * abs(a), (eager, compiled)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_graph_breaks_as_stock(kind):
    stock = _model(kind)
    swapped = copy.deepcopy(stock)
    kbuild.nn.swap_norms(swapped)
    ids = _ids()
    counts = []
    for model in (stock, swapped):
        torch._dynamo.reset()
        counts.append(torch._dynamo.explain(model)(input_ids=ids, labels=ids).graph_break_count)
    torch._dynamo.reset()
    assert counts[1] == counts[0], counts
