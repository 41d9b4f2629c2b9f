"""MLPs onto kbuild's fused activations, one instance at a time.

Three forms are recognised by their submodules, then checked by numbers:
  gated  (Llama, Mistral, Qwen2/3, Gemma 1/2/3): down_proj(act_fn(gate_proj(x)) * up_proj(x))
  fused  (Phi-3): gate, up = gate_up_proj(x).chunk(2); down_proj(up * activation_fn(gate))
  gpt2   (GPT-2): c_proj(act(c_fc(x))), then dropout
The gated forms get a forward calling kbuild's swiglu (act silu) or geglu (act tanh-GELU)
between the same projections; GPT-2's `act` submodule becomes `TanhGELU` (kbuild's gelu).

Which op, if any: first the activation alone in fp32 on the module's device over [-10, 10]
(`check.ACT_TOL`: tanh-GELU is not erf-GELU), cached per activation class; then each MLP
instance, stock forward against patched, on a 4-row probe in its own dtype, in eval mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import bind, check
from .report import PatchReport, Swap


class TanhGELU(torch.nn.Module):
    """GELU's tanh form (GPT-2's gelu_new, gelu_pytorch_tanh) by
    kbuild.kernels.activations.op.gelu."""

    def __init__(self):
        super().__init__()
        from ...kernels.activations.op import gelu

        self._gelu = gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gelu(x, approximate="tanh")

    def extra_repr(self) -> str:
        return "kbuild"


# form: (submodules, the activation's attribute names)
_FORMS = {
    "gated": (("gate_proj", "up_proj", "down_proj"), ("act_fn", "activation_fn")),
    "fused": (("gate_up_proj", "down_proj"), ("act_fn", "activation_fn")),
    "gpt2": (("c_fc", "c_proj"), ("act",)),
}


def _form(module: torch.nn.Module) -> tuple[str, str] | None:
    """(form, activation attribute) where `module` has the submodules of one form."""
    for form, (parts, acts) in _FORMS.items():
        if all(isinstance(getattr(module, p, None), torch.nn.Module) for p in parts):
            act = next((a for a in acts if callable(getattr(module, a, None))), None)
            if act is not None:
                return form, act
    return None


def _gated_ops() -> list[tuple[str, Callable]]:
    """(what, op(gate, up=None)) for the gated forms, in the order they are tried."""
    from ...kernels.activations.op import geglu, swiglu

    def geglu_tanh(gate, up=None):
        return geglu(gate, up, approximate="tanh")

    return [("swiglu", swiglu), ("geglu(tanh)", geglu_tanh)]


def _act_probe(device) -> tuple[torch.Tensor, torch.Tensor]:
    g = check.generator(5)
    z = torch.cat([torch.linspace(-10, 10, 129)[:128], 3 * torch.randn(128, generator=g)])
    u = torch.randn(256, generator=g)
    return z.view(4, 64).to(device), u.view(4, 64).to(device)


def _reading(act, form: str, device) -> tuple[str, Callable] | str:
    """(what, op) whose math is act's, in fp32 on `device`, or why none is."""
    if isinstance(act, torch.nn.Module) and next(act.parameters(), None) is not None:
        return f"its activation {type(act).__name__} has parameters"
    z, u = _act_probe(device)
    if form == "gpt2":
        from ...kernels.activations.op import gelu

        def gelu_tanh(x):
            return gelu(x, approximate="tanh")

        why = check.compare(lambda: act(z), lambda: gelu_tanh(z), check.ACT_TOL, scaled=False)
        return ("gelu(tanh)", gelu_tanh) if why is None else f"act is not tanh-GELU: {why}"
    whys = []
    for what, op in _gated_ops():
        why = check.compare(lambda: act(z) * u, lambda op=op: op(z, u), check.ACT_TOL, scaled=False)
        if why is None:
            return what, op
        whys.append(f"{what}: {why}")
    return f"its activation {type(act).__name__} is neither silu nor tanh-GELU ({'; '.join(whys)})"


def _gated_forward(op: Callable) -> Callable:
    def forward(self, x):
        return self.down_proj(op(self.gate_proj(x), self.up_proj(x)))

    return forward


def _fused_forward(op: Callable) -> Callable:
    def forward(self, x):
        return self.down_proj(op(self.gate_up_proj(x)))

    return forward


def _width(module: torch.nn.Module, form: str) -> int | None:
    first = getattr(module, _FORMS[form][0][0])
    if isinstance(first, torch.nn.Linear):
        return first.in_features
    weight = getattr(first, "weight", None)  # transformers' Conv1D: weight (in, out)
    return weight.shape[0] if isinstance(weight, torch.Tensor) and weight.ndim == 2 else None


def _patch_one(module, path: str, form: str, act_name: str, readings: dict, report) -> str | None:
    """Patch one MLP or say why not."""
    at = check.where(module)
    if isinstance(at, str):
        return at
    device, dtype = at
    if (why := bind.refusal(module)) is not None:
        return why
    width = _width(module, form)
    if width is None:
        return f"{_FORMS[form][0][0]} has no 2-D weight to size a probe by"
    act = getattr(module, act_name)
    key = (form == "gpt2", device) + (
        (type(act), repr(act)) if isinstance(act, torch.nn.Module) else (act,)
    )
    if key not in readings:
        readings[key] = _reading(act, form, device)
    reading = readings[key]
    if isinstance(reading, str):
        return reading
    what, op = reading
    x = torch.randn(4, width, generator=check.generator(6)).to(device=device, dtype=dtype)
    stock = type(module).forward
    if form == "gpt2":
        if isinstance(act, TanhGELU):
            return "already patched by kbuild (mlp gelu(tanh))"
        if not isinstance(act, torch.nn.Module) or act._forward_hooks or act._forward_pre_hooks:
            return "act is not a hook-free module to replace"
        new = TanhGELU().train(act.training)

        def with_new():
            setattr(module, act_name, new)
            try:
                return stock(module, x)
            finally:
                setattr(module, act_name, act)

        with check.evaluating(module):
            why = check.compare(lambda: stock(module, x), with_new, check.TOL[dtype])
        if why is not None:
            return why
        setattr(module, act_name, new)
        report.add(Swap(path, "mlp", what), lambda: setattr(module, act_name, act))
        return None
    forward = (_gated_forward if form == "gated" else _fused_forward)(op)
    with check.evaluating(module):
        why = check.compare(lambda: stock(module, x), lambda: forward(module, x), check.TOL[dtype])
    if why is not None:
        return why
    report.add(Swap(path, "mlp", what), bind.bind(module, forward, f"mlp {what}"))
    return None


def patch_mlps(model: torch.nn.Module, report: PatchReport) -> None:
    """Every MLP of a recognised form in `model`, each after its check (module docstring)."""
    readings: dict = {}
    for path, module in model.named_modules():
        found = _form(module)
        if found is None:
            continue
        why = _patch_one(module, path, *found, readings, report)
        if why is not None:
            report.keep(path, "mlp", why)
