"""A causal LM's training loss by kbuild's fused linear cross-entropy, the logits never built.

The CausalLM instance gets a forward that, given `labels`, runs the base model (`model.model`,
GPT-2's `model.transformer`) with every other argument as the stock forward passes them, then
`causal_lm_loss` on the last hidden states and `lm_head`'s weight: Hugging Face's
ForCausalLMLoss (labels shifted left, -100 padded; `shift_labels`, `ignore_index` and
`num_items_in_batch` from the keyword arguments as there), with Gemma 2/3's
`config.final_logit_softcapping`. In training (train mode, grad enabled) it returns the stock
output class with `logits=None`: the logits are not returned when labels are (as Liger's fused
loss does); `return_dict=False` gives stock's tuple, None in the logits' slot. Without labels,
in eval mode or under no_grad (Trainer's prediction step, which wants the logits), it is the
stock forward, unchanged. Its signature is stock's (`inspect.signature`). Labels are not
checked against the vocabulary on the device (`check_targets=False`: stock's loss does not
check them, and a check costs every step a copy of a flag to the host); a label outside it
adds nothing to the loss, as -100 would.

Memory against time. By default the loss's chunks of tokens hold logits up to a quarter of
the head's weight (or 256 MiB; kbuild/kernels/loss/linear.py's chunk_rows): its time is then
about the unfused path's, its memory a small part of it. `patch(model, loss="low_memory")`
asks for the least memory instead: chunks whose logits take at most the hidden states' bytes,
as Liger's do, at the cost of one more read and write of d(weight) per chunk (more chunks:
at the Gemma 2 head 128 of them took twice Liger's time on an H100, 2026-12-07). The report
names the choice.

Only families whose CausalLM forward is exactly lm_head, optional softcap, ForCausalLMLoss are
taken (`FAMILIES`): a family that adds to the loss (MoE router losses) or scales its logits
might pass a check on random weights. The check: stock forward and patched on a probe batch
with labels (some -100), in eval mode, their losses compared.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from . import bind, check
from .report import PatchReport, Swap

# model_type -> (the base model's attribute, whether final_logit_softcapping applies)
FAMILIES = {
    "llama": ("model", False),
    "mistral": ("model", False),
    "qwen2": ("model", False),
    "qwen3": ("model", False),
    "gemma": ("model", False),
    "gemma2": ("model", True),
    "gemma3_text": ("model", True),
    "phi3": ("model", False),
    "gpt2": ("transformer", False),
}


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
    low_memory: bool = False,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss of logits = softcap(hidden @ weight.T + bias), computed
    by kbuild.kernels.loss.linear.linear_cross_entropy without the logits.

    hidden (B, T, H) any float dtype; weight (V, H); labels (B, T) ids (ignored where
    `shift_labels` (B, T) is given: the targets as they are). Targets are labels shifted left by
    one, the last position `ignore_index`. The mean over targets that are not ignore_index, or
    with `num_items_in_batch` the sum divided by it (gradient accumulation across batches).
    `low_memory`: chunks whose logits take at most hidden's bytes (as Liger's), slower than the
    default chunks where the head is large (module docstring). Returns a 0-d fp32 loss; the
    gradient flows to hidden, weight and bias."""
    from ...kernels.loss.linear import linear_cross_entropy

    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(hidden.device)
    h = hidden.reshape(-1, hidden.shape[-1])
    reduction = "mean" if num_items_in_batch is None else "sum"
    budget = h.numel() * h.element_size() if low_memory else None
    loss = linear_cross_entropy(h, weight, target, bias, ignore_index=ignore_index,
                                reduction=reduction, softcap=softcap, check_targets=False,
                                memory_budget=budget)  # fmt: skip
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _forward(stock, names: tuple[str, ...], base: str, softcap: bool, output, low_memory: bool):
    """(the patched CausalLM forward, its fused path) (module docstring); `names`: stock's
    positional names. The forward shows stock's signature (`inspect.signature`), which
    Trainer's remove_unused_columns reads to keep the columns the model takes."""
    labels_at = names.index("labels")

    def fused(self, *args, **kwargs):
        labels = args[labels_at] if len(args) > labels_at else kwargs.get("labels")
        if len(args) > len(names):
            raise TypeError(f"forward takes {len(names)} positional arguments, got {len(args)}")
        kwargs.update(zip(names, args, strict=False))
        del kwargs["labels"]
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        logits_to_keep = kwargs.pop("logits_to_keep", 0)
        outputs = getattr(self, base)(**kwargs)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        head = self.lm_head
        loss = causal_lm_loss(
            outputs.last_hidden_state[:, keep, :],
            head.weight,
            labels,
            head.bias,
            self.config.final_logit_softcapping if softcap else None,
            kwargs.get("ignore_index", -100),
            kwargs.get("num_items_in_batch"),
            kwargs.get("shift_labels"),
            low_memory,
        )
        fields = {f: getattr(outputs, f, None) for f in output.__dataclass_fields__}
        fields.update(loss=loss, logits=None)
        if return_dict:
            return output(**fields)
        # stock's to_tuple() leaves out None fields; its logits never are None, so their slot
        # stays (None here) and `loss, logits, *rest = out` unpacks as it does for stock
        return tuple(v for f, v in fields.items() if v is not None or f == "logits")

    def forward(self, *args, **kwargs):
        labels = args[labels_at] if len(args) > labels_at else kwargs.get("labels")
        if labels is None or not (self.training and torch.is_grad_enabled()):
            return stock(self, *args, **kwargs)  # evaluation wants the logits: stock's
        return fused(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(stock)
    forward.__doc__ = stock.__doc__
    return forward, fused


def _refusal(model: torch.nn.Module) -> str | None:
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in FAMILIES:
        return f"family {family!r} is not one whose CausalLM forward kbuild's loss replicates"
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    # model.loss_function as PreTrainedModel resolves it, without its warning for loss_type None
    chosen = getattr(model, "_loss_function", None)
    if chosen is None:
        chosen = LOSS_MAPPING.get(getattr(model, "loss_type", None), ForCausalLMLoss)
    if chosen is not ForCausalLMLoss:
        return "its loss_function is not transformers' ForCausalLMLoss"
    head = model.lm_head
    if type(head) is not torch.nn.Linear or head._forward_hooks or head._forward_pre_hooks:
        return "lm_head is not a hook-free torch.nn.Linear"
    if not isinstance(getattr(model, FAMILIES[family][0], None), torch.nn.Module):
        return f"no base model at .{FAMILIES[family][0]}"
    return bind.refusal(model)


def _probe_check(model, fused, dtype) -> str | None:
    embed = model.get_input_embeddings()
    vocab = min(embed.weight.shape[0], model.lm_head.out_features)
    ids = torch.randint(0, vocab, (2, 8), generator=check.generator(8))
    labels = ids.clone()
    labels[0, 2:4] = -100
    ids, labels = ids.to(embed.weight.device), labels.to(embed.weight.device)
    stock = type(model).forward
    with check.evaluating(model):
        return check.compare(
            lambda: stock(model, input_ids=ids, labels=labels, use_cache=False).loss,
            lambda: _training_loss(fused, model, ids, labels),
            check.TOL[dtype],
        )


def patch_loss(model: torch.nn.Module, report: PatchReport, low_memory: bool = False) -> None:
    """Every CausalLM in `model` (a module with `lm_head`) of a family in FAMILIES, after the
    check (module docstring); `low_memory`: causal_lm_loss's."""
    for path, module in model.named_modules():
        if not isinstance(getattr(module, "lm_head", None), torch.nn.Module):
            continue
        why = _refusal(module)
        at = check.where(module.lm_head)
        why = why or (at if isinstance(at, str) else None)
        if why is None:
            from transformers.modeling_outputs import (
                CausalLMOutputWithCrossAttentions,
                CausalLMOutputWithPast,
            )

            base, softcap = FAMILIES[module.config.model_type]
            output = (
                CausalLMOutputWithCrossAttentions
                if base == "transformer"
                else CausalLMOutputWithPast
            )
            stock = type(module).forward
            params = inspect.signature(stock).parameters.values()
            names = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)[1:]
            if "labels" not in names or "logits_to_keep" not in names:
                why = "its forward takes no labels or logits_to_keep"
            else:
                forward, fused = _forward(stock, names, base, softcap, output, low_memory)
                why = _probe_check(module, fused, at[1])
        if why is not None:
            report.keep(path, "loss", why)
            continue
        cap = module.config.final_logit_softcapping if softcap else None
        options = [f"softcap={cap:g}"] if cap else []
        options += ["low_memory"] if low_memory else []
        what = "linear_cross_entropy" + (f"({', '.join(options)})" if options else "")
        report.add(Swap(path, "loss", what), bind.bind(module, forward, f"loss {what}"))


def _training_loss(fused, model, ids, labels) -> torch.Tensor:
    """The fused path's loss as training takes it (grad enabled), for the check, which runs in
    eval mode."""
    with torch.enable_grad():
        return fused(model, input_ids=ids, labels=labels, use_cache=False).loss.detach()
