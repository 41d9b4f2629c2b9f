"""The warm lists hold what the code launches: each kernel an H100 run found missing from the
cache warmed by bench/gpu_prepare.sh (`--manifest tests`, the modules' warmup_specs(),
`kbuild warmup --model`; ../shared/measurements/2026-12-07/kernels_not_cached.txt), by the
label the KernelNotCached error gave, is in the list that should have warmed it.

What each catches: the tests' patched Hugging Face models (tests/test_patch_gpu.py: width 256,
Phi-3's eps 1e-5, GPT-2's LayerNorm) left out of `--manifest tests`; the patch checks' fp32
activation probe and Gemma's offset-0 norm reading left out of `--model`; a config's
rms_norm_eps ignored (Llama-3's 1e-5 inference forward); QK-norm + RoPE's inference forward
(no rstd stored) left out of its module's list; bench_rows' check widths left out of its own.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from kbuild.cases import (
    PATCH_CAP,
    PATCH_HEAD_DIM,
    PATCH_INTER,
    PATCH_KINDS,
    PATCH_MEMORY_VOCAB,
    PATCH_VOCAB,
    PATCH_WIDTH,
)
from kbuild.cli.manifest import manifest
from kbuild.cli.model_specs import model_specs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def labels(specs) -> set[str]:
    return {s.short() for s in specs}


@pytest.fixture(scope="module")
def tests_manifest() -> set[str]:
    return labels(manifest("tests"))


def test_the_patched_test_models_are_in_the_tests_manifest(tests_manifest):
    pytest.importorskip("transformers")
    for missed in (
        # GPT-2 at width 256 (test_patch_gpu), inference forward
        "layernorm_fwd(N=256, bias_dtype=bf16, dtype=bf16, eps=1e-05, store_stats=False, "
        "vectorize=True, weight_dtype=bf16)",
        # Phi-3's rms_norm_eps 1e-5 at width 256
        "rmsnorm_fwd(N=256, dtype=bf16, eps=1e-05, store_rstd=False, vectorize=True, "
        "weight_dtype=bf16)",
        # the activation check's fp32 probe
        "swiglu_fwd(N=64, dtype=f32, vectorize=True)",
    ):
        assert missed in tests_manifest, missed


def test_the_tests_manifest_holds_every_model_test_patch_gpu_builds(tests_manifest):
    """The manifest's configs are the test's models: hf_model's configs (what the GPU test
    runs) give no kernel the manifest lacks."""
    transformers = pytest.importorskip("transformers")
    from .test_patch_cpu import hf_model

    for kind in PATCH_KINDS:
        for vocab in (PATCH_VOCAB, PATCH_MEMORY_VOCAB) if kind == "llama" else (PATCH_VOCAB,):
            model = hf_model(transformers, kind, width=PATCH_WIDTH, inter=PATCH_INTER,
                             head_dim=PATCH_HEAD_DIM, vocab=vocab, cap=PATCH_CAP)  # fmt: skip
            missing = labels(model_specs(model.config.to_dict(), "bf16")) - tests_manifest
            assert not missing, (kind, sorted(missing)[:5])


def test_qk_norm_rope_lists_its_inference_forward():
    from kbuild.kernels.rope.qk_norm import warmup_specs

    specs = labels(warmup_specs())
    for missed in (
        "qk_norm_rope(D=128, cs_dtype=bf16, dtype=bf16, eps=1e-06, interleaved=False, "
        "offset=0.0, store_rstd=False, vec=8, w_dtype=bf16)",
        "qk_norm_rope(D=256, cs_dtype=f32, dtype=bf16, eps=1e-06, interleaved=False, "
        "offset=1.0, store_rstd=False, vec=8, w_dtype=f32)",
    ):
        assert missed in specs, missed


# Published configs' fields (the ones model_specs reads), as bench/patch_models.py warms them.
LLAMA3_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 rms_norm_eps=1e-5, hidden_act="silu")  # fmt: skip
GEMMA2_2B = dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                 rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                 final_logit_softcapping=30.0)  # fmt: skip
PHI3_MINI = dict(model_type="phi3", hidden_size=3072, intermediate_size=8192,
                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                 rms_norm_eps=1e-5, hidden_act="silu", partial_rotary_factor=0.5)  # fmt: skip


def test_warmup_model_lists_the_inference_forward_at_the_configs_eps():
    specs = labels(model_specs(LLAMA3_8B))
    assert ("rmsnorm_fwd(N=4096, dtype=bf16, eps=1e-05, store_rstd=False, vectorize=True, "
            "weight_dtype=bf16)") in specs  # fmt: skip
    assert not any("eps=1e-06" in s for s in specs if s.startswith("rmsnorm")), "eps ignored"


def test_warmup_model_lists_what_the_patch_checks_launch():
    llama, gemma = labels(model_specs(LLAMA3_8B)), labels(model_specs(GEMMA2_2B))
    assert "swiglu_fwd(N=64, dtype=f32, vectorize=True)" in llama  # the activation probe
    # Gemma's act is tanh-GELU: swiglu is tried first, then geglu(tanh)
    assert {"swiglu_fwd(N=64, dtype=f32, vectorize=True)",
            "geglu_fwd(N=64, dtype=f32, tanh=True, vectorize=True)"} <= gemma  # fmt: skip
    # the norm check reads x_hat * w first (offset 0), then Gemma's x_hat * (1 + w)
    assert ("rmsnorm_fwd(N=2304, dtype=bf16, eps=1e-06, store_rstd=False, vectorize=True, "
            "weight_dtype=bf16)") in gemma  # fmt: skip
    # Phi-3's partial rotation: the rotary check probes rd = 48 and head_dim 96
    phi3 = labels(model_specs(PHI3_MINI))
    for rd in (48, 96):
        assert any(s.startswith("rope(D=96,") and f"rd={rd}," in s and "inverse=False" in s
                   for s in phi3), rd  # fmt: skip
    gpt2 = labels(model_specs(dict(model_type="gpt2", n_embd=768, vocab_size=50257)))
    assert "gelu_fwd(N=64, dtype=f32, tanh=True, vectorize=True)" in gpt2


def test_bench_rows_lists_its_check_widths():
    spec = importlib.util.spec_from_file_location("bench_rows", f"{ROOT}/bench/bench_rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    specs = labels(module.warmup_specs())
    for N in (5123, 65537):
        assert f"user_softmax_fwd(N={N}, dtype=bf16, vectorize=True)" in specs, N
    assert ("rmsnorm_fwd(N=1001, dtype=f32, eps=1e-06, store_rstd=True, vectorize=True, "
            "weight_dtype=f32)") in specs  # fmt: skip
