"""Named kernel lists: what `kbuild warmup` compiles and what the GPU tests and benchmarks use.

One source of truth: the GPU tests and bench/ draw their shapes from kbuild/cases.py, and
warmup compiles exactly the specs the ops will ask for with those shapes, so a cache warmed
here on a CPU machine serves the GPU run with `KBUILD_OFFLINE=1`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ..cases import (
    BENCH_C,
    BENCH_DTYPE,
    BENCH_N,
    BIAS_OC,
    DTYPES,
    ENCODER_C,
    ENCODER_DTYPES,
    MULTI_ROW_N,
    OFFSET_N,
    PATCH_CAP,
    PATCH_HEAD_DIM,
    PATCH_HEADS,
    PATCH_INTER,
    PATCH_KINDS,
    PATCH_KV,
    PATCH_MEMORY_VOCAB,
    PATCH_VOCAB,
    PATCH_WIDTH,
    QK_N,
    STANDARD_N,
    STREAM_BENCH_N,
    STREAM_N,
    TEST_N,
    TINY_SHAPE,
    TRAIN_DTYPE,
    TRAIN_N,
)
from ..spec import KernelSpec
from .widths import (
    WIDTH_OPS,
    affine_dtypes,
    bias_family,
    encoder_family,
    for_width,
    fused_family,
    layernorm_bwd_spec,
    layernorm_family,
    residual_dtypes,
    rmsnorm_bwd_spec,
    rmsnorm_family,
    rmsnorm_fwd_spec,
    weight_dtypes,
)


def _tests() -> Iterator[KernelSpec]:

    for N in TEST_N:
        for dtype in DTYPES:
            for w in weight_dtypes(dtype):
                yield from rmsnorm_family(N, dtype, w)
                for residual in residual_dtypes(dtype):
                    yield from fused_family(N, dtype, w, residual)
            for w, b in affine_dtypes(dtype):
                yield from layernorm_family(N, dtype, w, b)
    yield from layernorm_family(TRAIN_N, TRAIN_DTYPE, TRAIN_DTYPE, TRAIN_DTYPE)
    yield rmsnorm_fwd_spec(4096, "f32", "f32", False, 1e-2)
    yield rmsnorm_fwd_spec(4096, "bf16", "bf16", False, 1e-6, vectorize=False)
    for N in STREAM_N:
        yield from fused_family(N, "bf16", "f32", "f32")
    for N in MULTI_ROW_N:
        yield from layernorm_family(N, "bf16", "bf16", "bf16")
    for N in QK_N:  # QK-norm of a fused qkv's heads, read in place (test_qk_norm_in_place)
        yield from rmsnorm_family(N, "bf16", "bf16", strided=True)
    yield from rmsnorm_family(QK_N[1], "bf16", "bf16", strided=True, vectorize=False)
    for N in OFFSET_N:  # Gemma's weight offset (test_rmsnorm_bwd_gpu.test_weight_offset)
        yield rmsnorm_fwd_spec(N, "bf16", "bf16", False, 1e-6)  # its bf16-first variant
        for w in ("bf16", "f32"):
            yield from rmsnorm_family(N, "bf16", w, offset=1.0)
            yield from fused_family(N, "bf16", w, "bf16", offset=1.0)
    for dtype in ENCODER_DTYPES:
        for C in ENCODER_C:
            yield from encoder_family(C, dtype)
        for OC in BIAS_OC:
            yield from bias_family(OC, dtype)
    yield from _patch_tests()


def patch_test_configs() -> list[dict]:
    """The config dicts of tests/test_patch_gpu.py's models, by transformers' config classes
    (their defaults: eps, activation, rotary); none where transformers is not installed (the
    test is skipped there too). tests/test_warm_lists_cpu.py holds them to hf_model's."""
    try:
        import transformers
    except ImportError:
        return []
    common = dict(hidden_size=PATCH_WIDTH, intermediate_size=PATCH_INTER, num_hidden_layers=2,
                  num_attention_heads=PATCH_HEADS, num_key_value_heads=PATCH_KV,
                  max_position_embeddings=256, bos_token_id=0, eos_token_id=0)  # fmt: skip
    more = {
        "qwen3": dict(head_dim=PATCH_HEAD_DIM),
        "gemma2": dict(head_dim=PATCH_HEAD_DIM, final_logit_softcapping=PATCH_CAP),
        "phi3": dict(partial_rotary_factor=0.5, pad_token_id=0),
    }
    configs = []
    for kind in PATCH_KINDS:
        for vocab in (PATCH_VOCAB, PATCH_MEMORY_VOCAB) if kind == "llama" else (PATCH_VOCAB,):
            if kind == "gpt2":
                given = dict(n_embd=PATCH_WIDTH, n_layer=2, n_head=PATCH_HEADS, vocab_size=vocab)
            else:
                given = dict(common, vocab_size=vocab, **more.get(kind, {}))
            configs.append(transformers.AutoConfig.for_model(kind, **given).to_dict())
    return configs


def _patch_tests() -> Iterator[KernelSpec]:
    from .model_specs import model_specs  # imports torch

    for config in patch_test_configs():
        yield from model_specs(config, "bf16")


def _bench() -> Iterator[KernelSpec]:
    for N in BENCH_N:
        yield from rmsnorm_family(N, BENCH_DTYPE, BENCH_DTYPE, bench=True)
        yield from rmsnorm_family(N, BENCH_DTYPE, BENCH_DTYPE, bench=True, offset=1.0)
        yield from fused_family(N, BENCH_DTYPE, BENCH_DTYPE, BENCH_DTYPE)
        yield from layernorm_family(N, BENCH_DTYPE, BENCH_DTYPE, BENCH_DTYPE)
    yield from rmsnorm_family(TINY_SHAPE[1], BENCH_DTYPE, BENCH_DTYPE, bench=True)
    for N in QK_N:  # dense rows, and the q view of a fused qkv (read in place)
        yield from rmsnorm_family(N, BENCH_DTYPE, BENCH_DTYPE, bench=True)
        yield from rmsnorm_family(N, BENCH_DTYPE, BENCH_DTYPE, bench=True, strided=True)
    for N in STREAM_BENCH_N:
        yield from fused_family(N, BENCH_DTYPE, "f32", "f32")
    for C in BENCH_C:
        yield from encoder_family(C, BENCH_DTYPE, ("i64",))
        yield from bias_family(C, BENCH_DTYPE)
    # examples/train_gpt2.py (GPT-2 124M shape, bf16): its layers' widths
    yield from for_width(768, BENCH_DTYPE, ops=WIDTH_OPS)


def _tune() -> Iterator[KernelSpec]:
    """Launch-plan alternatives to the chooser's picks for bench/tune.py (the chooser's own
    pick first, for comparison). A variant forces plan fields by their builder keywords
    (plan/rows.py: `override_keywords`); the fields it leaves out are the chooser's.
    Here: the backward's rows per block at short N (RMSNorm 1024 / 2048, LayerNorm 1024 /
    2048: fewer partial rows for the column sum); RMSNorm at N = 65536 with its lagged
    exchange against the mbarrier exchange it replaced and the same one-block plan without
    the lag; the RMSNorm forward's second widening (from packed words or 16-bit halves) at
    every bench N; LayerNorm's backward at 16384 against clusters of 4 x 512 and 8 x 256
    and one block an SM, at 65536 with one block an SM (dw/db partials in registers) with
    and without the lag, and its picks alone at 4096 / 8192 (all swept on 2026-12-04); the
    backward at widths of peeled rows (4097, 5123; LayerNorm 5120 too) capped at two blocks
    an SM.
    Earlier sweeps (the exchange x staging, rows per block of a cluster, clusters of 16,
    reloading staged rows, staging depth, parameters held in registers, ...) and what they
    showed: bench/results/README.md."""

    def variants(spec: KernelSpec, *options: dict) -> Iterator[KernelSpec]:
        for extra in ({}, *options):
            yield KernelSpec.make(spec.kernel, **spec.kwargs, **extra)

    # One workspace row per block: several rows per block leave fewer partial rows for the
    # column sum (LayerNorm at N = 1024: 1056 rows of 8 KB, 8.6 MB over both planes).
    yield from variants(rmsnorm_bwd_spec(1024, "bf16", "bf16", True), dict(rows_per_block=4))
    yield from variants(rmsnorm_bwd_spec(2048, "bf16", "bf16", True), dict(rows_per_block=2))
    # RMSNorm at N = 65536: the lagged exchange against the mbarrier exchange it replaced
    # (two blocks an SM, dw partials in shared memory) and against the same one-block plan
    # without the lag.
    yield from variants(
        rmsnorm_bwd_spec(65536, "bf16", "bf16", True),
        dict(cluster_sync="mbarrier"),
        dict(cluster_sync="mbarrier", stage=2, shared_partials=False, blocks_per_sm=1),
    )
    # The RMSNorm forward's second widening of its packed bf16 row, from 32-bit words (one
    # integer op a value; the pick for rows of one block of >= 512 threads, N >= 16384) or
    # from 16-bit halves (with which ptxas spilled 8 bytes at N = 65536, 232 on sm_80).
    # Inference (no rstd) and training forms, each against the other widening.
    for N in BENCH_N:
        for store_rstd in (False, True):
            spec = rmsnorm_fwd_spec(N, "bf16", "bf16", store_rstd, 1e-6)
            yield from variants(spec, dict(word_widening=N < 16384))
    layernorm = {
        1024: (dict(rows_per_block=4),),
        2048: (dict(rows_per_block=4),),
        4096: (),
        8192: (),
        16384: (
            dict(cluster=4, threads_per_row=512),
            dict(cluster=8, threads_per_row=256),
            dict(shared_partials=False, blocks_per_sm=1, stage=2),
        ),
        65536: (
            dict(shared_partials=False, blocks_per_sm=1, stage=2),
            dict(shared_partials=False, blocks_per_sm=1, stage=2, cluster_sync="lagged"),
        ),
    }
    for N, options in layernorm.items():
        yield from variants(layernorm_bwd_spec(N, "bf16", "bf16", True, True), *options)
    # Widths that are not whole vectors (peeled rows) and LayerNorm at 5120: the chooser
    # leaves their backward uncapped, and ptxas (CUDA 13.0, sm_90) then gives RMSNorm 4097 /
    # 5123 72 / 124 registers, LayerNorm 4097 / 5120 / 5123 148 / 141 / 148: one block an SM.
    # Capped at two blocks: RMSNorm 56 (60 bytes spilled) / 80, LayerNorm 96 / 96 / 80 (120
    # bytes spilled), 2026-12-07.
    two = dict(blocks_per_sm=2)
    for N in (4097, 5123):
        yield from variants(rmsnorm_bwd_spec(N, "bf16", "bf16", True), two)
    for N in (4097, 5120, 5123):
        yield from variants(layernorm_bwd_spec(N, "bf16", "bf16", True, True), two)


def _trace() -> Iterator[KernelSpec]:
    """Diagnostic builds for bench/trace_rows.py: the longest LayerNorm rows with per-row
    timestamps (dsl.trace), as the chooser builds them (w and b held in registers) and
    reading w and b for every row, as before."""
    ln_fwd = dict(weight_dtype="bf16", bias_dtype="bf16", store_stats=True, eps=1e-5)
    ln_bwd = dict(weight_dtype="bf16", compute_dw=True, compute_db=True)
    bf16 = dict(dtype="bf16", vectorize=True, trace=True)
    for options in (
        {},
        dict(resident_params=False, stage=1, persistent=True),
    ):
        yield KernelSpec.make("layernorm_fwd", N=65536, **options, **ln_fwd, **bf16)
    one_block = dict(shared_partials=False, blocks_per_sm=1, stage=2)
    for options in ({}, dict(resident_params=False), dict(one_block, cluster_sync="lagged")):
        yield KernelSpec.make("layernorm_bwd", N=65536, **options, **ln_bwd, **bf16)
    # RMSNorm's: the chooser's (a lagged exchange) and the mbarrier exchange it replaced.
    rms_bwd = dict(weight_dtype="bf16", compute_dw=True)
    for options in ({}, dict(cluster_sync="mbarrier")):
        yield KernelSpec.make("rmsnorm_bwd", N=65536, **options, **rms_bwd, **bf16)


def _standard() -> Iterator[KernelSpec]:
    for N in STANDARD_N:
        yield from rmsnorm_family(N, "bf16", "bf16", bench=True)
        yield from fused_family(N, "bf16", "bf16", "bf16")
        yield from layernorm_family(N, "bf16", "bf16", "bf16")


MANIFESTS: dict[str, Callable[[], Iterator[KernelSpec]]] = {
    "standard": _standard,
    "tests": _tests,
    "bench": _bench,
    "tune": _tune,
    "trace": _trace,
}


def manifest(name: str) -> list[KernelSpec]:
    """The specs of a named manifest, without duplicates, in a stable order."""
    if name not in MANIFESTS:
        raise ValueError(f"manifest must be one of {', '.join(MANIFESTS)}; got {name!r}")
    return list(dict.fromkeys(MANIFESTS[name]()))
