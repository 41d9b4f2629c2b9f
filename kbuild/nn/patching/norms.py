"""Norms: `swap_norms(model)` replaces a model's torch and Hugging Face style norm modules by
kbuild.nn.RMSNorm / LayerNorm in place, each after a numerical check that its math is
kbuild's; `patch_norms` is `patch`'s norms step (what was swapped and what was kept, and why).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch.nn import Module

from ..modules import FP32_EPS, LayerNorm, RMSNorm
from .report import PatchReport, Swap

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
    from ...jit import KernelNotCached

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
    eps = ours.eps if ours.eps is not None else FP32_EPS
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


def patch_norms(model: torch.nn.Module, report: PatchReport) -> None:
    before = dict(model.named_modules(remove_duplicate=False))
    swapped = swap_norms(model)
    for path in swapped:
        new = model.get_submodule(path)
        parent, _, attr = path.rpartition(".")
        owner, old = model.get_submodule(parent), before[path]
        offset = getattr(new, "offset", 0.0)
        what = type(new).__name__ + (f"(offset={offset:g})" if offset else "")
        report.add(Swap(path, "norm", what), lambda o=owner, a=attr, m=old: setattr(o, a, m))
    done = set(swapped)
    for path, module in model.named_modules():
        if path in done or "Norm" not in type(module).__name__:
            continue
        if isinstance(module, (RMSNorm, LayerNorm)):
            why = "already kbuild's"
        elif any(getattr(module, h, None) for h in ("_forward_hooks", "_forward_pre_hooks")):
            why = "has hooks (swap_norms leaves hooked modules)"
        elif next(module.children(), None) is not None or next(module.buffers(), None) is not None:
            why = "has children or buffers (swap_norms would change its state_dict)"
        else:
            why = "swap_norms' check: its math, dtype or device is not kbuild's"
        report.keep(path, "norm", why)
