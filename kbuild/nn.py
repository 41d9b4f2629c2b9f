"""Drop-in replacements for torch.nn.RMSNorm and torch.nn.LayerNorm on kbuild's kernels, and
GPT-2's layers from llm.c: `Linear` (kbuild's bias gradient) and `GPT2Embedding`.

They subclass the torch modules, so constructor arguments, parameters, initialisation,
state_dict keys and repr are torch's own: a checkpoint loads into either class unchanged.
Only `forward` differs. kbuild normalises over the last dimension only, so a
`normalized_shape` of more than one dimension raises ValueError at construction.

`swap_norms(model)` replaces a model's torch and Hugging Face style norms by these modules in
place, each class after a numerical check that its math is kbuild's. `patch(model)` does that
and more for a Hugging Face causal LM: its MLP activation, rotary embedding and loss too
(kbuild/patching). `CrossEntropyLoss` and `LinearCrossEntropy` are the losses as modules.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch.nn import Module

from .ops import encoder, layernorm, linear, rmsnorm

_FP32_EPS = torch.finfo(torch.float32).eps  # kbuild computes in fp32 whatever the I/O dtype


def _last_dim_only(cls: str, normalized_shape) -> None:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(
            f"kbuild.nn.{cls} normalises over the last dimension only: normalized_shape must be "
            f"an int or a 1-tuple, got {normalized_shape!r} (use torch.nn.{cls} for that)"
        )


def _check_last_dim(module: torch.nn.Module, x: torch.Tensor) -> None:
    # With a weight, kbuild's own checks catch this; without one (elementwise_affine=False)
    # nothing else would, and torch's modules raise here too.
    (n,) = module.normalized_shape
    if x.ndim == 0 or x.shape[-1] != n:
        raise ValueError(
            f"{type(module).__name__} expects inputs (..., {n}); got shape {tuple(x.shape)}"
        )


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm computed by kbuild.rmsnorm. eps=None means what it means in torch:
    the machine epsilon of the computation type, fp32 for every input kbuild takes (so
    finfo(float32).eps for bf16 and fp16 too, not the 16-bit type's own).

    `offset`: y = x_hat * (offset + weight), the offset added in fp32 inside the kernels
    (Gemma's RMSNorm: offset=1.0, its weight stored around 0 and initialised to zeros here).
    """

    def __init__(
        self,
        normalized_shape,
        eps=None,
        elementwise_affine=True,
        device=None,
        dtype=None,
        offset: float = 0.0,
    ):
        _last_dim_only("RMSNorm", normalized_shape)
        if isinstance(offset, bool) or not isinstance(offset, (int, float)):
            raise TypeError(f"offset must be a float, got {type(offset).__name__}")
        if offset != 0 and not elementwise_affine:
            raise ValueError(
                "offset scales the weight (offset + weight): it needs elementwise_affine"
            )
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.offset = float(offset)
        self.reset_parameters()  # torch's __init__ ran it before the offset was known

    def reset_parameters(self) -> None:
        """The identity scale: offset + weight = 1 (Gemma's weight starts at 0)."""
        if self.elementwise_affine:
            torch.nn.init.constant_(self.weight, 1.0 - getattr(self, "offset", 0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(self, x)
        eps = self.eps if self.eps is not None else _FP32_EPS
        return rmsnorm(x, self.weight, eps, self.offset)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        return f"{text}, offset={self.offset}" if self.offset else text


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm computed by kbuild.layernorm."""

    def __init__(
        self,
        normalized_shape,
        eps=1e-5,
        elementwise_affine=True,
        bias=True,
        device=None,
        dtype=None,
    ):
        _last_dim_only("LayerNorm", normalized_shape)
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(self, x)
        return layernorm(x, self.weight, self.bias, self.eps)


class Linear(torch.nn.Linear):
    """torch.nn.Linear whose bias gradient is kbuild's deterministic column sum
    (kbuild.linear); the matmuls are torch's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """torch.nn.CrossEntropyLoss computed by kbuild.cross_entropy (the forward writes the
    gradient; see kbuild/ops/loss.py): input (N, C) or (C,), target class ids (N,) or ().
    `ignore_index`, `reduction` and `label_smoothing` are torch's; `lse_square_scale` adds
    the z-loss scale * lse^2 per row (PaLM's, as Liger defines it). Refused with ValueError:
    a class `weight`, the deprecated `size_average` / `reduce`, and at call time inputs of
    more than two dimensions (torch's class dimension is then 1; kbuild.cross_entropy takes
    (..., C)) and probability targets (kbuild's check names target)."""

    def __init__(self, weight=None, size_average=None, ignore_index=-100, reduce=None,
                 reduction="mean", label_smoothing=0.0, lse_square_scale=0.0,
                 softcap=None):  # fmt: skip
        for name, value in (("weight", weight), ("size_average", size_average),
                            ("reduce", reduce)):  # fmt: skip
            if value is not None:
                raise ValueError(
                    f"kbuild.nn.CrossEntropyLoss does not take {name}= (use "
                    "torch.nn.CrossEntropyLoss for it)"
                )
        super().__init__(ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=label_smoothing)  # fmt: skip
        self.lse_square_scale = lse_square_scale
        self.softcap = softcap

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from .ops.loss import cross_entropy

        if isinstance(input, torch.Tensor) and input.dim() > 2:
            raise ValueError(
                "kbuild.nn.CrossEntropyLoss takes input (N, C) or (C,); got shape "
                f"{tuple(input.shape)} (torch's class dimension is 1 there: call "
                "kbuild.cross_entropy on (..., C) logits instead)"
            )
        return cross_entropy(input, target, self.ignore_index, self.reduction,
                             self.label_smoothing, self.lse_square_scale,
                             self.softcap)  # fmt: skip


class LinearCrossEntropy(Module):
    """An LM head and its loss in one: forward(hidden (..., H), target (...)) is
    cross_entropy(hidden @ weight.T + bias, target) by kbuild.linear_cross_entropy, which
    never holds the logits of all tokens (kbuild/ops/linear_loss.py). Its `weight` (V, H)
    can be tied to an embedding or taken from a model's lm_head (`from_linear`); the options
    (keywords, `OPTIONS` their defaults) are kbuild.linear_cross_entropy's."""

    OPTIONS = dict(ignore_index=-100, reduction="mean", label_smoothing=0.0,
                   lse_square_scale=0.0, softcap=None, chunk_size=None,
                   memory_budget=None)  # fmt: skip

    def __init__(self, in_features: int, num_classes: int, bias: bool = False, device=None,
                 dtype=None, **options):  # fmt: skip
        for name, value, least in (("in_features", in_features, 1),
                                   ("num_classes", num_classes, 2)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < least:
                raise ValueError(f"{name} must be >= {least}; got {value}")
        super().__init__()
        kinds = dict(device=device, dtype=dtype)
        self.weight = torch.nn.Parameter(torch.empty(num_classes, in_features, **kinds))
        self.bias = torch.nn.Parameter(torch.empty(num_classes, **kinds)) if bias else None
        torch.nn.init.normal_(self.weight, std=in_features**-0.5)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)
        self.options = self._options(options)

    @classmethod
    def _options(cls, given: dict) -> dict:
        unknown = set(given) - set(cls.OPTIONS)
        if unknown:
            raise TypeError(
                f"LinearCrossEntropy: unknown option {sorted(unknown)[0]} (it takes "
                f"{', '.join(cls.OPTIONS)})"
            )
        return {**cls.OPTIONS, **given}

    @classmethod
    def from_linear(cls, head: torch.nn.Linear, **options) -> LinearCrossEntropy:
        """The loss of an existing head, sharing its Parameters (no copy)."""
        ours = cls.__new__(cls)
        Module.__init__(ours)
        ours.weight, ours.bias = head.weight, head.bias
        ours.options = cls._options(options)
        return ours

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        from .ops.linear_loss import linear_cross_entropy

        return linear_cross_entropy(hidden, self.weight, target, self.bias, **self.options)

    def extra_repr(self) -> str:
        V, H = self.weight.shape
        return f"in_features={H}, num_classes={V}, bias={self.bias is not None}"


class GPT2Embedding(Module):
    """GPT-2's input layer: token embedding plus learned position embedding, by kbuild.encoder.

    `wte` (num_embeddings, embedding_dim) and `wpe` (max_positions, embedding_dim) are
    torch.nn.Embedding modules (GPT-2's names; tie `lm_head.weight = emb.wte.weight` as
    usual). forward(tokens (B, T) int32/int64) -> (B, T, embedding_dim)."""

    def __init__(
        self, num_embeddings: int, max_positions: int, embedding_dim: int, device=None, dtype=None
    ):
        super().__init__()
        self.wte = torch.nn.Embedding(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.wpe = torch.nn.Embedding(max_positions, embedding_dim, device=device, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return encoder(tokens, self.wte.weight, self.wpe.weight)

    def extra_repr(self) -> str:
        (V, C), P = self.wte.weight.shape, self.wpe.weight.shape[0]
        return f"num_embeddings={V}, max_positions={P}, embedding_dim={C}"


# ---------------------------------------------------------------------------------------------
# swap_norms: replace a model's norm modules by kbuild's, after checking their math numerically.

_Key = tuple[object, ...]
# |candidate - kbuild| <= atol + rtol * |kbuild| on the probe. 16-bit: two ulps, since Hugging
# Face norms round x_hat to x's dtype before the weight product (kbuild rounds once). The
# mismatches this must see (Gemma's 1 + weight, eps outside the root, a bias ignored) are O(1).
_SWAP_TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3.2e-2, 3.2e-2),
}
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _hf_eps(module: torch.nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        eps = getattr(module, name, None)
        if isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 <= eps < math.inf:
            return float(eps)
    return None


_Build = Callable[[torch.nn.Module], Module]


def _plan(module: torch.nn.Module) -> tuple[_Key, list[_Build]] | None:
    """(cache key, builds) for a module kbuild might replace, or None where its structure rules
    it out. Each build(m) returns a kbuild module holding m's own Parameter objects; the
    builds are the readings of the module's math to check, in order (a Hugging Face RMSNorm:
    x_hat * w, then Gemma's x_hat * (1 + w))."""
    if isinstance(module, (RMSNorm, LayerNorm)):  # kbuild's own, subclasses included
        return None
    if any(getattr(module, hooks, None) for hooks in _HOOK_DICTS):
        return None
    if next(module.children(), None) is not None or next(module.buffers(), None) is not None:
        return None
    params = tuple(name for name, _ in module.named_parameters())
    if isinstance(module, torch.nn.LayerNorm):
        affine, has_bias = module.elementwise_affine, module.bias is not None
        expected = ("weight", "bias")[: affine + (affine and has_bias)]
        if len(module.normalized_shape) != 1 or params != expected:
            return None

        def build(m: torch.nn.Module) -> Module:
            new = LayerNorm(m.normalized_shape, m.eps, affine, has_bias, device="meta")
            new.weight, new.bias = m.weight, m.bias
            return new

        return (type(module), "LayerNorm", params, module.eps), [build]
    if isinstance(module, torch.nn.RMSNorm):
        expected = ("weight",) if module.elementwise_affine else ()
        if len(module.normalized_shape) != 1 or params != expected:
            return None

        def build(m: torch.nn.Module) -> Module:
            new = RMSNorm(m.normalized_shape, m.eps, m.elementwise_affine, device="meta")
            new.weight = m.weight
            return new

        return (type(module), "RMSNorm", params, module.eps), [build]
    weight, eps = getattr(module, "weight", None), _hf_eps(module)
    if params != ("weight",) or not isinstance(weight, torch.nn.Parameter) or weight.ndim != 1:
        return None
    if eps is None:
        return None

    def reading(offset: float) -> _Build:
        def build(m: torch.nn.Module) -> Module:
            new = RMSNorm(m.weight.shape[0], _hf_eps(m), device="meta", offset=offset)
            new.weight = m.weight
            return new

        return build

    return (type(module), "hf", params, eps), [reading(0.0), reading(1.0)]


def _probe_input(n: int, eps: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """4 rows: two of RMS sqrt(eps) and 3 sqrt(eps) (eps changes them by 30% and 5%: eps
    misplaced or ignored shows), one with a mean of 2 (LayerNorm without centring shows), one
    of scale 40."""
    g = torch.Generator().manual_seed(0)
    s = max(eps, 1e-12) ** 0.5
    z = torch.randn(4, n, generator=g, dtype=torch.float64)
    z = z * torch.tensor([[s], [3 * s], [1.0], [40.0]], dtype=torch.float64)
    z[2] += 2.0
    return z.to(device=device, dtype=dtype)


def _same_math(probe: torch.nn.Module, ours: Module, eps: float) -> bool:
    """Whether `probe` (a copy of the candidate, its parameters randomised, so a weight held at
    1 or a bias at 0 cannot hide a difference) computes what `ours` does, on probe's device
    and dtype."""
    param = next(probe.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    if dtype not in _SWAP_TOL or device.type == "meta":
        return False
    n = ours.normalized_shape[0]
    x = _probe_input(n, eps, dtype, device)
    from .jit import KernelNotCached

    try:
        with torch.no_grad():
            theirs, mine = probe(x), ours(x)
    except KernelNotCached:  # offline without this kernel: say so, never skip it silently
        raise
    except Exception:  # a candidate or a kbuild launch that cannot run this: leave it alone
        return False
    if not isinstance(theirs, torch.Tensor) or theirs.dtype != mine.dtype:
        return False
    if theirs.shape != mine.shape:
        return False
    rtol, atol = _SWAP_TOL[dtype]
    theirs, mine = theirs.double(), mine.double()
    return bool(torch.all((theirs - mine).abs() <= atol + rtol * mine.abs()))


def _passes(module: torch.nn.Module, build: _Build) -> bool:
    try:
        probe = copy.deepcopy(module)
    except Exception:
        return False
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in probe.named_parameters():
            r = torch.rand(p.shape, generator=g, dtype=torch.float64) + 0.5
            if name == "weight":  # magnitudes in [0.5, 1.5], random signs
                r = r * (torch.randint(0, 2, p.shape, generator=g) * 2 - 1)
            p.copy_(r - (1.0 if name == "bias" else 0.0))
    ours = build(probe)
    eps = ours.eps if ours.eps is not None else _FP32_EPS
    return _same_math(probe, ours, eps)


def swap_norms(model: torch.nn.Module) -> list[str]:
    """Replace, in place, the norm modules of `model` that kbuild computes exactly, by
    kbuild.nn.RMSNorm / kbuild.nn.LayerNorm. Returns the dotted names of the replaced modules
    (every path to a module registered twice), in `named_modules` order.

    Candidates: torch.nn.LayerNorm and torch.nn.RMSNorm (and their subclasses) over one last
    dimension, with or without weight and bias; and Hugging Face style RMSNorm classes
    (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, ...): a module whose only parameter is a 1-D
    `weight`, with a float `variance_epsilon` or `eps`, no buffers and no children. A candidate
    is swapped only if a numerical check passes: a copy of it, its parameters randomised, and
    the kbuild module built from that copy run on a 4-row probe (rows small enough that eps
    matters, one with a large mean) in the module's own dtype and on its own device, and agree
    within a tolerance per dtype (`_SWAP_TOL`). The verdict is cached for this call per (class,
    structure, eps) and device/dtype, so a model of 100 norms of one class checks once.

    Gemma-style RMSNorm classes (x_hat * (1 + weight), GemmaRMSNorm, Gemma3RMSNorm, ...) are
    recognised by the same check and become kbuild.nn.RMSNorm(offset=1.0).

    Left alone (and not listed): modules whose math differs (eps outside the root, a weight
    added rather than multiplied, ...: whatever the class is called); norms over more than the last
    dimension; modules with extra parameters, buffers or children (their state_dict keys would
    change); modules on the meta device or in dtypes kbuild does not take (nothing to check
    on); modules with any forward, backward or state_dict hooks (moving hooks to the
    replacement could silently change their meaning: remove them, swap, and register them on
    the new module if wanted); kbuild modules and their subclasses (never re-swapped: a second
    call swaps nothing); and `model` itself, which cannot be replaced in place.

    The replacement holds the same Parameter objects (optimizers, tied weights and the
    state_dict keys are unchanged), so its device and dtype are the original's, and it keeps
    the original's training/eval mode. The check compares outputs in the parameters' dtype:
    a Hugging Face norm with fp32 weights fed 16-bit inputs returns fp32 there, and kbuild x's
    dtype. Modules without parameters are checked on CPU in fp32. Other attributes of the old
    module (e.g. `variance_epsilon`) are not copied.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    verdicts: dict[_Key, _Build | None] = {}  # the build whose math matched, if any
    replacements: dict[int, Module | None] = {}
    slots = [(path, child) for path, child in model.named_modules(remove_duplicate=False) if path]
    swapped = []
    for path, child in slots:
        if id(child) not in replacements:
            replacements[id(child)] = None
            plan = _plan(child)
            if plan is not None:
                key, builds = plan
                param = next(child.parameters(), None)
                key += (None,) if param is None else (param.device, param.dtype)
                if key not in verdicts:
                    verdicts[key] = next((b for b in builds if _passes(child, b)), None)
                if verdicts[key] is not None:
                    replacements[id(child)] = verdicts[key](child).train(child.training)
        new = replacements[id(child)]
        if new is not None:
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, new)
            swapped.append(path)
    return swapped


def patch(model: torch.nn.Module, norms: bool = True, rope: bool = True, mlp: bool = True,
          loss: bool | str = True):  # fmt: skip
    """Put kbuild's norms, rotary embedding, MLP activation and fused linear cross-entropy into
    a Hugging Face causal LM in place, each swap per module instance and after a numerical
    check on the module's own device; returns a PatchReport (what was patched, what was left
    and why; `.unpatch()` undoes it). `loss="low_memory"`: the fused loss in its least memory,
    slower. See kbuild/patching/__init__.py."""
    from .patching import patch as _patch

    return _patch(model, norms=norms, rope=rope, mlp=mlp, loss=loss)
