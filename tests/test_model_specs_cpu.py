"""`kbuild warmup --model config.json`: the kernels a Hugging Face model launches, read from its
config file alone, for each family's particulars (GPT-2's LayerNorm and GELU, Gemma's weight
offset and GeGLU, Qwen3's QK-norm, partial rotary, a multimodal config's text part), and its
one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LLAMA = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
         "hidden_act": "silu"}  # fmt: skip
GEMMA2 = {"model_type": "gemma2", "hidden_size": 2304, "intermediate_size": 9216,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
          "vocab_size": 256000, "hidden_activation": "gelu_pytorch_tanh",
          "final_logit_softcapping": 30.0}  # fmt: skip
QWEN3 = {"model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144,
         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
         "vocab_size": 151936, "hidden_act": "silu"}  # fmt: skip
PHI = {"model_type": "phi", "hidden_size": 2560, "intermediate_size": 10240,
       "num_attention_heads": 32, "vocab_size": 51200, "hidden_act": "gelu",
       "partial_rotary_factor": 0.4}  # fmt: skip
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "vocab_size": 50257,
        "activation_function": "gelu_new"}  # fmt: skip


def _specs(config, dtype="bf16"):
    from kbuild.cli.model_specs import model_specs

    return model_specs(config, dtype)


def _by_kernel(specs):
    out: dict[str, list] = {}
    for s in specs:
        out.setdefault(s.kernel, []).append(dict(s.params))
    return out


def test_llama_norms_rope_swiglu_and_its_vocabulary():
    k = _by_kernel(_specs(LLAMA))
    assert {p["N"] for p in k["rmsnorm_fwd"]} == {4096}
    assert all(p.get("offset", 0.0) == 0.0 for p in k["rmsnorm_fwd"])
    assert {(p["D"], p["rd"]) for p in k["rope"]} == {(128, 128)}
    # 64: the patch's activation check, an fp32 probe (kbuild/nn/patching/mlp.py)
    assert {p["N"] for p in k["swiglu_fwd"]} == {14336, 64} and "geglu_fwd" not in k
    assert {p["N"] for p in k["cross_entropy_fwd"]} == {128256}
    assert {p["softcap"] for p in k["cross_entropy_fwd"]} == {False, True}
    assert "layernorm_fwd" not in k


def test_gemma2_offset_geglu_tanh_and_head_dim():
    k = _by_kernel(_specs(GEMMA2))
    # offset 0: the norm check's first reading of Gemma's norm, inference forward only
    offsets = {(p.get("offset", 0.0), p["store_rstd"]) for p in k["rmsnorm_fwd"]}
    assert offsets == {(1.0, False), (1.0, True), (0.0, False)}
    assert {(p["D"], p["rd"]) for p in k["rope"]} == {(256, 256)}
    assert {(p["N"], p["tanh"]) for p in k["geglu_fwd"]} == {(9216, True), (64, True)}
    assert {p["N"] for p in k["cross_entropy_fwd"]} == {256000}


def test_qwen3_has_its_qk_norm_and_llama_has_none():
    widths = {p["N"] for p in _by_kernel(_specs(QWEN3))["rmsnorm_fwd"]}
    assert widths == {2048, 128}
    assert {p["N"] for p in _by_kernel(_specs(LLAMA))["rmsnorm_fwd"]} == {4096}


def test_partial_rotary_and_erf_gelu():
    k = _by_kernel(_specs(PHI))
    # (80, 80): the rotary check probes head_dim too, forward only
    assert {(p["D"], p["rd"], p["inverse"]) for p in k["rope"]} == {
        (80, 32, False), (80, 32, True), (80, 80, False)}  # fmt: skip
    # the activation check's fp32 probe tries geglu(tanh) after swiglu
    assert {(p["N"], p["tanh"]) for p in k["geglu_fwd"]} == {(10240, False), (64, True)}


def test_gpt2_layernorm_encoder_bias_grads_and_gelu():
    k = _by_kernel(_specs(GPT2))
    assert {p["N"] for p in k["layernorm_fwd"]} == {768}
    assert "encoder_fwd" in k and "bias_grad" in k and "rope" not in k
    assert {(p["N"], p["tanh"]) for p in k["gelu_fwd"]} == {(3072, True), (64, True)}


def test_the_dtype_is_every_kernels():
    specs = _specs(LLAMA, "f16")
    # but the activation check's probe, fp32 whatever the model's dtype
    probes = {s for s in specs if dict(s.params).get("N") == 64}
    assert {dict(s.params).get("dtype") for s in probes} == {"f32"}
    assert {dict(s.params).get("dtype") for s in specs if s not in probes} - {None} == {"f16"}


def test_a_multimodal_configs_text_part(tmp_path):
    from kbuild.cli.model_specs import read_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gemma3", "text_config": {**GEMMA2,
                                "model_type": "gemma3_text"}}))  # fmt: skip
    config = read_config(str(path))
    assert config["hidden_size"] == 2304 and config["model_type"] == "gemma3_text"
    widths = {p["N"] for p in _by_kernel(_specs(config))["rmsnorm_fwd"]}
    assert widths == {2304, 256}  # Gemma 3's QK-norm


@pytest.mark.parametrize(
    "text,message",
    [
        (None, "no such file"),
        ("{not json", "not a JSON config"),
        ('{"model_type": "llama"}', "the config has no hidden_size"),
        (json.dumps({**LLAMA, "hidden_act": "relu"}), "hidden_act 'relu'"),
        (json.dumps({**LLAMA, "hidden_size": "4096"}), "hidden_size must be an int"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, text, message):
    path = tmp_path / "config.json"
    if text is not None:
        path.write_text(text)
    cmd = [sys.executable, "-m", "kbuild", "warmup", "--model", str(path), "--cache-dir",
           str(tmp_path / "c")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert r.stderr.startswith(f"kbuild warmup: --model {path}")
