"""Softmax and log-softmax along a dimension: `kbuild.softmax(x, dim=-1, dtype=None)` and
`kbuild.log_softmax(x, dim=-1, dtype=None)`, torch's signatures.

    y = kbuild.softmax(x)                          # rows of the last dimension
    logp = kbuild.log_softmax(logits, dtype=torch.float32)

Each is a `kbuild.Op` declared as a user declares one (examples/custom_softmax.py): the
kernels (kernels/softmax/kernels.py) bound by name, so where the C++ extension loads the generic
C++ kernel launches them and the generic C++ autograd kernel runs the backward op. fp32 math
whatever the storage dtype; one rounding of y to its dtype. Saved for backward: the output y
only (torch saves the same); the backward reads y and dy once and writes dx.

`dtype=` is torch's: x is cast to it before the op, so y has that dtype. Where that cast is
exact (fp32, or x's own dtype) the forward kernel reads x as it is and writes y in `dtype`
(`out_dtype`: no copy of x); otherwise (fp16 <-> bf16, fp32 -> 16-bit) x is cast first, as
torch does. With a wider `dtype`, dx is computed in y's dtype and autograd rounds it to x's
(one rounding from fp32, as a kernel writing x's dtype would make).

`dim`: the last dimension runs the row kernels directly; another is moved last and made
contiguous (a copy of x), and y is returned as that result's view with `dim` moved back (not
contiguous; torch's own result is).
"""

from __future__ import annotations

import torch

from ... import cases
from ...op.opdef import Launch, Like, Op, Out, Rows, Scalar
from ...op.tensors import DTYPE_NAMES, check_input
from .kernels import (
    build_log_softmax_bwd,
    build_log_softmax_fwd,
    build_softmax_bwd,
    build_softmax_fwd,
)

# ----------------------------------------------------------------------------- references


def softmax_reference(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    """fp32 math, one rounding to out_dtype (or x's): what CPU tensors run."""
    return torch.softmax(x.float(), -1).to(out_dtype or x.dtype)


def log_softmax_reference(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    return torch.log_softmax(x.float(), -1).to(out_dtype or x.dtype)


def softmax_backward_reference(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dx = y (dy - sum(y dy)), fp32 math."""
    y32, dy32 = y.float(), dy.float()
    return (y32 * (dy32 - (y32 * dy32).sum(-1, keepdim=True))).to(y.dtype)


def log_softmax_backward_reference(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dx = dy - exp(y) sum(dy), fp32 math."""
    y32, dy32 = y.float(), dy.float()
    return (dy32 - torch.exp(y32) * dy32.sum(-1, keepdim=True)).to(y.dtype)


# ----------------------------------------------------------------------------- the ops


def _declare(name: str, fwd, bwd, reference, backward_reference) -> Op:
    """One forward op (x, out_dtype) -> y and its backward (y, dy) -> dx, by names."""
    return Op(
        f"kbuild::{name}",
        args=(Rows("x"), Scalar("out_dtype", "dtype", None, optional=True)),
        outputs=(Out("y", like="x", dtype="out_dtype"),),
        launch=Launch(fwd),
        reference=reference,
        backward=Op(
            f"kbuild::{name}_backward",
            args=(Rows("y"), Like("dy", "y")),
            outputs=(Out("dx", like="y"),),
            launch=Launch(bwd),
            reference=backward_reference,
        ),
    )


SOFTMAX = _declare("softmax", build_softmax_fwd, build_softmax_bwd, softmax_reference,
                   softmax_backward_reference)  # fmt: skip
LOG_SOFTMAX = _declare("log_softmax", build_log_softmax_fwd, build_log_softmax_bwd,
                       log_softmax_reference, log_softmax_backward_reference)  # fmt: skip


# ----------------------------------------------------------------------------- public


def _prepare(x: torch.Tensor, dim: int, dtype: torch.dtype | None):
    """Checks; x as the op takes it (cast first where the kernel's cast would not be
    torch's) and the op's out_dtype."""
    check_input("x", x)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be in [{-x.dim()}, {x.dim() - 1}] for x of {x.dim()} "
                         f"dimensions; got {dim}")  # fmt: skip
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise TypeError(
            f"dtype must be None, torch.float32, torch.float16 or torch.bfloat16; got {dtype!r}"
        )
    if dtype is None or dtype == x.dtype:
        return x, None
    if dtype == torch.float32:  # widening is exact: the kernel reads x as it is
        return x, dtype
    return x.to(dtype), None  # a rounding of x, as torch's cast before the op


def _run(op: Op, x: torch.Tensor, dim: int, dtype: torch.dtype | None) -> torch.Tensor:
    x, out_dtype = _prepare(x, dim, dtype)
    if x.shape[dim] == 0:  # rows of no element: nothing to compute (a copy keeps the graph)
        return x.to(out_dtype or x.dtype, copy=True)
    last = dim in (-1, x.dim() - 1)
    if last:
        return op(x, out_dtype)
    y = op(x.movedim(dim, -1).contiguous(), out_dtype)  # a copy of x, dim last
    return y.movedim(-1, dim)


def softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """exp(x) / sum(exp(x)) along `dim`, as torch.softmax(x, dim, dtype).

    x: (..., N, ...) float32 / float16 / bfloat16, any N >= 1 (and N = 0: empty). dtype:
    None (x's) or the output's dtype, x cast to it first (torch's meaning). Returns y of x's
    shape. Another `dim` than the last copies x with that dimension last (and y is a view of
    the result, moved back). Saved for backward: y only; dx = y (dy - sum(y dy))."""
    return _run(SOFTMAX, x, dim, dtype)


def log_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x - max(x) - log(sum(exp(x - max(x)))) along `dim`, as torch.log_softmax(x, dim,
    dtype); shapes, dtypes and `dim` as `softmax`. Saved for backward: y only; dx = dy -
    exp(y) sum(dy)."""
    return _run(LOG_SOFTMAX, x, dim, dtype)


# ----------------------------------------------------------------------------- warming

OPS = (SOFTMAX, LOG_SOFTMAX)


def warmup_specs():
    """What `kbuild warmup --module kbuild.kernels.softmax.op` compiles: every kernel the GPU tests
    launch, forward and backward, with and without a float32 output."""
    specs = []
    for N in cases.SOFTMAX_GPU_N:
        for dtype in cases.SOFTMAX_GPU_DTYPES:
            for op in OPS:
                # a misaligned view (vectorize=False) at one width: the GPU test's
                specs += op.warm_specs(N, dtype, misaligned=(N, dtype) == cases.SOFTMAX_MISALIGNED)
                if dtype != torch.float32:  # dtype=torch.float32 on 16-bit x
                    x = torch.empty(1, N, dtype=dtype, device="meta")
                    for k, values in op.kernel_values(x, torch.float32):
                        specs.append(k.spec(*values))
                    y = torch.empty(1, N, dtype=torch.float32, device="meta")
                    specs += [k.spec(*v) for k, v in op.backward.kernel_values(y, y)]
    return list(dict.fromkeys(specs))
