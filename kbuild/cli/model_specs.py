"""Every kernel a Hugging Face model's training and inference steps launch, from its config file:
`kbuild warmup --model config.json` (no download, no transformers: the JSON is read as it is).

    specs = model_specs(read_config("config.json"), "bf16")

What a model launches once kbuild.nn.patch has put kbuild into it (kbuild/nn/patching/):
- the norms at its width (RMSNorm and the fused add + RMSNorm; Gemma's weight offset 1.0;
  LayerNorm, the embedding and the bias gradients for GPT-2) and a QK-norm over heads where
  the family has one (Qwen3, Gemma 3, OLMo 2);
- rotary embedding of q and k (Hq, Hk heads of head_dim, partial rotary where
  `partial_rotary_factor` says), on dense q / k and on views of a fused qkv projection, cos /
  sin in the model's dtype and in fp32;
- the MLP's activation at the intermediate size: SwiGLU (silu), GeGLU (gelu_pytorch_tanh,
  gelu_new: tanh; gelu: erf), GPT-2's GELU (tanh) at 4 x hidden;
- the cross-entropy kernels of its vocabulary (kbuild.cross_entropy and the fused linear
  cross-entropy: the same kernels), with Gemma 2's soft cap among them;
- what the patch's checks launch on their probes (`probe_specs`).
Norms at the config's eps (rms_norm_eps, GPT-2's layer_norm_epsilon). Families patch swaps only
the norms of (BERT's LayerNorms, T5's RMSNorms: `NORMS_ONLY`) warm those alone, and say so; a
config of another family without rms_norm_eps is refused (patch would swap nothing known).
Importing this module imports torch (the op modules' spec helpers take meta tensors).
"""

from __future__ import annotations

import json

from ..registry import OWN_MODULES
from ..spec import KernelSpec
from .widths import for_width

# The modules whose kernels a model's specs name (the warmup workers import them).
KERNEL_MODULES = OWN_MODULES  # kbuild's kernels outside the table (warmup's workers import)
QK_NORM = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text", "olmo2")
GEMMA = ("gemma", "gemma2", "gemma3", "gemma3_text")
TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_tanh")
GATES = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", **dict.fromkeys(TANH, "geglu")}
# Families whose norms, rotary embedding and MLP activation (and loss) patch swaps.
WHOLE = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi", "phi3", "gpt2", *GEMMA, *QK_NORM})
# Families kbuild.nn.patch swaps only the norms of (no MLP form, rotary call or causal LM head
# it knows): model_type -> (the norm kbuild's check takes it for, the config's eps fields).
# T5's T5LayerNorm is an RMSNorm (no mean, no bias).
NORMS_ONLY = {
    "bert": ("layernorm", ("layer_norm_eps",)),
    "roberta": ("layernorm", ("layer_norm_eps",)),
    "xlm-roberta": ("layernorm", ("layer_norm_eps",)),
    "electra": ("layernorm", ("layer_norm_eps",)),
    "t5": ("rmsnorm", ("layer_norm_epsilon",)),
    "mt5": ("rmsnorm", ("layer_norm_epsilon",)),
}


def read_config(path: str) -> dict:
    """A config.json as a dict (a multimodal config's `text_config` where it has one);
    ValueError naming the file for anything unreadable."""
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a JSON config ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a config is a JSON object")
    text = config.get("text_config")
    if isinstance(text, dict):
        config = {**text, "model_type": text.get("model_type", config.get("model_type"))}
    return config


def _field(config: dict, *names: str, default=None, what: str = "int"):
    for name in names:
        if config.get(name) is not None:
            value = config[name]
            if what == "int" and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an int; the config has {value!r}")
            return value
    if default is None:
        raise ValueError(f"the config has no {' / '.join(names)}")
    return default


def model_specs(config: dict, dtype: str = "bf16") -> list[KernelSpec]:
    """The kernels of `config`'s model in `dtype` ("bf16", "f16", "f32"): the module
    docstring's list, each once."""
    return model_plan(config, dtype)[0]


def model_plan(config: dict, dtype: str = "bf16") -> tuple[list[KernelSpec], str | None]:
    """(model_specs, what of the model kbuild.nn.patch leaves stock, or None where it patches
    the whole family). ValueError for a config of whose model patch would swap nothing kbuild
    knows to warm (a model_type neither written for nor with a norm it takes)."""
    import torch

    from ..kernels.activations import op as activations
    from ..kernels.loss.kernels import vocab_specs
    from ..kernels.rope import op as rope

    torch_dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype]
    family = str(config.get("model_type") or "")
    H = _field(config, "hidden_size", "n_embd", "d_model")
    if family in NORMS_ONLY:
        norm, eps_fields = NORMS_ONLY[family]
        eps = _field(config, *eps_fields, default=1e-12, what="float")
        specs = for_width(H, dtype, ops=(norm,), **{"ln_eps" if norm == "layernorm" else
                                                    "rms_eps": eps})  # fmt: skip
        what = "LayerNorms" if norm == "layernorm" else "RMSNorms"
        return list(dict.fromkeys(specs)), (
            f"{family}: kbuild.nn.patch swaps its {what} only (warmed); its MLPs, attention "
            "and loss stay stock"
        )
    if family not in WHOLE and "rms_norm_eps" not in config:
        known = sorted({*WHOLE, *NORMS_ONLY})
        raise ValueError(
            f"model_type {family!r}: kbuild.nn.patch would swap nothing warmup --model knows "
            f"for it (configs it reads: {', '.join(known)}, or any with rms_norm_eps)"
        )
    V = _field(config, "vocab_size")
    if family == "gpt2":  # LayerNorm, learned positions, GELU (tanh), tied head
        ln_eps = _field(config, "layer_norm_epsilon", "layer_norm_eps", default=1e-5, what="float")
        specs = for_width(H, dtype, ops=("layernorm", "encoder", "linear"), ln_eps=ln_eps)
        specs += probe_specs(family, H, dtype)
        inner = _field(config, "n_inner", default=4 * H)
        x = torch.empty(1, inner, dtype=torch_dtype, device="meta")
        gelu = activations.GELU
        both = gelu.kernel_values(x, True) + gelu.backward.kernel_values(x, x, True)
        specs += [k.spec(*values) for k, values in both]
        return list(dict.fromkeys(specs + vocab_specs(V, (dtype,)))), None
    heads = _field(config, "num_attention_heads", "n_head")
    kv = _field(config, "num_key_value_heads", default=heads)
    D = _field(config, "head_dim", default=H // heads)
    factor = _field(config, "partial_rotary_factor", default=1.0, what="float")
    rd = int(D * factor) // 2 * 2
    eps = _field(config, "rms_norm_eps", default=1e-6, what="float")  # Llama-3, Phi-3: 1e-5
    specs = for_width(H, dtype, ops=("rmsnorm", "fused_add_rmsnorm"), rms_eps=eps,
                      rms_offset=1.0 if family in GEMMA else 0.0,
                      head_dim=D if family in QK_NORM else None)  # fmt: skip
    for cs in dict.fromkeys((torch_dtype, torch.float32)):
        for fused in (False, True):
            case = (1, 8, heads, kv, D, rd, torch_dtype, cs, False, 1, fused)
            specs += rope.specs_for(*rope.case_tensors(case, "meta"), False, 1)
    # Gemma's modeling reads hidden_activation (hidden_act is its deprecated name)
    act = str(_field(config, "hidden_activation", "hidden_act", default="silu", what="str"))
    gate = GATES.get(act)
    if gate is None:
        raise ValueError(f"hidden_act {act!r}: kbuild's MLP activations are {sorted(GATES)}")
    inner = _field(config, "intermediate_size")
    specs += activations.gated_specs(gate, inner, torch_dtype,
                                     None if gate == "swiglu" else act in TANH)  # fmt: skip
    specs += probe_specs(family, H, dtype, eps, act, D, rd)
    return list(dict.fromkeys(specs + vocab_specs(V, (dtype,)))), None


def probe_specs(family: str, H: int, dtype: str, eps: float = 1e-6, act: str = "silu",
                D: int = 0, rd: int = 0) -> list[KernelSpec]:  # fmt: skip
    """What kbuild.nn.patch's checks launch beyond the model's steps, on the probes the
    checks themselves build (kbuild/nn/modules.py, kbuild/nn/patching/): the norm check's inference
    forward for each reading of the module's math it tries in turn (offset 0, then Gemma's
    1: a Gemma norm, QK-norms included, launches both); the activation check's fp32 probe,
    forward only, for each op tried until one agrees (swiglu, then geglu(tanh); GPT-2's
    gelu(tanh)); the rotary check's probe at each rotary dim it tries (the model's and
    head_dim), forward only (checks run under no_grad)."""
    import torch

    from ..kernels.activations import op as activations
    from ..kernels.rope import op as rope
    from ..nn.patching import mlp as mlp_check
    from ..nn.patching import rope as rope_check
    from .widths import rmsnorm_fwd_spec

    z, u = mlp_check._act_probe("meta")
    if family == "gpt2":
        return [k.spec(*values) for k, values in activations.GELU.kernel_values(z, True)]
    torch_dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[dtype]
    specs = []
    for gate in ("swiglu",) if GATES.get(act) == "swiglu" else ("swiglu", "geglu"):
        dense = activations.FAMILIES[gate][0]
        tanh = () if gate == "swiglu" else (True,)
        specs += [k.spec(*values) for k, values in dense.kernel_values(z, u, *tanh)]
    if family in GEMMA:
        for n in (H, D) if family in QK_NORM else (H,):
            specs.append(rmsnorm_fwd_spec(n, dtype, dtype, False, eps))
    for R in sorted({r for r in (rd, D) if 0 < r <= D and r % 2 == 0}):
        specs.append(rope.specs_for(*rope_check._probe(D, R, "meta", torch_dtype))[0])
    return specs


def config_specs(path: str, dtype: str) -> list[KernelSpec]:
    """model_specs of the config file at `path` (ValueError naming it)."""
    return config_plan(path, dtype)[0]


def config_plan(path: str, dtype: str) -> tuple[list[KernelSpec], str | None]:
    """model_plan of the config file at `path` (ValueError naming it)."""
    try:
        return model_plan(read_config(path), dtype)
    except ValueError as err:
        text = str(err)
        raise ValueError(text if text.startswith(path) else f"{path}: {text}") from None
