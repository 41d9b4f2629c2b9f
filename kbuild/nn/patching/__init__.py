"""kbuild's ops in a Hugging Face causal LM, in place, one module object at a time:
`patch(model)` -> PatchReport.

Unlike Liger's `apply_liger_kernel_to_*`, which replace classes and functions of a modeling
module for the whole process, every swap here is made on this model's own module objects
(norm modules replaced, forwards bound to instances, GPT-2's activation submodule replaced),
so another model of the same class keeps the stock code; and every swap is decided by a
numerical check on the module's own device and dtype, stock against kbuild on a probe, the
module kept stock (and the reason reported) where they differ:

  norms  kbuild.nn.swap_norms: RMSNorm (Gemma's 1 + weight as offset=1.0) and LayerNorm
  mlp    gated MLPs onto kbuild's swiglu / geglu(tanh), GPT-2's gelu_new onto gelu(tanh)
         (kbuild/nn/patching/mlp.py)
  rope   attention forwards calling apply_rotary_pos_emb onto kbuild's rope
         (kbuild/nn/patching/rope.py)
  loss   with labels, the CausalLM's loss by kbuild's fused linear cross-entropy, logits not
         built nor returned (kbuild/nn/patching/loss.py)

Families written for and tested: Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 (text),
Phi-3, GPT-2 (transformers 5). Other models get whatever passes the checks (the loss only for
those families). Parameters, state_dict keys and tied weights are unchanged. The kbuild ops
are imported only when a swap needs them.
"""

from __future__ import annotations

import torch

from .loss import causal_lm_loss, patch_loss
from .mlp import TanhGELU, patch_mlps
from .norms import patch_norms
from .report import Kept, PatchReport, Swap
from .rope import patch_rope

__all__ = ["Kept", "PatchReport", "Swap", "TanhGELU", "causal_lm_loss", "patch"]


def patch(
    model: torch.nn.Module,
    norms: bool = True,
    rope: bool = True,
    mlp: bool = True,
    loss: bool | str = True,
) -> PatchReport:
    """Put kbuild's ops into `model` in place (module docstring) and report what was patched
    and what was left stock and why; `report.unpatch()` restores the model.

    Each flag turns one kind of swap on or off; `loss="low_memory"` takes the fused loss in
    its least memory, slower (kbuild/nn/patching/loss.py). Every swap is instance-level. A second
    call patches nothing more (the modules say they are already kbuild's). Models on the meta
    device, or in dtypes kbuild does not compute in, are left stock (nothing to check on).

    With `loss`, a forward given labels in training (train mode, grad enabled) returns
    `logits=None` (the fused loss never builds them); call without labels, in eval mode or
    under no_grad for logits. Gradients of the loss reach every parameter as stock's do. The
    patched model's `forward` has stock's signature."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, flag in dict(norms=norms, rope=rope, mlp=mlp).items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if not isinstance(loss, bool) and loss != "low_memory":
        raise TypeError(f'loss must be a bool or "low_memory", got {loss!r}')
    report = PatchReport(type(model).__name__)
    if norms:
        patch_norms(model, report)
    if mlp:
        patch_mlps(model, report)
    if rope:
        patch_rope(model, report)
    if loss:
        patch_loss(model, report, low_memory=loss == "low_memory")
    return report
