"""Rotary position embeddings onto kbuild.kernels.rope.op.rope, one attention instance at a time.

Hugging Face attention forwards call their modeling module's `apply_rotary_pos_emb(q, k, cos,
sin)` by its global name; transformers 5 offers no per-instance hook for it (the classes'
`use_kernelized_func` decoration only matters with the `kernels` package, and the forward still
calls the global; with `kernels` installed that global is a module wrapping the function, which
the check calls as it is and whose signature is read from the function it holds). So each
attention instance gets its class's forward rebuilt with that one global name bound to kbuild's
rope (`bind.with_globals`): the modeling module, the class and other models are untouched.
Decorators on the class's forward (transformers 5.25's `deprecate_kwarg`) are kept: each
wrapper is copied around the rebuilt function (`bind.rewrapped`). One rebuilt function per
class, shared by its instances, so torch.compile traces one code object for every layer.

The check, once per (function, head_dim, device, dtype): the stock function and kbuild's on
q (2, 4, 5, D), k (2, 2, 5, D) and cos/sin (2, 5, R) shaped as the model's rotary modules make
them (R from their `inv_freq` buffers, so Phi-3's partial rotation is probed as it runs; cos
and sin are [f, f] halves, times a scale as yarn and longrope apply).
"""

from __future__ import annotations

import inspect
import types

import torch

from . import bind, check
from .report import PatchReport, Swap

NAME = "apply_rotary_pos_emb"
_SIGNATURES = (("q", "k", "cos", "sin", "unsqueeze_dim"),)


_WRAPPERS: dict = {}


def _kbuild_rope():
    """apply_rotary_pos_emb's signature on kbuild's rope: one per rope function in the process,
    so each modeling module needs one shadow (bind.with_globals)."""
    from ...kernels.rope.op import rope

    if rope not in _WRAPPERS:

        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

        _WRAPPERS[rope] = apply_rotary_pos_emb
    return _WRAPPERS[rope]


def _rotary_dims(model: torch.nn.Module) -> set[int]:
    return {2 * b.numel() for n, b in model.named_buffers() if n.endswith("inv_freq")}


def _probe(D: int, R: int, device, dtype):
    g = check.generator(7)
    q = torch.randn(2, 4, 5, D, generator=g)
    k = torch.randn(2, 2, 5, D, generator=g)
    theta = torch.rand(2, 5, R // 2, generator=g, dtype=torch.float64) * 20 - 10
    emb = torch.cat([theta, theta], dim=-1)
    cos, sin = 1.25 * emb.cos(), 1.25 * emb.sin()
    return [t.to(device=device, dtype=dtype) for t in (q, k, cos, sin)]


def _function_of(stock):
    """The function `stock` computes: itself, or where the `kernels` package made a function
    into a module (transformers with `kernels` installed: `use_kernel_forward_from_hub`), the
    function of that name its class's forward holds."""
    if not isinstance(stock, torch.nn.Module):
        return stock
    for cell in getattr(type(stock).forward, "__closure__", None) or ():
        held = cell.cell_contents
        if isinstance(held, types.FunctionType) and held.__name__ == NAME:
            return held
    return stock


def _verdict(stock, ours, D: int, dims: set[int], device, dtype) -> str | None:
    params = tuple(inspect.signature(_function_of(stock)).parameters)
    if params not in _SIGNATURES:
        return f"{NAME} takes {params}, not the (q, k, cos, sin, unsqueeze_dim) kbuild's rope has"
    for R in sorted(r for r in dims | {D} if 0 < r <= D and r % 2 == 0):
        args = _probe(D, R, device, dtype)
        why = check.compare(lambda a=args: stock(*a), lambda a=args: ours(*a), check.TOL[dtype])
        if why is not None:
            return f"rotary dim {R} of head_dim {D}: {why}"
    return None


def _candidate(module: torch.nn.Module):
    """The class forward (unwrapped) of an attention module calling the global NAME, or None."""
    forward = getattr(type(module), "forward", None)
    inner = inspect.unwrap(forward) if callable(forward) else None
    if not isinstance(inner, types.FunctionType) or NAME not in inner.__code__.co_names:
        return None
    if not callable(inner.__globals__.get(NAME)):
        return None
    return inner


def patch_rope(model: torch.nn.Module, report: PatchReport) -> None:
    """Every attention module in `model` whose class forward calls `apply_rotary_pos_emb`,
    after the check (module docstring)."""
    dims = _rotary_dims(model)
    ours, verdicts, rebuilt = None, {}, {}
    for path, module in model.named_modules():
        inner = _candidate(module)
        if inner is None:
            continue
        at = check.where(module)
        why = at if isinstance(at, str) else bind.refusal(module)
        D = getattr(module, "head_dim", None)
        if why is None and not isinstance(D, int):
            why = "no integer head_dim attribute to size a probe by"
        if why is None:
            ours = ours or _kbuild_rope()
            stock = inner.__globals__[NAME]
            key = (stock, D, *at)
            if key not in verdicts:
                verdicts[key] = _verdict(stock, ours, D, dims, *at)
            why = verdicts[key]
        if why is not None:
            report.keep(path, "rope", why)
            continue
        outer = type(module).forward
        if outer not in rebuilt:
            rebuilt[outer] = bind.rewrapped(outer, bind.with_globals(inner, {NAME: ours}))
        if isinstance(rebuilt[outer], str):
            report.keep(path, "rope", rebuilt[outer])
            continue
        report.add(Swap(path, "rope", "rope"), bind.bind(module, rebuilt[outer], "rope"))
