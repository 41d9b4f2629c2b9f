"""Every shape, dtype and option that the tests and benchmarks run, in one place.

The manifests (kbuild/cli/manifest.py) and the op families' warmup_specs() warm exactly these,
the GPU tests iterate them and bench/ measures them, so a cache warmed on a CPU machine serves
the GPU run offline. The norms' and llm.c's are plain data (the CLI reads them without torch);
the op families' GPU cases hold torch dtypes and are built on first use.
"""

from __future__ import annotations

# ----------------------------------------------------------------------------- norms, llm.c

DTYPES = ("f32", "f16", "bf16")
# 4097 and 65537: rows not a whole number of vectors, peeled (dsl.rows), in one block and
# split over a cluster.
TEST_N = (1, 7, 127, 768, 1000, 4096, 4097, 5120, 8192, 12288, 16384, 65536, 65537)
TEST_M = (0, 1, 3, 4096)
TEST_EPS = (1e-6, 1e-2)
BENCH_N = (1024, 2048, 4096, 8192, 16384, 65536)
# The weight offset (Gemma) in the GPU tests; 768: test_models_gpu's Gemma config.
OFFSET_N = (128, 768, 4096, 65536)
STREAM_N = (1024, 4096)  # an fp32 residual stream (test_fp32_residual_stream_trains)
# LayerNorm's backward with several multi-warp rows a block (bf16 N = 2048: 4 x 128 threads;
# test_layernorm_gpu.test_rows_sharing_a_block)
MULTI_ROW_N = (2048,)
QK_N = (64, 128, 256)  # QK-norm rows (head_dim) in bench/bench_variants.py
QK_HEADS = 8  # heads of the fused qkv projection whose q view bench_variants.py reads
STREAM_BENCH_N = (4096, 8192)  # the fp32 residual stream in bench/bench_variants.py
BENCH_ELEMENTS = 64 * 2**20  # M * N for every bandwidth benchmark shape
BENCH_DTYPE = "bf16"
TINY_SHAPE = (4, 4096)  # host-overhead benchmark
STANDARD_N = (1024, 4096, 8192)


# tests/test_patch_gpu.py's Hugging Face models (random weights, bf16 on CUDA, patched by
# kbuild.nn.patch), built by tests/test_patch_cpu.py's hf_model from these; `_patch_tests`
# warms each one's model_specs (its steps and the patch's checks).
PATCH_KINDS = ("llama", "qwen3", "gemma2", "phi3", "gpt2")
PATCH_WIDTH, PATCH_INTER, PATCH_HEAD_DIM, PATCH_HEADS, PATCH_KV = 256, 512, 64, 4, 2
PATCH_VOCAB = 512
PATCH_MEMORY_VOCAB = 32000  # test_fused_loss_holds_less_memory's llama
PATCH_CAP = 30.0  # Gemma 2's final_logit_softcapping there


TRAIN_N, TRAIN_DTYPE = 768, "f32"  # the small model trained eager vs torch.compile
ENCODER_C = (768, 1024, 1600, 4095)  # GPT-2 small, medium, XL widths, and an odd one
ENCODER_DTYPES = ("f32", "bf16")
BIAS_OC = (768, 1001, 2304, 3072)  # GPT-2 small's c_proj, qkv and MLP widths, an odd one
BENCH_C = (768, 1024, 1600)


# ----------------------------------------------------------------------------- cross-entropy
# The GPU tests' vocabularies (tests/test_cross_entropy_gpu.py): some not a multiple of 8
# (peeled rows), and a long row.
CE_GPU_V = (2, 7, 1000, 4096, 50257, 151936)
# (label_smoothing, lse_square_scale, softcap) of the GPU cases
CE_GPU_OPTIONS = ((0.0, 0.0, None), (0.1, 0.0, None), (0.0, 1e-4, None), (0.1, 1e-4, None),
                  (0.0, 0.0, 30.0), (0.1, 1e-4, 30.0))  # fmt: skip
# The vocabularies bench/bench_loss.py measures: Llama-2, GPT-2, Mistral, Llama-3, Qwen, Gemma
CE_BENCH_V = (32000, 50257, 32768, 128256, 151936, 256000)

# ----------------------------------------------------------------------------- softmax
# tests/test_softmax_gpu.py: widths not a multiple of 8 (peeled rows), rows sharing a block,
# and long (chunked) rows; SOFTMAX_MISALIGNED: a view at an odd offset (vectorize=False).
SOFTMAX_GPU_N = (1, 7, 1000, 4096, 4097, 50257, 151936)

# ----------------------------------------------------------------------------- activations
# tests/test_activations_gpu.py: a short odd row, rows sharing a block, an aligned row and a
# peeled one; ACTIVATION_MISALIGNED: a view at an odd offset (vectorize=False).
ACTIVATION_GPU_N = (7, 1000, 4096, 4097)
# Models' widths, each with its activation: Llama-3-8B's and Phi-3-mini's intermediate size
# (SwiGLU), Gemma-2-2B's (GeGLU, tanh), GPT-2's 4 * 768 (GELU, tanh).
ACTIVATION_MODELS = (("swiglu", 14336), ("swiglu", 8192), ("geglu", 9216), ("gelu", 3072))

# ----------------------------------------------------------------------------- RoPE
# (name, Hq, Hk, D, rd): the models warmed, rotate-half, cos / sin in the model's dtype (HF's
# rotary module casts them to it) and in fp32
ROPE_MODELS = (
    ("Llama-3-8B", 32, 8, 128, 128),
    ("Qwen3-8B", 32, 8, 128, 128),
    ("Gemma-2-2B", 8, 4, 256, 256),
    ("Phi-3-mini", 32, 32, 96, 96),
    ("Phi-2", 32, 32, 80, 32),
    ("GPT-NeoX partial", 32, 32, 128, 32),
)
# (name, Hq, Hk, D): the QK-norm + RoPE models warmed (fused qkv views, weights and cos / sin
# in the model's dtype and in fp32)
QK_ROPE_MODELS = (("Qwen3-8B", 32, 8, 128), ("Gemma-3-4B", 8, 4, 256), ("Gemma-3-1B", 4, 1, 256),
                  ("OLMo-2-7B", 32, 32, 128))  # fmt: skip


def _torch_cases() -> dict:
    """The cases that hold torch dtypes (torch imported here, on first use)."""
    import torch

    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    rope_dtypes = (bf16, f16, f32)
    return dict(
        CE_GPU_DTYPES=(f32, f16, bf16),
        SOFTMAX_GPU_DTYPES=(f32, f16, bf16),
        SOFTMAX_MISALIGNED=(4096, bf16),
        ACTIVATION_GPU_DTYPES=(f32, f16, bf16),
        ACTIVATION_MISALIGNED=(4096, bf16),
        ROPE_DTYPES=rope_dtypes,
        # tests/test_rope_gpu.py: (B, T, Hq, Hk, D, rd, dtype, cos dtype, interleaved,
        # unsqueeze_dim, fused): fused reads q and k as views of one (B, T, (Hq + 2 Hk) D) qkv
        # projection; else contiguous q, k
        ROPE_GPU_CASES=[
            (2, 33, 4, 2, 64, 64, dtype, cs, inter, dim, fused)
            for dtype in rope_dtypes
            for cs in dict.fromkeys((dtype, f32))
            for inter in (False, True)
            for dim in (1, 2)
            for fused in (False, True)
        ]
        + [
            (2, 17, 32, 8, 128, 128, bf16, bf16, False, 1, True),  # Llama GQA
            (1, 9, 8, 4, 256, 256, bf16, f32, False, 1, True),  # Gemma-2's D
            (2, 7, 4, 4, 96, 96, f16, f16, False, 2, True),  # Phi-3's D
            (2, 7, 4, 4, 128, 32, bf16, bf16, False, 1, True),  # NeoX partial
            (2, 7, 4, 4, 128, 32, f32, f32, True, 1, False),  # partial pairs
            (1, 5, 3, 1, 10, 6, f32, f32, False, 1, False),  # odd spans: vec 1
            (1, 5, 3, 1, 10, 6, bf16, f32, True, 2, False),  # pairs, vec 1
        ],
        # The GPU test's misaligned q (one element into its storage): the forward at vec 1
        ROPE_MISALIGNED=(64, 64, bf16, bf16, False),
        # tests/test_qk_norm_rope_gpu.py: (B, T, Hq, Hk, D, dtype, w dtype, cos dtype, offset,
        # interleaved, unsqueeze_dim, fused)
        QK_ROPE_GPU_CASES=[
            (2, 33, 4, 2, D, dtype, dtype, cs, 0.0, inter, dim, fused)
            for D in (64, 128, 256)
            for dtype in rope_dtypes
            for cs in dict.fromkeys((dtype, f32))
            for inter in (False, True)
            for dim in (1, 2)
            for fused in (False, True)
            if (D == 64 or not inter) and (D != 256 or dim == 1)
        ]
        + [
            (2, 17, 32, 8, 128, bf16, bf16, bf16, 0.0, False, 1, True),
            (1, 9, 8, 4, 256, bf16, f32, f32, 1.0, False, 1, True),
            (2, 7, 5, 1, 128, f16, f32, f16, 1.0, False, 2, True),
            (1, 5, 3, 1, 10, f32, f32, f32, 0.0, False, 1, False),
            (1, 5, 3, 1, 10, bf16, bf16, f32, 0.0, True, 2, False),
        ],
    )


_TORCH_CASES = (
    "CE_GPU_DTYPES", "SOFTMAX_GPU_DTYPES", "SOFTMAX_MISALIGNED", "ACTIVATION_GPU_DTYPES",
    "ACTIVATION_MISALIGNED", "ROPE_DTYPES", "ROPE_GPU_CASES", "ROPE_MISALIGNED",
    "QK_ROPE_GPU_CASES",
)  # fmt: skip


def __getattr__(name: str):
    if name in _TORCH_CASES:
        globals().update(_torch_cases())
        return globals()[name]
    raise AttributeError(f"module 'kbuild.cases' has no attribute {name!r}")
