"""Named kernel lists: what `kbuild warmup` compiles and what the GPU tests and benchmarks use.

One source of truth: the GPU tests and bench/ draw their shapes from the constants below, and
warmup compiles exactly the specs the ops layer will ask for with those shapes, so a cache
warmed here on a CPU machine serves the GPU run with `KBUILD_OFFLINE=1`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .kernels.table import (
    BIAS_GRAD,
    COLUMN_SUM,
    ENCODER_BWD_WPE,
    ENCODER_BWD_WTE,
    ENCODER_BWD_WTE_MERGE,
    ENCODER_FWD,
    FUSED_ADD_RMSNORM_BWD,
    FUSED_ADD_RMSNORM_FWD,
    INDEX_DTYPES,
    LAYERNORM_BWD,
    LAYERNORM_FWD,
    RMSNORM_BWD,
    RMSNORM_FWD,
)
from .spec import KernelSpec

# The table's spec functions (the ops' *_spec names are the same functions); importing them
# from the table keeps warmup free of torch and of the C++ extension's build.
column_sum_spec = COLUMN_SUM.spec
rmsnorm_fwd_spec, rmsnorm_bwd_spec = RMSNORM_FWD.spec, RMSNORM_BWD.spec
fused_add_rmsnorm_fwd_spec = FUSED_ADD_RMSNORM_FWD.spec
fused_add_rmsnorm_bwd_spec = FUSED_ADD_RMSNORM_BWD.spec
layernorm_fwd_spec, layernorm_bwd_spec = LAYERNORM_FWD.spec, LAYERNORM_BWD.spec
encoder_fwd_spec, bias_grad_spec = ENCODER_FWD.spec, BIAS_GRAD.spec
encoder_bwd_wte_spec, encoder_bwd_wpe_spec = ENCODER_BWD_WTE.spec, ENCODER_BWD_WPE.spec
encoder_bwd_wte_merge_spec = ENCODER_BWD_WTE_MERGE.spec

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


def weight_dtypes(dtype: str) -> tuple[str | None, ...]:
    """Weights the tests cover for inputs of `dtype`: same dtype, fp32, none."""
    return (dtype, "f32", None) if dtype != "f32" else ("f32", None)


def residual_dtypes(dtype: str) -> tuple[str, ...]:
    """residual_out dtypes the fused tests cover: x's dtype, and fp32 (residual_in_fp32)."""
    return (dtype, "f32") if dtype != "f32" else ("f32",)


def _rmsnorm_family(
    N: int,
    dtype: str,
    w: str | None,
    bench: bool = False,
    eps: float = 1e-6,
    offset=0.0,
    strided: bool = False,
    vectorize: bool = True,
) -> Iterator[KernelSpec]:
    """Every kernel one RMSNorm training step (and its inference call) launches; `strided`:
    of an x read in place at a row stride (the q or k of a fused qkv), `vectorize=False`:
    of one whose stride or address is not a whole number of 16-byte vectors."""
    more = dict(offset=offset, vectorize=vectorize, strided=strided)
    yield rmsnorm_fwd_spec(N, dtype, w, False, eps, **more)
    yield rmsnorm_fwd_spec(N, dtype, w, True, eps, **more)
    yield rmsnorm_bwd_spec(N, dtype, w, True, **more)
    if w is not None:
        yield column_sum_spec(N, w)
        if not bench:
            yield rmsnorm_bwd_spec(N, dtype, w, False, **more)  # frozen weight


def _fused_family(
    N: int, dtype: str, w: str | None, residual: str, eps: float = 1e-6, offset=0.0
) -> Iterator[KernelSpec]:
    """A fused step's kernels; with an fp32 residual_out of 16-bit x, also those of the
    stream's later layers (the residual comes in fp32, its gradient goes out in fp32)."""
    stream = (None, "f32") if residual == "f32" and dtype != "f32" else (None,)
    for res_in in stream:
        for store_rstd in (False, True):
            yield fused_add_rmsnorm_fwd_spec(
                N, dtype, w, residual, store_rstd, eps, offset=offset, residual_in_dtype=res_in
            )
        for has_dres in (False, True):
            yield fused_add_rmsnorm_bwd_spec(
                N, dtype, w, residual, has_dres, True, offset=offset, dresidual_dtype=res_in
            )
    if w is not None:
        yield column_sum_spec(N, w)


def affine_dtypes(dtype: str) -> tuple[tuple[str | None, str | None], ...]:
    """(weight, bias) dtypes the LayerNorm tests cover: both, fp32 both, weight only, none."""
    pairs = ((dtype, dtype), ("f32", "f32"), (dtype, None), (None, None))
    return tuple(dict.fromkeys(pairs))


def _layernorm_family(
    N: int, dtype: str, w: str | None, b: str | None, bench: bool = False, eps: float = 1e-5
) -> Iterator[KernelSpec]:
    for store_stats in (False, True):
        yield layernorm_fwd_spec(N, dtype, w, b, store_stats, eps)
    yield layernorm_bwd_spec(N, dtype, w, w is not None, b is not None)
    params = [d for d in (w, b) if d is not None]
    if len(params) == 2 and w == b:
        yield column_sum_spec(N, w, planes=2)  # dw and db in one launch
    else:
        for param in params:
            yield column_sum_spec(N, param)


def _encoder_family(C: int, dtype: str, index_dtypes=INDEX_DTYPES) -> Iterator[KernelSpec]:
    """The encoder's forward and backward kernels (kbuild.encoder, its autograd, and
    kbuild.encoder_backward, which adds to an existing dwpe)."""
    for index in index_dtypes:
        yield encoder_fwd_spec(C, dtype, index)
        yield encoder_bwd_wte_spec(C, dtype, index)
        yield encoder_bwd_wte_merge_spec(C, dtype, index)
    for accumulate in (False, True):
        yield encoder_bwd_wpe_spec(C, dtype, accumulate)


def _bias_family(OC: int, dtype: str) -> Iterator[KernelSpec]:
    yield bias_grad_spec(OC, dtype)
    yield column_sum_spec(OC, dtype)


WIDTH_OPS = ("rmsnorm", "fused_add_rmsnorm", "layernorm", "encoder", "linear")
DEFAULT_WIDTH_OPS = WIDTH_OPS[:3]


def for_width(
    hidden: int,
    dtype: str,
    weight_dtype: str | None = None,
    ops: tuple[str, ...] = DEFAULT_WIDTH_OPS,
    rms_eps: float = 1e-6,
    ln_eps: float = 1e-5,
    residual_fp32: bool = False,
    rms_offset: float = 0.0,
    head_dim: int | None = None,
) -> list[KernelSpec]:
    """Every kernel a training and an inference step of a model of width `hidden` launch
    through `ops`: forwards with and without saved statistics, backwards (a frozen weight
    too), the dw/db reductions. `weight_dtype` defaults to `dtype`; LayerNorm's bias has the
    weight's dtype; `residual_fp32` adds the fused form's fp32 residual stream; `rms_offset`
    is the RMSNorm weight offset (Gemma: 1.0) of the rmsnorm and fused kernels. "encoder":
    GPT-2's embedding of width `hidden` (int32 and int64 ids); "linear": the bias gradients
    of a GPT-2 block's linears (widths hidden, 3 * hidden and 4 * hidden). `head_dim`: a
    QK-norm (Qwen3, Gemma 3, OLMo 2) over heads of this width, its RMSNorm kernels on dense
    rows and on the q / k views of a fused qkv projection (read in place)."""
    unknown = set(ops) - set(WIDTH_OPS)
    if unknown:
        raise ValueError(f"ops must be among {WIDTH_OPS}; got {sorted(unknown)}")
    w = weight_dtype or dtype
    specs: list[KernelSpec] = []
    if "rmsnorm" in ops:
        specs += _rmsnorm_family(hidden, dtype, w, eps=rms_eps, offset=rms_offset)
    if "fused_add_rmsnorm" in ops:
        for residual in (dtype, "f32") if residual_fp32 else (dtype,):
            specs += _fused_family(hidden, dtype, w, residual, eps=rms_eps, offset=rms_offset)
    if "layernorm" in ops:
        specs += _layernorm_family(hidden, dtype, w, w, eps=ln_eps)
    if head_dim is not None:
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        for strided in (False, True):
            specs += _rmsnorm_family(
                head_dim, dtype, w, eps=rms_eps, offset=rms_offset, strided=strided
            )
    if "encoder" in ops:
        specs += _encoder_family(hidden, dtype)
    if "linear" in ops:
        for width in (hidden, 3 * hidden, 4 * hidden):
            specs += _bias_family(width, dtype)
    return list(dict.fromkeys(specs))


def _tests() -> Iterator[KernelSpec]:

    for N in TEST_N:
        for dtype in DTYPES:
            for w in weight_dtypes(dtype):
                yield from _rmsnorm_family(N, dtype, w)
                for residual in residual_dtypes(dtype):
                    yield from _fused_family(N, dtype, w, residual)
            for w, b in affine_dtypes(dtype):
                yield from _layernorm_family(N, dtype, w, b)
    yield from _layernorm_family(TRAIN_N, TRAIN_DTYPE, TRAIN_DTYPE, TRAIN_DTYPE)
    yield rmsnorm_fwd_spec(4096, "f32", "f32", False, 1e-2)
    yield rmsnorm_fwd_spec(4096, "bf16", "bf16", False, 1e-6, vectorize=False)
    for N in STREAM_N:
        yield from _fused_family(N, "bf16", "f32", "f32")
    for N in MULTI_ROW_N:
        yield from _layernorm_family(N, "bf16", "bf16", "bf16")
    for N in QK_N:  # QK-norm of a fused qkv's heads, read in place (test_qk_norm_in_place)
        yield from _rmsnorm_family(N, "bf16", "bf16", strided=True)
    yield from _rmsnorm_family(QK_N[1], "bf16", "bf16", strided=True, vectorize=False)
    for N in OFFSET_N:  # Gemma's weight offset (test_rmsnorm_bwd_gpu.test_weight_offset)
        yield rmsnorm_fwd_spec(N, "bf16", "bf16", False, 1e-6)  # its bf16-first variant
        for w in ("bf16", "f32"):
            yield from _rmsnorm_family(N, "bf16", w, offset=1.0)
            yield from _fused_family(N, "bf16", w, "bf16", offset=1.0)
    for dtype in ENCODER_DTYPES:
        for C in ENCODER_C:
            yield from _encoder_family(C, dtype)
        for OC in BIAS_OC:
            yield from _bias_family(OC, dtype)
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
        yield from _rmsnorm_family(N, BENCH_DTYPE, BENCH_DTYPE, bench=True)
        yield from _rmsnorm_family(N, BENCH_DTYPE, BENCH_DTYPE, bench=True, offset=1.0)
        yield from _fused_family(N, BENCH_DTYPE, BENCH_DTYPE, BENCH_DTYPE)
        yield from _layernorm_family(N, BENCH_DTYPE, BENCH_DTYPE, BENCH_DTYPE)
    yield from _rmsnorm_family(TINY_SHAPE[1], BENCH_DTYPE, BENCH_DTYPE, bench=True)
    for N in QK_N:  # dense rows, and the q view of a fused qkv (read in place)
        yield from _rmsnorm_family(N, BENCH_DTYPE, BENCH_DTYPE, bench=True)
        yield from _rmsnorm_family(N, BENCH_DTYPE, BENCH_DTYPE, bench=True, strided=True)
    for N in STREAM_BENCH_N:
        yield from _fused_family(N, BENCH_DTYPE, "f32", "f32")
    for C in BENCH_C:
        yield from _encoder_family(C, BENCH_DTYPE, ("i64",))
        yield from _bias_family(C, BENCH_DTYPE)
    # examples/train_gpt2.py (GPT-2 124M shape, bf16): its layers' widths
    yield from for_width(768, BENCH_DTYPE, ops=WIDTH_OPS)


def _tune() -> Iterator[KernelSpec]:
    """Launch-plan alternatives to the chooser's picks for bench/tune.py (the chooser's own
    pick first, for comparison). A variant forces plan fields by their builder keywords
    (kernels/row_plan.py: `override_keywords`); the fields it leaves out are the chooser's.
    Here: the backward's rows per block at short N (RMSNorm 1024 / 2048, LayerNorm 1024 /
    2048: fewer partial rows for the column sum); RMSNorm at N = 65536 with its lagged
    exchange against the mbarrier exchange it replaced and the same one-block plan without
    the lag; the RMSNorm forward's second widening (from packed words or 16-bit halves) at
    every bench N; LayerNorm's backward at 16384 against clusters of 4 x 512 and 8 x 256
    and one block an SM, at 65536 with one block an SM (dw/db partials in registers) with
    and without the lag, and its picks alone at 4096 / 8192 (all swept on 2026-12-04).
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
        yield from _rmsnorm_family(N, "bf16", "bf16", bench=True)
        yield from _fused_family(N, "bf16", "bf16", "bf16")
        yield from _layernorm_family(N, "bf16", "bf16", "bf16")


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
