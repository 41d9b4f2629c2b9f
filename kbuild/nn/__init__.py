"""Drop-in replacements for torch.nn.RMSNorm and torch.nn.LayerNorm on kbuild's kernels, and
GPT-2's layers from llm.c: `Linear` (kbuild's bias gradient) and `GPT2Embedding`.

They subclass the torch modules, so constructor arguments, parameters, initialisation,
state_dict keys and repr are torch's own: a checkpoint loads into either class unchanged.
Only `forward` differs. kbuild normalises over the last dimension only, so a
`normalized_shape` of more than one dimension raises ValueError at construction.

`swap_norms(model)` replaces a model's torch and Hugging Face style norms by these modules in
place, each class after a numerical check that its math is kbuild's. `patch(model)` does that
and more for a Hugging Face causal LM: its MLP activation, rotary embedding and loss too
(kbuild/nn/patching). `CrossEntropyLoss` and `LinearCrossEntropy` are the losses as modules.
"""

from .modules import CrossEntropyLoss, GPT2Embedding, LayerNorm, Linear, LinearCrossEntropy, RMSNorm
from .patching import patch
from .patching.norms import swap_norms

__all__ = [
    "CrossEntropyLoss",
    "GPT2Embedding",
    "LayerNorm",
    "Linear",
    "LinearCrossEntropy",
    "RMSNorm",
    "patch",
    "swap_norms",
]
