"""kbuild.nn's modules: RMSNorm and LayerNorm (torch's, computed by kbuild's kernels), GPT-2's
Linear and GPT2Embedding from llm.c, and the losses CrossEntropyLoss and LinearCrossEntropy
(the package docstring says what each keeps of torch's)."""

from __future__ import annotations

import torch
from torch.nn import Module

from ..kernels.llmc.op import encoder, linear
from ..kernels.norms.api import layernorm, rmsnorm

FP32_EPS = torch.finfo(torch.float32).eps  # kbuild computes in fp32 whatever the I/O dtype


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
        eps = self.eps if self.eps is not None else FP32_EPS
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
    gradient; see kbuild/kernels/loss/cross_entropy.py): input (N, C) or (C,), target class ids (N,)
    or (). `ignore_index`, `reduction` and `label_smoothing` are torch's; `lse_square_scale` adds
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
        from ..kernels.loss.cross_entropy import cross_entropy

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
    never holds the logits of all tokens (kbuild/kernels/loss/linear.py). Its `weight` (V, H)
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
        from ..kernels.loss.linear import linear_cross_entropy

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
