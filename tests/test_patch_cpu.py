"""CPU tests of kbuild.nn.patching.patch: which modules it patches (each decided by a numerical
check, never by name), that the patched model computes what stock does (outputs, losses,
gradients), that the patch is per instance (another model of the class keeps stock code), what
it leaves stock and why, and unpatch.

The first part runs without transformers, on stand-ins copying the Hugging Face modules' math
(LlamaMLP, Phi3MLP, GPT2MLP, an attention calling its module's apply_rotary_pos_emb). The
second builds tiny random models of each family from their configs (importorskip).
"""

from __future__ import annotations

import copy
import importlib
import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kbuild.nn
from kbuild.nn.patching import PatchReport, causal_lm_loss, patch

from .reference import assert_close_rel

# the modules, by full name: kbuild exports functions of these names
activations = importlib.import_module("kbuild.kernels.activations.op")
rope_ops = importlib.import_module("kbuild.kernels.rope.op")
linear_loss = importlib.import_module("kbuild.kernels.loss.linear")

D, INTER, HEADS, KV, HEAD_DIM = 64, 96, 4, 2, 16


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- stand-ins


class SiLUActivation(nn.Module):
    def forward(self, x):
        return F.silu(x)


class GELUTanh(nn.Module):  # transformers' gelu_pytorch_tanh
    def forward(self, x):
        return F.gelu(x, approximate="tanh")


class NewGELUActivation(nn.Module):  # transformers' gelu_new (GPT-2)
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


class SteepSiLU(nn.Module):
    """x * sigmoid(1.1 x): close to silu, not it."""

    def forward(self, x):
        return x * torch.sigmoid(1.1 * x)


class LlamaMLP(nn.Module):
    """transformers' LlamaMLP (Mistral's, Qwen's, Gemma's with another act_fn)."""

    def __init__(self, act=None):
        super().__init__()
        self.gate_proj = nn.Linear(D, INTER, bias=False)
        self.up_proj = nn.Linear(D, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, D, bias=False)
        self.act_fn = act if act is not None else SiLUActivation()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SwappedMLP(LlamaMLP):
    """LlamaMLP's modules, gate and up exchanged in forward: only the module check sees it."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


class Phi3MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Linear(D, 2 * INTER, bias=False)
        self.down_proj = nn.Linear(INTER, D, bias=False)
        self.activation_fn = SiLUActivation()

    def forward(self, hidden_states):
        up_states = self.gate_up_proj(hidden_states)
        gate, up_states = up_states.chunk(2, dim=-1)
        return self.down_proj(up_states * self.activation_fn(gate))


class Conv1D(nn.Module):  # transformers' Conv1D: weight (in, out)
    def __init__(self, nf, nx):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return out.view(*x.shape[:-1], -1)


class GPT2MLP(nn.Module):
    def __init__(self, act=None):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(4 * D, D), Conv1D(D, 4 * D)
        self.act = act if act is not None else NewGELUActivation()
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states):
        return self.dropout(self.c_proj(self.act(self.c_fc(hidden_states))))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' Phi-3 form (partial rotary when cos is narrower than the head)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]
    q_rot, q_pass, k_rot, k_pass = q[..., :r], q[..., r:], k[..., :r], k[..., r:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


STOCK_ROPE = apply_rotary_pos_emb


class Attention(nn.Module):
    """The rotary part of a Hugging Face attention forward: q, k projected, rotated."""

    def __init__(self):
        super().__init__()
        self.head_dim = HEAD_DIM
        self.q_proj = nn.Linear(D, HEADS * HEAD_DIM)
        self.k_proj = nn.Linear(D, KV * HEAD_DIM)

    def forward(self, hidden_states, position_embeddings):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q.transpose(1, 2).flatten(2), k.transpose(1, 2).flatten(2)


class Rotary(nn.Module):
    """transformers' default rotary embedding, `rotary` of head_dim's values rotated."""

    def __init__(self, rotary=HEAD_DIM):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, rotary, 2, dtype=torch.float) / rotary))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Layer(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.self_attn, self.mlp = Attention(), mlp

    def forward(self, x, pos):
        q, k = self.self_attn(x, pos)
        return x + self.mlp(x + 0.1 * (q[..., :D] + k.repeat(1, 1, 2)[..., :D]))


class Tiny(nn.Module):
    def __init__(self, mlps=None, rotary=HEAD_DIM):
        super().__init__()
        mlps = mlps if mlps is not None else [LlamaMLP(), LlamaMLP()]
        self.rotary_emb = Rotary(rotary)
        self.layers = nn.ModuleList(Layer(m) for m in mlps)

    def forward(self, x):
        pos = self.rotary_emb(x, torch.arange(x.shape[1])[None] + 3)
        for layer in self.layers:
            x = layer(x, pos)
        return x


def _x(seed=1, T=5):
    return torch.randn(2, T, D, generator=_gen(seed))


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def _same_outputs_and_grads(model, stock, x, tol=1e-5):
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = model(x1), stock(x2)
    assert_close_rel(out, ref, tol, "output")
    dy = torch.randn(out.shape, generator=_gen(9))
    (out * dy).sum().backward()
    (ref * dy).sum().backward()
    assert_close_rel(x1.grad, x2.grad, tol, "dx")
    for (name, p), q in zip(model.named_parameters(), stock.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert_close_rel(p.grad, q.grad, tol, name)


# --------------------------------------------------------------------------- without transformers


@pytest.mark.parametrize(
    "make, what, op",
    [
        (lambda: LlamaMLP(), "swiglu", "swiglu"),
        (lambda: LlamaMLP(GELUTanh()), "geglu(tanh)", "geglu"),
        (lambda: Phi3MLP(), "swiglu", "swiglu"),
        (lambda: GPT2MLP(), "gelu(tanh)", "gelu"),
    ],
    ids=["llama", "gemma", "phi3", "gpt2"],
)
def test_mlp_forms_patched_same_math(monkeypatch, make, what, op):
    """Catches an MLP form not recognised, the wrong op for its activation (silu / tanh-GELU),
    Phi-3's fused halves taken in the wrong order, a projection's bias or a gradient lost, and
    a patch whose forward never calls the kbuild op."""
    calls = _counting(monkeypatch, activations, op)
    torch.manual_seed(0)
    model = nn.Sequential(make(), make())
    stock = copy.deepcopy(model)
    report = patch(model, norms=False, rope=False, loss=False)
    assert [(s.path, s.kind, s.what, s.level) for s in report.swaps] == [
        (p, "mlp", what, "instance") for p in ("0", "1")
    ]
    assert report.kept == []
    calls.clear()
    model.eval(), stock.eval()  # GPT-2's dropout
    _same_outputs_and_grads(model, stock, _x())
    assert len(calls) == 2
    if op == "gelu":
        assert isinstance(model[0].act, kbuild.nn.patching.TanhGELU)
    else:
        assert "forward" in vars(model[0]) and "forward" not in vars(stock[0])


def test_mlp_with_other_math_left_stock():
    """Catches a decision by structure or by name: an activation close to silu but not it,
    erf-GELU (1e-4 from tanh-GELU: the activation check runs in fp32 for this), GPT-2's MLP
    with erf-GELU, and gate and up exchanged in forward (only the module check sees that);
    each kept stock with a reason naming the cause. The stock LlamaMLP beside them is patched."""
    model = nn.ModuleDict(
        dict(
            steep=LlamaMLP(SteepSiLU()),
            erf=LlamaMLP(nn.GELU()),
            gpt2_erf=GPT2MLP(nn.GELU()),
            swapped=SwappedMLP(),
            llama=LlamaMLP(),
        )
    )
    report = patch(model, norms=False, rope=False, loss=False)
    assert report.paths() == ["llama"]
    reasons = {k.path: k.reason for k in report.kept}
    assert set(reasons) == {"steep", "erf", "gpt2_erf", "swapped"}
    assert "SteepSiLU is neither silu nor tanh-GELU" in reasons["steep"]
    assert "GELU is neither silu nor tanh-GELU" in reasons["erf"]
    assert "not tanh-GELU" in reasons["gpt2_erf"]
    assert "differs from stock" in reasons["swapped"]
    for name in ("steep", "erf", "swapped"):
        assert "forward" not in vars(model[name])
    assert type(model["gpt2_erf"].act) is nn.GELU


@pytest.mark.parametrize("rotary", [HEAD_DIM, HEAD_DIM // 2], ids=["full", "partial"])
def test_rope_patched_per_instance(monkeypatch, rotary):
    """Catches the rope swap made module-wide (the module's function replaced, or every
    instance of the class patched: `other` must keep calling the stock function), outputs or
    gradients that differ, Phi-3's partial rotation (cos narrower than the head) lost, and a
    patched forward that does not call kbuild's rope."""
    calls = _counting(monkeypatch, rope_ops, "rope")
    torch.manual_seed(0)
    model, other = Tiny(rotary=rotary), Tiny(rotary=rotary)
    stock = copy.deepcopy(model)
    report = patch(model, norms=False, mlp=False, loss=False)
    assert report.paths("rope") == ["layers.0.self_attn", "layers.1.self_attn"]
    assert all(s.level == "instance" for s in report.swaps)
    assert globals()["apply_rotary_pos_emb"] is STOCK_ROPE
    calls.clear()
    _same_outputs_and_grads(model, stock, _x())
    assert len(calls) == 2
    calls.clear()
    other(_x())
    assert calls == []
    assert "forward" not in vars(other.layers[0].self_attn)


def _interleaved_attention_class():
    """An Attention whose module's apply_rotary_pos_emb rotates interleaved pairs (GPT-J's)."""
    module = types.ModuleType("interleaved_modeling")
    module.__dict__.update(torch=torch, nn=nn, D=D, HEADS=HEADS, KV=KV, HEAD_DIM=HEAD_DIM)

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        cos, sin = cos[..., ::2].repeat_interleave(2, -1), sin[..., ::2].repeat_interleave(2, -1)

        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)

        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    forward = types.FunctionType(Attention.forward.__code__, module.__dict__, "forward")
    return type("InterleavedAttention", (Attention,), {"forward": forward})


def test_rope_with_other_math_left_stock():
    """Catches a rope swap decided by the function's name: an attention whose module's
    apply_rotary_pos_emb rotates interleaved pairs stays stock, with the reason; an attention
    that already has an instance-level forward (accelerate's hooks put one there) is refused
    rather than have its wrapper dropped."""
    model = Tiny()
    model.layers[0].self_attn = _interleaved_attention_class()()
    hooked = model.layers[1].self_attn
    hooked.forward = lambda *a, **k: Attention.forward(hooked, *a, **k)
    report = patch(model, norms=False, mlp=False, loss=False)
    assert report.paths("rope") == []
    reasons = {k.path: k.reason for k in report.kept if k.kind == "rope"}
    assert "differs from stock" in reasons["layers.0.self_attn"]
    assert "instance-level forward already" in reasons["layers.1.self_attn"]


def test_twice_then_unpatch_restores():
    """Catches a second patch wrapping kbuild's forwards again (it patches nothing and says
    so), and unpatch leaving a kbuild forward, norm or activation behind."""
    model = nn.Sequential(Tiny([LlamaMLP(), GPT2MLP()]), nn.LayerNorm(D))
    before = {n: type(m) for n, m in model.named_modules()}
    first = patch(model, loss=False)
    count = len(first.swaps)
    assert sorted({s.kind for s in first.swaps}) == ["mlp", "norm", "rope"]
    second = patch(model, loss=False)
    assert second.swaps == []
    assert {k.reason.split(" (")[0] for k in second.kept} == {
        "already patched by kbuild",
        "already kbuild's",
    }
    first.unpatch()
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert not any("forward" in vars(m) for m in model.modules())
    first.unpatch()  # idempotent
    assert len(patch(model, loss=False).swaps) == count


def test_meta_and_arguments():
    """Catches a check run on the meta device (nothing to compare: kept with the reason) and
    flags that are not bools accepted."""
    with torch.device("meta"):
        model = Tiny()
    report = patch(model, loss=False)
    assert report.swaps == [] and report.kept
    assert all("meta device" in k.reason for k in report.kept)
    with pytest.raises(TypeError, match="model must be"):
        patch("model")
    with pytest.raises(TypeError, match="rope must be a bool"):
        patch(Tiny(), rope="module")
    with pytest.raises(TypeError, match="loss must be a bool or \"low_memory\", got 'small'"):
        patch(Tiny(), loss="small")


def test_report_reads():
    """Catches a report that lists 2 x 32 lines instead of one per group, or loses the kept
    modules' reasons."""
    model = nn.Sequential(*[LlamaMLP() for _ in range(4)], LlamaMLP(SteepSiLU()))
    report = patch(model, norms=False, rope=False, loss=False)
    text = str(report)
    assert text.splitlines()[0] == "kbuild.nn.patch(Sequential): 4 patched, 1 left stock"
    assert "mlp   swiglu" in text and "{0..3}" in text
    assert "  mlp   4: its activation SteepSiLU is neither" in text
    model = nn.Module()
    model.layers = nn.ModuleList(LlamaMLP() for _ in range(3))
    assert "layers.{0..2}" in str(patch(model, norms=False, rope=False, loss=False))
    assert isinstance(report, PatchReport) and bool(report)


def test_torch_compile_no_graph_breaks():
    """Catches a patched forward that breaks torch.compile's graph (or recompiles per layer):
    the patched stand-in compiles to one graph, as stock does, and matches eager."""
    torch.manual_seed(0)
    model = Tiny([LlamaMLP(), Phi3MLP()])
    stock = copy.deepcopy(model)
    patch(model)
    x = _x()
    for m in (stock, model):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(m)(x)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert_close_rel(compiled(x), stock(x), 1e-5)
    torch._dynamo.reset()


def _hf_causal_lm_loss(logits, labels, vocab, num_items_in_batch=None, ignore_index=-100,
                       shift_labels=None):  # fmt: skip
    """transformers' ForCausalLMLoss (loss/loss_utils.py), copied."""
    logits = logits.float()
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    logits, shift_labels = logits.view(-1, vocab), shift_labels.view(-1)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
    return loss / num_items_in_batch if reduction == "sum" else loss


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"num_items_in_batch": torch.tensor(9)},
        {"softcap": 1.5},
        {"shift_labels": True},
        {"ignore_index": 3},
    ],  # fmt: skip
    ids=["mean", "num_items", "softcap", "shift_labels", "ignore_index"],
)
def test_causal_lm_loss_is_hf_loss(kwargs):
    """Catches labels not shifted (or shifted the wrong way), the last position not ignored,
    num_items_in_batch ignored or applied as a mean, the softcap left out, shift_labels or
    ignore_index not honoured: loss and gradients against HF's formula on the logits."""
    V, g = 40, _gen(4)
    hidden = torch.randn(2, 7, D, generator=g, requires_grad=True)
    weight = (0.2 * torch.randn(V, D, generator=g)).requires_grad_()
    labels = torch.randint(0, V, (2, 7), generator=g)
    labels[0, :3] = kwargs.get("ignore_index", -100)
    kwargs = dict(kwargs)
    if kwargs.pop("shift_labels", False):
        kwargs["shift_labels"] = torch.randint(0, V, (2, 7), generator=g)
    cap = kwargs.pop("softcap", None)
    ours = causal_lm_loss(hidden, weight, labels, softcap=cap, **kwargs)
    logits = hidden @ weight.T
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    ref = _hf_causal_lm_loss(logits, labels, V, **kwargs)
    assert ours.dtype == torch.float32
    assert_close_rel(ours, ref, 1e-5, "loss")
    got = torch.autograd.grad(ours, [hidden, weight])
    want = torch.autograd.grad(ref, [hidden, weight])
    for a, b in zip(got, want, strict=True):
        assert_close_rel(a, b, 1e-5)


# --------------------------------------------------------------------------- Hugging Face models

VOCAB = 128
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "gpt2"]


@pytest.fixture
def hf():
    return pytest.importorskip("transformers")


def hf_model(hf, kind: str, width=D, inter=INTER, head_dim=HEAD_DIM, vocab=VOCAB, cap=2.0):
    """A 2-layer fp32 model of the family on CPU, random weights, its norm weights moved away
    from their init (1 or 0) so the math shows: GQA, Phi-3's partial rotation, Gemma 2/3's
    softcap `cap` (2 here: small enough that leaving it out changes the loss), no dropout."""
    common = dict(hidden_size=width, intermediate_size=inter, num_hidden_layers=2,
                  num_attention_heads=HEADS, num_key_value_heads=KV, vocab_size=vocab,
                  max_position_embeddings=256, bos_token_id=0, eos_token_id=0)  # fmt: skip
    gemma = dict(head_dim=head_dim, final_logit_softcapping=cap)
    config = {
        "llama": lambda: hf.LlamaConfig(**common),
        "mistral": lambda: hf.MistralConfig(**common),
        "qwen2": lambda: hf.Qwen2Config(**common),
        "qwen3": lambda: hf.Qwen3Config(head_dim=head_dim, **common),
        "gemma": lambda: hf.GemmaConfig(head_dim=head_dim, **common),
        "gemma2": lambda: hf.Gemma2Config(**gemma, **common),
        "gemma3": lambda: hf.Gemma3TextConfig(sliding_window=4, **gemma, **common),
        "phi3": lambda: hf.Phi3Config(partial_rotary_factor=0.5, pad_token_id=0, **common),
        "gpt2": lambda: hf.GPT2Config(
            n_embd=width,
            n_layer=2,
            n_head=HEADS,
            vocab_size=vocab,
            n_positions=256,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),  # fmt: skip
        "granite": lambda: hf.GraniteConfig(logits_scaling=4.0, **common),
    }[kind]()
    torch.manual_seed(0)
    try:
        model = hf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:  # transformers 5.25 refuses sdpa for Gemma 2 (its softcapped attention)
        model = hf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.add_(torch.randn(p.shape, generator=_gen(1)) * 0.3)
    return model


def _ids(seed=2, batch=2, seq=12):
    return torch.randint(0, VOCAB, (batch, seq), generator=_gen(seed))


def _spies(monkeypatch):
    calls = []
    for module, names in ((activations, ("swiglu", "geglu", "gelu")), (rope_ops, ("rope",)),
                          (linear_loss, ("linear_cross_entropy",))):  # fmt: skip
        for name in names:
            calls_of = _counting(monkeypatch, module, name)
            calls.append(calls_of)
    return calls


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_patched_same_model(hf, monkeypatch, kind):
    """Catches a family whose norms, MLPs, attention or loss are not all patched, a patched
    model whose logits (no labels), loss or gradients (labels) differ from stock, Gemma 2/3's
    softcap left out of the fused loss, logits returned with labels, and a patch that reaches
    another model of the same class in the process (it must call no kbuild op)."""
    spies = _spies(monkeypatch)
    stock = hf_model(hf, kind)
    model, other = copy.deepcopy(stock), copy.deepcopy(stock)
    report = patch(model)
    layers = 2
    norms = [n for n, m in stock.named_modules() if "Norm" in type(m).__name__]
    assert report.paths("norm") == norms
    assert len(report.paths("mlp")) == layers
    assert len(report.paths("rope")) == (0 if kind == "gpt2" else layers)
    assert report.paths("loss") == [""]
    assert report.kept == [] and all(s.level == "instance" for s in report.swaps)
    if kind in ("gemma2", "gemma3"):
        assert [s.what for s in report.swaps if s.kind == "loss"] == [
            "linear_cross_entropy(softcap=2)"
        ]

    for calls in spies:
        calls.clear()
    ids = _ids()
    assert_close_rel(other(input_ids=ids).logits, stock(input_ids=ids).logits, 0, "other")
    other(input_ids=ids, labels=ids).loss.backward()
    assert all(calls == [] for calls in spies)
    other.zero_grad()

    assert_close_rel(model(input_ids=ids).logits, stock(input_ids=ids).logits, 1e-5, "logits")
    ours, ref = model(input_ids=ids, labels=ids), stock(input_ids=ids, labels=ids)
    assert ours.logits is None
    assert abs(ours.loss.item() - ref.loss.item()) < 1e-5 * ref.loss.item()
    ours.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(model.named_parameters(), stock.parameters(), strict=True):
        if q.grad is not None:
            assert_close_rel(p.grad, q.grad, 1e-4, name)
    used = {calls[0] for calls in spies if calls}
    want = {"linear_cross_entropy", "gelu" if kind == "gpt2" else "rope"}
    want.add(
        {"gemma": "geglu", "gemma2": "geglu", "gemma3": "geglu", "gpt2": "gelu"}.get(kind, "swiglu")
    )
    assert used == want


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_forward_arguments_kept(hf, kind):
    """Catches a patched forward that drops or misreads the stock forward's arguments:
    positional labels, return_dict=False (a tuple, loss first), num_items_in_batch (a sum over
    it), shift_labels, an attention mask with padding; and without labels the stock path itself
    (cache, logits_to_keep, greedy generation)."""
    stock = hf_model(hf, kind)
    model = copy.deepcopy(stock)
    patch(model)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    cases = [
        dict(labels=labels, attention_mask=mask),
        dict(labels=labels, num_items_in_batch=torch.tensor(7)),
        dict(labels=labels, shift_labels=torch.roll(labels, -1, 1)),
        dict(labels=labels, return_dict=False),
    ]
    for kwargs in cases:
        ours, ref = model(input_ids=ids, **kwargs), stock(input_ids=ids, **kwargs)
        ours, ref = (ours[0], ref[0]) if isinstance(ref, tuple) else (ours.loss, ref.loss)
        assert abs(ours.item() - ref.item()) < 1e-5 * abs(ref.item()), kwargs
    if kind == "llama":  # positional labels: (input_ids, mask, positions, cache, embeds, labels)
        ours = model(ids, None, None, None, None, labels).loss
        assert abs(ours.item() - stock(input_ids=ids, labels=labels).loss.item()) < 1e-4
    ours = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    ref = stock(input_ids=ids, use_cache=True, logits_to_keep=1)
    assert ours.logits.shape == (2, 1, VOCAB) and ours.past_key_values is not None
    assert_close_rel(ours.logits, ref.logits, 1e-5)
    prompt = ids[:1, :4]
    generate = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **generate), stock.generate(prompt, **generate))


def test_hf_module_with_other_math_left_stock(hf):
    """Catches a swap decided by the model's family: one Gemma layer whose act_fn is erf-GELU
    (not the family's tanh-GELU) keeps its stock MLP, with the reason, and the model still
    computes stock's logits; a family whose CausalLM forward kbuild's loss does not replicate
    (Granite scales its logits) keeps its stock loss while its norms, MLPs and rope are patched
    by their checks."""
    stock = hf_model(hf, "gemma")
    stock.model.layers[1].mlp.act_fn = nn.GELU()
    model = copy.deepcopy(stock)
    report = patch(model)
    assert report.paths("mlp") == ["model.layers.0.mlp"]
    (kept,) = report.kept
    assert kept.path == "model.layers.1.mlp" and "neither silu nor tanh-GELU" in kept.reason
    ids = _ids()
    assert_close_rel(model(input_ids=ids).logits, stock(input_ids=ids).logits, 1e-5)

    stock = hf_model(hf, "granite")
    model = copy.deepcopy(stock)
    report = patch(model)
    assert [(k.path, k.kind) for k in report.kept] == [("", "loss")]
    assert "'granite'" in report.kept[0].reason
    assert {s.kind for s in report.swaps} == {"norm", "mlp", "rope"}
    ours, ref = model(input_ids=ids, labels=ids), stock(input_ids=ids, labels=ids)
    assert abs(ours.loss.item() - ref.loss.item()) < 1e-5 * ref.loss.item()
    assert ours.logits is not None


def test_hf_unpatch_and_compile(hf):
    """Catches unpatch leaving a kbuild forward or module in the model, and a patched model
    that breaks torch.compile's graph where stock does not (with labels, stock GPT-2 breaks
    once at its loss; the patched loss does not), or compiles to other values."""
    stock = hf_model(hf, "llama")
    model = copy.deepcopy(stock)
    report = patch(model)
    types_before = [type(m) for m in stock.modules()]
    report.unpatch()
    assert [type(m) for m in model.modules()] == types_before
    assert not any("forward" in vars(m) for m in model.modules())
    patch(model)
    ids = _ids()
    counts = []
    for m in (stock, model):
        torch._dynamo.reset()
        counts.append(torch._dynamo.explain(m)(input_ids=ids, labels=ids).graph_break_count)
    assert counts[1] <= counts[0], counts
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    ref = stock(input_ids=ids, labels=ids).loss
    ref.backward()
    torch._dynamo.reset()
    assert abs(loss.item() - ref.item()) < 1e-5 * ref.item()
    for (name, p), q in zip(model.named_parameters(), stock.parameters(), strict=True):
        assert_close_rel(p.grad, q.grad, 1e-4, name)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "phi3", "gpt2"])
def test_bf16_checks_pass(hf, kind):
    """Catches tolerances too tight for bf16 (stock rounds each intermediate to bf16, kbuild
    once): every check passes in bf16 on CPU, and logits and loss agree to bf16 noise."""
    stock = hf_model(hf, kind).to(torch.bfloat16)
    model = copy.deepcopy(stock)
    report = patch(model)
    assert report.kept == [] and len(report.swaps) >= 8
    ids = _ids()
    assert_close_rel(model(input_ids=ids).logits, stock(input_ids=ids).logits, 3e-2, "logits")
    ours, ref = model(input_ids=ids, labels=ids).loss, stock(input_ids=ids, labels=ids).loss
    assert abs(ours.item() - ref.item()) < 1e-2 * ref.item()  # kbuild's loss is bf16-rounded


def test_evaluation_with_labels_gets_the_logits(hf):
    """Trainer's prediction step (eval mode, no_grad, labels given) needs the logits: the
    patched forward is stock's there, and the fused loss only trains."""
    model = hf_model(hf, "llama")
    patch(model)
    ids = _ids()
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    assert out.logits is not None and torch.isfinite(out.loss)
    model.train()
    assert model(input_ids=ids, labels=ids).logits is None


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_mixed_precision_training_step(hf, kind):
    """bf16 autocast over fp32 weights (Trainer's bf16=True): the patched model trains, its
    loss and gradients near stock's under the same autocast (bf16 rounding apart)."""
    stock = hf_model(hf, kind)
    model = copy.deepcopy(stock)
    patch(model)
    ids = _ids()
    losses = []
    for m in (model, stock):
        m.train()
        with torch.autocast("cpu", torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().float())
    assert abs(losses[0] - losses[1]) < 3e-2 * losses[1]
    head = model.lm_head.weight  # GPT-2's is tied to its embedding
    assert head.grad.dtype == torch.float32
    assert_close_rel(head.grad, stock.lm_head.weight.grad, 5e-2, "lm_head")


def test_low_memory_loss_is_asked_for_and_named(hf, monkeypatch):
    """Catches loss="low_memory" ignored (the default chunks taken: no memory budget, or one
    other than the hidden states' bytes), left out of the report, or a loss or gradient that
    differs from the default patch's beyond the chunks' summation order."""
    from kbuild.kernels.loss import linear as linear_loss

    budgets, real = [], linear_loss.linear_cross_entropy

    def spy(h, *args, **kwargs):
        budgets.append((kwargs.get("memory_budget"), h.numel() * h.element_size()))
        return real(h, *args, **kwargs)

    monkeypatch.setattr(linear_loss, "linear_cross_entropy", spy)
    stock = hf_model(hf, "gemma2")
    fast, small = copy.deepcopy(stock), copy.deepcopy(stock)
    patch(fast)
    report = patch(small, loss="low_memory")
    named = [s.what for s in report.swaps if s.kind == "loss"]
    assert named == ["linear_cross_entropy(softcap=2, low_memory)"], named
    ids = _ids()
    budgets.clear()
    losses = [m(input_ids=ids, labels=ids).loss for m in (fast, small)]
    (none, _), (budget, hidden_bytes) = budgets
    assert none is None and budget == hidden_bytes
    assert_close_rel(losses[1], losses[0], 1e-6, "loss")
    for loss in losses:
        loss.backward()
    assert_close_rel(small.lm_head.weight.grad, fast.lm_head.weight.grad, 1e-5, "d(lm_head)")
