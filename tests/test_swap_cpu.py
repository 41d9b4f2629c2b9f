"""CPU tests of kbuild.nn.swap_norms: which modules it replaces (decided by a numerical check,
not by name), that the replacements hold the same Parameter objects and compute the same
model, and what it leaves alone. The Hugging Face classes are stand-ins copying their math
(transformers is not a dependency)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kbuild.nn
from kbuild.nn.patching import norms as swap

from .reference import assert_close_rel

D = 64
VOCAB = 50
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}
# Whole models, relative to the output's scale (by norm and by max): in bf16 the Hugging Face
# norms round x_hat before the weight product and kbuild does not, and layers amplify that.
MODEL_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


class LlamaRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm (Mistral's and Qwen2's are the same code)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaRMSNorm(nn.Module):
    """transformers' GemmaRMSNorm: x_hat * (1 + weight), weight initialised to 0."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        output = x.float()
        output = output * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + self.eps)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class TwoDimRMSNorm(nn.Module):
    """Structurally a candidate (1-D weight, `eps`), but normalises over the last two dims."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        rstd = torch.rsqrt(x.float().pow(2).mean((-2, -1), keepdim=True) + self.eps)
        return (x.float() * rstd).to(x.dtype) * self.weight


class WeightlessRMSNorm(nn.Module):
    """Has a weight (all ones) that forward ignores: equal to kbuild's at initialisation."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x)


def _lookalike_class():
    class LlamaRMSNorm(nn.Module):  # the name of the real one; eps outside the root
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, x):
            rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()
            return self.weight * (x.float() / (rms + self.variance_epsilon)).to(x.dtype)

    return LlamaRMSNorm


LookalikeLlamaRMSNorm = _lookalike_class()


class Block(nn.Module):
    def __init__(self, norm_a, norm_b):
        super().__init__()
        self.norm_a, self.norm_b = norm_a, norm_b
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        x = x + self.fc1(self.norm_a(x))[..., :D]
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm_b(x))))


class GPT2Like(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.h = nn.ModuleList(Block(nn.LayerNorm(D), nn.LayerNorm(D)) for _ in range(layers))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, ids):
        x = self.wte(ids)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class LlamaLike(nn.Module):
    def __init__(self, layers=2, norm=LlamaRMSNorm):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block(norm(D, 1e-5), norm(D, 1e-5)) for _ in range(layers))
        self.norm = norm(D, 1e-5)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def _randomise(model: nn.Module, seed=0) -> nn.Module:
    """Norm parameters far from 1 and 0, so a replacement ignoring them changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p.ndim == 1 else 0.0))
    return model


def _ids():
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))


def _norm_params(model):
    return {n: p for n, p in model.named_parameters() if "norm" in n or "ln" in n}


GPT2_NORMS = ["h.0.norm_a", "h.0.norm_b", "h.1.norm_a", "h.1.norm_b", "ln_f"]
LLAMA_NORMS = [
    "layers.0.norm_a",
    "layers.0.norm_b",
    "layers.1.norm_a",
    "layers.1.norm_b",
    "norm",
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "make, names, cls",
    [(GPT2Like, GPT2_NORMS, kbuild.nn.LayerNorm), (LlamaLike, LLAMA_NORMS, kbuild.nn.RMSNorm)],
    ids=["gpt2", "llama"],
)
def test_models_swapped_same_params_same_outputs(make, names, cls, dtype):
    """Catches a norm missed or a wrong one replaced (names), new Parameters instead of the
    same objects (optimizers and tied weights would detach), the parameters' dtype changed,
    eps/weight/bias not carried over (whole-model outputs), state_dict keys renamed, and
    gradients not reaching the weights or differing from the original model's."""
    model = _randomise(make()).to(dtype)
    before = copy.deepcopy(model)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    assert kbuild.nn.swap_norms(model) == names
    for name in names:
        assert type(model.get_submodule(name)) is cls
    assert all(p is params[n] for n, p in model.named_parameters())
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p.dtype == dtype for p in model.parameters())
    assert list(model.state_dict()) == keys
    if make is GPT2Like:
        assert model.lm_head.weight is model.wte.weight
    out, ref = model(_ids()), before(_ids())
    assert out.dtype == ref.dtype
    assert_close_rel(out, ref, MODEL_TOL[dtype], "logits")
    out.float().square().mean().backward()
    ref.float().square().mean().backward()
    theirs = _norm_params(before)
    for name, p in _norm_params(model).items():
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, name
        assert_close_rel(p.grad, theirs[name].grad, 3 * MODEL_TOL[dtype], name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_different_math_left_alone(dtype):
    """Catches a decision by name or by structure: a norm over the last two dims with a 1-D
    weight, a class named LlamaRMSNorm with eps outside the root (only a
    probe whose rows are small enough for eps to matter sees it), a weight that forward
    ignores (only a check on randomised parameters sees it: at its ones it equals kbuild's),
    and torch.nn.LayerNorm over two dims; the real LlamaRMSNorm beside them is swapped, and
    Gemma's (1 + weight) becomes RMSNorm(offset=1.0) (test_gemma_swapped_with_offset)."""
    model = nn.ModuleDict(
        dict(
            gemma=GemmaRMSNorm(D),
            two_dim=TwoDimRMSNorm(D),
            lookalike=LookalikeLlamaRMSNorm(D),
            weightless=WeightlessRMSNorm(D),
            ln_2d=nn.LayerNorm((4, D)),
            llama=LlamaRMSNorm(D),
        )
    ).to(dtype)
    assert LookalikeLlamaRMSNorm.__name__ == LlamaRMSNorm.__name__
    originals = dict(model.items())
    assert kbuild.nn.swap_norms(model) == ["gemma", "llama"]
    assert model["gemma"].offset == 1.0 and model["llama"].offset == 0.0
    for name, module in model.items():
        assert (module is originals[name]) == (name not in ("gemma", "llama")), name


@pytest.mark.parametrize(
    "module",
    [
        nn.LayerNorm(D, bias=False),
        nn.LayerNorm(D, elementwise_affine=False),
        nn.LayerNorm(D, eps=1e-3),
        nn.RMSNorm(D),
        nn.RMSNorm(D, eps=1e-4, elementwise_affine=False),
    ],
    ids=["ln_no_bias", "ln_no_affine", "ln_eps", "rms_eps_None", "rms_no_affine"],
)
def test_torch_variants(module):
    """Catches bias=False / elementwise_affine=False / eps not carried over (a bias or weight
    invented, or eps=None read as kbuild's 1e-6): same structure, same outputs."""
    model = _randomise(nn.Sequential(module))
    before = copy.deepcopy(model)
    assert kbuild.nn.swap_norms(model) == ["0"]
    new = model[0]
    assert isinstance(new, (kbuild.nn.LayerNorm, kbuild.nn.RMSNorm))
    assert (new.eps, new.elementwise_affine) == (module.eps, module.elementwise_affine)
    assert [n for n, _ in new.named_parameters()] == [n for n, _ in module.named_parameters()]
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(1)) * 1e-2
    torch.testing.assert_close(model(x), before(x), **TOL[torch.float32])


def test_idempotent_and_kbuild_subclasses_kept():
    """Catches kbuild modules (or user subclasses of them) swapped again: a second call
    swaps nothing and keeps the same module objects."""

    class MyRMSNorm(kbuild.nn.RMSNorm):
        pass

    model = LlamaLike()
    model.extra = MyRMSNorm(D, eps=1e-6)
    assert kbuild.nn.swap_norms(model) == LLAMA_NORMS
    modules = dict(model.named_modules())
    assert kbuild.nn.swap_norms(model) == []
    assert all(m is modules[n] for n, m in model.named_modules())
    assert type(model.extra) is MyRMSNorm


def test_check_cached_per_class(monkeypatch):
    """Catches the numerical check run once per module (100 norms, 100 probes) or cached by
    name only: one check per (class, dtype) however many instances."""
    calls = []
    real = swap._same_math

    def counting(probe, ours, eps):
        calls.append(type(probe).__name__)
        return real(probe, ours, eps)

    monkeypatch.setattr(swap, "_same_math", counting)
    model = nn.ModuleDict(
        dict(
            llama=LlamaLike(layers=10),  # 21 norms
            gpt2=GPT2Like(layers=10),  # 21 norms
            lookalike=LlamaLike(layers=3, norm=LookalikeLlamaRMSNorm),  # 7, never swapped
            bf16=LlamaLike(layers=2).to(torch.bfloat16),  # another dtype: checked again
        )
    )
    names = kbuild.nn.swap_norms(model)
    assert len(names) == 21 + 21 + 5
    # LlamaRMSNorm: one check per dtype (the first reading, x_hat * w, passes); the lookalike
    # two (it fails both readings: x_hat * w and Gemma's x_hat * (1 + w)).
    assert sorted(calls) == sorted(["LlamaRMSNorm"] * 4 + ["LayerNorm"])


def test_modes_hooks_and_shared_modules():
    """Catches the training/eval mode reset by the replacement, a module with a forward hook
    swapped (its hook would silently stop firing) or listed, and a module registered at two
    paths replaced at one only (the two paths would then hold different modules)."""
    shared = LlamaRMSNorm(D)
    model = nn.ModuleDict(
        dict(trains=LlamaRMSNorm(D), evaluating=nn.LayerNorm(D).eval(), hooked=nn.LayerNorm(D))
    )
    model.a, model.b = nn.Sequential(shared), nn.Sequential(shared)
    fired = []
    model["hooked"].register_forward_hook(lambda *args: fired.append(1))
    hooked = model["hooked"]
    assert kbuild.nn.swap_norms(model) == ["trains", "evaluating", "a.0", "b.0"]
    assert model["trains"].training and not model["evaluating"].training
    assert model["hooked"] is hooked
    model["hooked"](torch.randn(2, D))
    assert fired == [1]
    assert model.a[0] is model.b[0]
    assert isinstance(model.a[0], kbuild.nn.RMSNorm) and model.a[0].weight is shared.weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemma_swapped_with_offset(dtype):
    """Catches Gemma's (1 + weight) swapped as plain RMSNorm (or left alone now that kbuild
    has the offset): it becomes kbuild.nn.RMSNorm(offset=1.0) holding the same weight, and
    forward and gradients match the original."""
    model = _randomise(nn.Sequential(GemmaRMSNorm(D))).to(dtype)
    before = copy.deepcopy(model)
    assert kbuild.nn.swap_norms(model) == ["0"]
    new = model[0]
    assert isinstance(new, kbuild.nn.RMSNorm) and new.offset == 1.0
    assert new.weight is not before[0].weight and new.weight.data_ptr() != 0
    x = (torch.randn(3, D, generator=torch.Generator().manual_seed(2)) * 0.3).to(dtype)
    x.requires_grad_()
    ours, theirs = model(x), before(x)
    torch.testing.assert_close(ours.float(), theirs.float(), **TOL[dtype])
    dy = torch.randn_like(ours)
    g1 = torch.autograd.grad(ours, [x, new.weight], dy)
    g2 = torch.autograd.grad(theirs, [x, before[0].weight], dy)
    for a, b in zip(g1, g2, strict=True):
        assert_close_rel(a, b, 3 * MODEL_TOL[dtype])
