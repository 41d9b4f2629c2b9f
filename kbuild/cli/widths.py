"""The kernels of one row width, by op: what a model of that width launches (`kbuild warmup
--hidden N`, the manifests and cli/model_specs.py build on it), and the spec helpers of the
norm and llm.c families.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..kernels.llmc.encoder import (
    ENCODER_BWD_WPE,
    ENCODER_BWD_WTE,
    ENCODER_BWD_WTE_MERGE,
    ENCODER_FWD,
)
from ..kernels.norms.kernels import (
    FUSED_ADD_RMSNORM_BWD,
    FUSED_ADD_RMSNORM_FWD,
    LAYERNORM_BWD,
    LAYERNORM_FWD,
    RMSNORM_BWD,
    RMSNORM_FWD,
)
from ..kernels.reduce import BIAS_GRAD, COLUMN_SUM
from ..registry import INDEX_DTYPES
from ..spec import KernelSpec

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


def weight_dtypes(dtype: str) -> tuple[str | None, ...]:
    """Weights the tests cover for inputs of `dtype`: same dtype, fp32, none."""
    return (dtype, "f32", None) if dtype != "f32" else ("f32", None)


def residual_dtypes(dtype: str) -> tuple[str, ...]:
    """residual_out dtypes the fused tests cover: x's dtype, and fp32 (residual_in_fp32)."""
    return (dtype, "f32") if dtype != "f32" else ("f32",)


def rmsnorm_family(
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


def fused_family(
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


def layernorm_family(
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


def encoder_family(C: int, dtype: str, index_dtypes=INDEX_DTYPES) -> Iterator[KernelSpec]:
    """The encoder's forward and backward kernels (kbuild.encoder, its autograd, and
    kbuild.encoder_backward, which adds to an existing dwpe)."""
    for index in index_dtypes:
        yield encoder_fwd_spec(C, dtype, index)
        yield encoder_bwd_wte_spec(C, dtype, index)
        yield encoder_bwd_wte_merge_spec(C, dtype, index)
    for accumulate in (False, True):
        yield encoder_bwd_wpe_spec(C, dtype, accumulate)


def bias_family(OC: int, dtype: str) -> Iterator[KernelSpec]:
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
        specs += rmsnorm_family(hidden, dtype, w, eps=rms_eps, offset=rms_offset)
    if "fused_add_rmsnorm" in ops:
        for residual in (dtype, "f32") if residual_fp32 else (dtype,):
            specs += fused_family(hidden, dtype, w, residual, eps=rms_eps, offset=rms_offset)
    if "layernorm" in ops:
        specs += layernorm_family(hidden, dtype, w, w, eps=ln_eps)
    if head_dim is not None:
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        for strided in (False, True):
            specs += rmsnorm_family(
                head_dim, dtype, w, eps=rms_eps, offset=rms_offset, strided=strided
            )
    if "encoder" in ops:
        specs += encoder_family(hidden, dtype)
    if "linear" in ops:
        for width in (hidden, 3 * hidden, 4 * hidden):
            specs += bias_family(width, dtype)
    return list(dict.fromkeys(specs))
