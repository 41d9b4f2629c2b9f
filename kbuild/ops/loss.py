"""Cross-entropy as training needs it: `kbuild.cross_entropy(logits, target, ...)`.

    loss = kbuild.cross_entropy(logits, target)               # (M, V) or (..., V), ids (...)
    loss = kbuild.cross_entropy(logits, target, reduction="sum", label_smoothing=0.1,
                                lse_square_scale=1e-4, ignore_index=-100)

The design: the forward writes the gradient. One kernel per call (kernels/cross_entropy.py)
reads each row of logits once, takes one online (max, sum-exp) reduction, and writes the
row's loss, its log-sum-exp and, when the logits need a gradient, d loss / d logits scaled
by the incoming gradient the forward assumes (llm.c's fused classifier): 1 / n_valid for a
mean (n_valid: the rows whose target is not ignore_index, counted on the device, no
synchronisation), 1 for a sum or "none". The backward (`kbuild::cross_entropy_rescale_`)
rescales that gradient in place, row by row, only where the incoming gradient differs from
the one assumed: `loss.backward()` of a mean or a sum costs one scalar read per row. Under
autograd that is the physical floor (the logits read once, their gradient written once); the
other design (save lse, recompute softmax in the backward) reads the logits twice. Its cost
is memory: the gradient is held from the forward to the backward (the size of the logits;
the logits themselves are usually dead by then). For reduction="none" followed by a weighted
sum the rescale reads and writes the gradient again (as a recompute would read the logits
and write it).

Definitions. loss_r = (1 - eps) (lse_r - x_r[t_r]) + eps (lse_r - mean_j x_r[j]) +
z lse_r^2: eps is torch's `label_smoothing` (the target distribution (1 - eps) one-hot +
eps / V); z is `lse_square_scale`, the z-loss of PaLM (Chowdhery et al. 2022, 1e-4 there)
as Liger-Kernel defines it (added to each row's loss; torch has no such option). Log-sum-exp
and every sum are fp32 whatever the logits' dtype; the loss has the logits' dtype (torch's),
the gradient too. A row whose target is `ignore_index` adds 0 to the loss and gets a zero
gradient; a mean over no valid row is NaN (torch's 0 / 0).

A target outside [0, V) that is not ignore_index is reported by the kernel into an int32
flag (dsl.report) and the call raises ValueError naming `target`. Reading the flag waits for
the kernel: every CUDA call synchronises the host with its stream once (a few microseconds
of host time and no more overlap of the host with that kernel; it cannot be captured in a
CUDA graph). The gradient is deterministic: no float atomics, bitwise the same every run.
Running the backward twice (retain_graph=True) is refused by autograd: the saved gradient is
rescaled in place the first time.
"""

from __future__ import annotations

import math

import torch

from ..kernels.cross_entropy import (
    BAD_TARGET,
    build_cross_entropy_fwd,
    build_cross_entropy_rescale,
)
from .common import DTYPE_NAMES, INDEX_NAMES, check_input, device_guard
from .launch import launch_kernel, rows_grid
from .opdef import Ids, Op, Out, Rows, Scalar, Tensors

REDUCTIONS = ("mean", "sum", "none")

# ----------------------------------------------------------------------------- references


def _bad_target(V: int, ignore_index: int) -> ValueError:
    return ValueError(
        f"target must hold class ids in [0, {V}) or ignore_index ({ignore_index}); it holds "
        "one outside that range"
    )


def cross_entropy_reference(logits, target, coefs, ignore_index, smoothing, z_loss, grad):
    """fp32 math, one rounding of the gradient to the logits' dtype: what CPU tensors run,
    and the kernel's contract. coefs = (gradient scale, label smoothing, z-loss scale)."""
    V = logits.shape[-1]
    x = logits.reshape(-1, V).float()
    t = target.reshape(-1).long()
    g, eps, z = coefs.float().unbind()
    ignored = t == ignore_index
    bad = ~ignored & ((t < 0) | (t >= V))
    if bool(bad.any()):
        raise _bad_target(V, ignore_index)
    safe = torch.where(ignored, 0, t)
    lse = torch.logsumexp(x, -1)
    loss = lse - x.gather(1, safe[:, None])[:, 0]
    if smoothing:
        loss = (1 - eps) * loss + eps * (lse - x.sum(-1) * (1.0 / V))
    if z_loss:
        loss = loss + z * lse * lse
    loss = torch.where(ignored, 0.0, loss)
    if not grad:
        return loss, lse, logits.new_empty(0)
    scale = torch.where(ignored, 0.0, g)
    d = torch.exp(x - lse[:, None]) * (scale * (1 + 2 * z * lse) if z_loss else scale)[:, None]
    hit = scale * (1 - eps) if smoothing else scale
    d[torch.arange(len(t)), safe] -= hit
    if smoothing:
        d -= (scale * eps * (1.0 / V))[:, None]
    return loss, lse, d.to(logits.dtype).reshape(logits.shape)


def _check(bound) -> None:
    V = bound["logits"].shape[-1]
    if V < 2:
        raise ValueError(f"logits must have at least 2 classes in its last dimension; got {V}")
    coefs = bound["coefs"]
    if coefs.shape != (3,) or coefs.dtype != torch.float32:
        raise ValueError(f"coefs must be a float32 tensor of 3; got {coefs.dtype} {coefs.shape}")


# ----------------------------------------------------------------------------- CUDA


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors if t.numel())


def _fwd_cuda(logits, target, coefs, ignore_index, smoothing, z_loss, grad):
    V = logits.shape[-1]
    M = logits.numel() // V
    with device_guard(logits):
        x, t, c = logits.contiguous(), target.contiguous(), coefs.contiguous()
        loss = x.new_empty(M, dtype=torch.float32)
        lse = x.new_empty(M, dtype=torch.float32)
        d = torch.empty_like(x) if grad else x.new_empty(0)
        if M == 0:
            return loss, lse, d
        flag = torch.zeros(1, dtype=torch.int32, device=x.device)
        args = [x, t, c, loss, lse, *([d] if grad else []), flag, M, int(ignore_index)]
        launch_kernel(
            build_cross_entropy_fwd,
            lambda launcher: rows_grid(launcher, M),
            *args,
            **fwd_values(V, x.dtype, t.dtype, smoothing, z_loss, grad, _aligned(x, d)),
        )
        if int(flag.item()) == BAD_TARGET:  # waits for the kernel (module docstring)
            raise _bad_target(V, ignore_index)
    return loss, lse, d


def fwd_values(V, dtype, index_dtype, smoothing, z_loss, grad, vectorize) -> dict:
    """The forward kernel's table values for a call (the launch's and warmup_specs')."""
    return dict(N=V, dtype=DTYPE_NAMES[dtype], index_dtype=INDEX_NAMES[index_dtype],
                smoothing=bool(smoothing), z_loss=bool(z_loss), grad=bool(grad),
                vectorize=bool(vectorize))  # fmt: skip


# ----------------------------------------------------------------------------- rescale


@torch.library.custom_op("kbuild::cross_entropy_rescale_", mutates_args=("dlogits",))
def _rescale(dlogits: torch.Tensor, dloss: torch.Tensor, coefs: torch.Tensor) -> None:
    """dlogits[r] *= dloss[r] / coefs[0] where dloss[r] != coefs[0] (the rows' incoming
    gradient against the one the forward assumed), in place."""
    V = dlogits.shape[-1]
    d = dlogits.view(-1, V)
    factor = dloss.reshape(-1).float() / coefs[0]
    rows = dloss.reshape(-1) != coefs[0]
    d.copy_(torch.where(rows[:, None], d.float() * factor[:, None], d.float()).to(d.dtype))


@_rescale.register_kernel("cuda")
def _rescale_cuda(dlogits, dloss, coefs) -> None:
    V = dlogits.shape[-1]
    M = dlogits.numel() // V
    if M == 0:
        return
    with device_guard(dlogits):
        dloss = dloss.reshape(-1).float().contiguous()
        launch_kernel(
            build_cross_entropy_rescale,
            lambda launcher: rows_grid(launcher, M),
            dlogits, dloss, coefs, M,
            N=V, dtype=DTYPE_NAMES[dlogits.dtype], vectorize=_aligned(dlogits),
        )  # fmt: skip


@_rescale.register_fake
def _rescale_fake(dlogits, dloss, coefs) -> None:
    return None


def _setup(ctx, inputs, output) -> None:
    loss, lse, d = output
    ctx.save_for_backward(d, inputs[2])
    ctx.shape = inputs[0].shape


def _backward(ctx, dloss, dlse, ddlogits):
    d, coefs = ctx.saved_tensors
    if dloss is None or not d.numel():
        return None, None, None, None, None, None, None
    _rescale(d, dloss.expand(d.numel() // d.shape[-1]) if dloss.dim() == 0 else dloss, coefs)
    return d.view(ctx.shape), None, None, None, None, None, None


# The forward op: per-row loss and lse (fp32) and, with `grad`, the gradient (kernel above).
CROSS_ENTROPY = Op(
    "kbuild::cross_entropy_fwd",
    args=(
        Rows("logits"),
        Ids("target", rows_of="logits"),
        Tensors("coefs"),
        Scalar("ignore_index", "int", -100),
        Scalar("smoothing", "bool", False),
        Scalar("z_loss", "bool", False),
        Scalar("grad", "bool", True),
    ),
    outputs=(
        Out("loss", rows="logits"),
        Out("lse", rows="logits"),
        Out("dlogits", like="logits", when="grad"),
    ),
    reference=cross_entropy_reference,
    cuda=_fwd_cuda,
    autograd=(_setup, _backward),
    check=_check,
)


# ----------------------------------------------------------------------------- public


def _check_options(ignore_index, reduction, label_smoothing, lse_square_scale) -> None:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
    for name, value, high in (("label_smoothing", label_smoothing, 1.0),
                              ("lse_square_scale", lse_square_scale, math.inf)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {value!r}")
        if not (0.0 <= value <= high) or math.isnan(value) or math.isinf(value):
            limit = "in [0, 1]" if high == 1.0 else "finite and >= 0"
            raise ValueError(f"{name} must be {limit}; got {value}")


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy of `logits` (M, V) or (..., V), float32 / float16 / bfloat16, against
    class ids `target` (M,) or (...), int32 / int64, as torch.nn.functional.cross_entropy
    with the class dimension last, plus a z-loss `lse_square_scale * lse^2` per row (see the
    module docstring for the definitions, the design and the synchronisation it costs).

    Returns the mean over the rows whose target is not `ignore_index` ("mean"), the sum
    ("sum"), or each row's loss in target's shape ("none"), in the logits' dtype. Saved for
    backward: the gradient itself, written by the forward (logits-sized), and the 3 fp32
    coefficients; nothing else."""
    check_input("logits", logits)
    _check_options(ignore_index, reduction, label_smoothing, lse_square_scale)
    Ids("target", rows_of="logits").check(target, {"logits": logits})
    if logits.shape[-1] < 2:
        raise ValueError(
            f"logits must have at least 2 classes in its last dimension; got {logits.shape[-1]}"
        )
    valid = target != ignore_index
    if reduction == "mean":
        n_valid = valid.sum()
        scale = (1.0 / n_valid.float()).reshape(1)
    else:
        n_valid = None
        scale = torch.ones(1, dtype=torch.float32, device=logits.device)
    extra = torch.tensor([label_smoothing, lse_square_scale], dtype=torch.float32)
    coefs = torch.cat([scale, extra.to(logits.device, non_blocking=True)])
    grad = torch.is_grad_enabled() and logits.requires_grad
    loss, _, _ = CROSS_ENTROPY(logits, target, coefs, ignore_index, label_smoothing > 0,
                               lse_square_scale > 0, grad)  # fmt: skip
    if reduction == "none":
        return loss.view(target.shape).to(logits.dtype)
    total = loss.sum()
    if reduction == "mean":
        total = total / n_valid
    return total.to(logits.dtype)


# ----------------------------------------------------------------------------- warming

# The GPU tests' cases (tests/test_cross_entropy_gpu.py iterates them; warmup_specs warms
# them): vocabularies not a multiple of 8 among them (peeled rows), and a long row.
GPU_V = (2, 7, 1000, 4096, 50257, 151936)
GPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GPU_OPTIONS = ((0.0, 0.0), (0.1, 0.0), (0.0, 1e-4), (0.1, 1e-4))  # (label_smoothing, z)


def warmup_specs():
    """What `kbuild warmup --module kbuild.ops.loss` compiles: every kernel the GPU tests
    launch (aligned tensors), training and inference, both index dtypes."""
    specs = []
    for V in GPU_V:
        for dtype in GPU_DTYPES:
            for index in INDEX_NAMES:
                for smoothing, z in GPU_OPTIONS:
                    for grad in (True, False):
                        values = fwd_values(V, dtype, index, smoothing, z, grad, True)
                        specs.append(build_cross_entropy_fwd.spec(**values))
            specs.append(
                build_cross_entropy_rescale.spec(N=V, dtype=DTYPE_NAMES[dtype], vectorize=True)
            )
    return list(dict.fromkeys(specs))
