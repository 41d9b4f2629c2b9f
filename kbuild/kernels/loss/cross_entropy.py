"""Cross-entropy as training needs it: `kbuild.cross_entropy(logits, target, ...)`.

    loss = kbuild.cross_entropy(logits, target)               # (M, V) or (..., V), ids (...)
    loss = kbuild.cross_entropy(logits, target, reduction="sum", label_smoothing=0.1,
                                lse_square_scale=1e-4, softcap=30.0, ignore_index=-100)

The design: the forward writes the gradient. One kernel per call (kernels/loss/kernels.py)
reads each row of logits once, takes one online (max, sum-exp) reduction, and writes the
row's loss, its log-sum-exp and, when the logits need a gradient, d loss / d logits scaled
by the incoming gradient the forward assumes (llm.c's fused classifier): 1 / n_valid for a
mean (n_valid: the rows whose target is not ignore_index, counted on the device, no
synchronisation), 1 for a sum or "none". The backward (`kbuild::cross_entropy_rescale_`)
rescales that gradient in place, row by row, only where the incoming gradient differs from
the one assumed: `loss.backward()` of a mean or a sum costs one scalar read per row. Under
autograd that is the physical floor (the logits read once, their gradient written once); the
other design (save lse, recompute softmax in the backward) reads the logits twice. Its cost
is memory: the gradient is held from the forward to the backward, the size of the logits.
`inplace_backward=True` writes it over the logits instead (`kbuild::cross_entropy_fwd_`),
which saves that memory where nothing else needs the logits (the usual case: an lm_head's
matmul saves its inputs, not its output); where something does, autograd refuses its
backward ("modified by an inplace operation") rather than computing with gradients.

Definitions. With a soft cap c (Gemma 2's `final_logit_softcapping`) the logits are first
x = c tanh(x_in / c). loss_r = (1 - eps) (lse_r - x_r[t_r]) + eps (lse_r - mean_j x_r[j]) +
z lse_r^2: eps is torch's `label_smoothing` (the target distribution (1 - eps) one-hot +
eps / V); z is `lse_square_scale`, the z-loss of PaLM (Chowdhery et al. 2022, 1e-4 there)
as Liger-Kernel defines it (added to each row's loss; torch has no such option). Log-sum-exp
and every sum are fp32 whatever the logits' dtype; the loss has the logits' dtype (torch's),
the gradient too. A row whose target is `ignore_index` adds 0 to the loss and gets a zero
gradient; a mean over no valid row is NaN (torch's 0 / 0).

Targets. A target outside [0, V) that is not ignore_index is reported by the kernel into an
int32 flag (dsl.report; the row is then treated as ignored) and, with `check_targets=True`
(the default), raises ValueError naming `target`, without a host synchronisation: the flag
is copied to pinned host memory behind an event, and read once the event has completed, at
the next `kbuild.cross_entropy` / `linear_cross_entropy` call or backward (a bad target of
step n raises in step n's backward or step n + 1 at the latest; `kbuild.check_targets()`
waits and reads every pending flag now). On a CPU (the interpreter) the kernel has run when
the call returns, so the call itself raises. Reading the flag at once cost every call a
synchronisation: 0.9 ms of wall time at 8192 x 128256 on an H100 (2026-12-07).
`check_targets=False` makes no copy; nor does a call captured into a CUDA graph. The
gradient is deterministic: no float atomics, bitwise the same every run. Running the
backward twice (retain_graph=True) is refused by autograd: the saved gradient is rescaled in
place the first time.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import cases
from ...jit import target_of
from ...op.launch import launch_kernel, rows_grid
from ...op.opdef import Ids, Op, Out, Rows, Scalar, Tensors, plain_eager
from ...op.tensors import (
    DTYPE_NAMES,
    INDEX_NAMES,
    INTERPRETED,
    aligned,
    capturing,
    check_input,
    data_ptrs,
    device_guard,
    on_gpu,
    row_count,
)
from .kernels import (
    BAD_TARGET,
    build_cross_entropy_fwd,
    build_cross_entropy_rescale,
    forward_keywords,
    vocab_specs,
)
from .options import check_options, make_coefs, reduce_rows, switches, z_loss_of

# ----------------------------------------------------------------------------- references


def _bad_target(V: int, ignore_index: int) -> ValueError:
    return ValueError(
        f"target must hold class ids in [0, {V}) or ignore_index ({ignore_index}); it holds "
        "one outside that range"
    )


def cross_entropy_reference(logits, target, coefs, ignore_index, smoothing, z_loss, softcap,
                            grad, check_targets=True):  # fmt: skip
    """fp32 math, one rounding of the gradient to the logits' dtype: what CPU tensors run,
    and the kernel's contract. coefs = (gradient scale, label smoothing, z-loss scale, soft
    cap). A bad target raises on CPU whatever `check_targets` says (the check is free here)."""
    V = logits.shape[-1]
    x = logits.reshape(-1, V).float()
    t = target.reshape(-1).long()
    g, eps, z, cap = coefs.float().unbind()
    if softcap:
        x = cap * torch.tanh(x / cap)
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
    if softcap:
        d *= 1 - (x / cap) ** 2
    return loss, lse, d.to(logits.dtype).reshape(logits.shape)


def _classes(logits: torch.Tensor) -> int:
    """V, the logits' last dimension, which must hold at least 2 classes."""
    V = logits.shape[-1]
    if V < 2:
        raise ValueError(f"logits must have at least 2 classes in its last dimension; got {V}")
    return V


def _check(bound) -> None:
    _classes(bound["logits"])
    coefs = bound["coefs"]
    if coefs.shape != (4,) or coefs.dtype != torch.float32:
        raise ValueError(f"coefs must be a float32 tensor of 4; got {coefs.dtype} {coefs.shape}")


# ----------------------------------------------------------------------------- CUDA


def _fwd_cuda(logits, target, coefs, ignore_index, smoothing, z_loss, softcap, grad,
              check_targets=True):  # fmt: skip
    V = logits.shape[-1]
    M = logits.numel() // V
    with device_guard(logits):
        x = logits.contiguous()
        loss, lse = _new_rows(x, M)
        d = torch.empty_like(x) if grad else x.new_empty(0)
        flag = torch.zeros(1, dtype=torch.int32, device=x.device)
        _launch_fwd(x, V, target, coefs, loss, lse, d if grad else None, flag, ignore_index,
                    smoothing, z_loss, softcap)  # fmt: skip
        if check_targets:
            raise_on_bad_targets(flag, V, ignore_index)
    return loss, lse, d


def _new_rows(x: torch.Tensor, M: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (x.new_empty(M, dtype=torch.float32), x.new_empty(M, dtype=torch.float32))


def _launch_fwd(x, stride, target, coefs, loss, lse, d, flag, ignore_index, smoothing, z_loss,
                softcap) -> None:  # fmt: skip
    """The forward kernel on logits `x`, (..., V) rows `stride` elements apart (V where
    contiguous; `row_stride`); `d` None (no gradient), a new contiguous tensor (then `x` is
    contiguous), or `x` itself (in place)."""
    V = x.shape[-1]
    M = row_count(x)
    if M == 0:
        return
    grad = d is not None
    args = [x, target.contiguous(), coefs.contiguous(), loss, lse, *([d] if grad else []),
            flag, M, int(ignore_index), *([stride] if stride != V else [])]  # fmt: skip
    values = fwd_values(V, x.dtype, target.dtype, smoothing, z_loss, grad,
                        _vectorizable(x, stride, d), softcap, stride != V)  # fmt: skip
    values.update(forward_keywords(V, values["dtype"], values["vectorize"], M,
                                   target_of(x.get_device())))  # fmt: skip
    launch_kernel(build_cross_entropy_fwd, lambda launcher: rows_grid(launcher, M), *args,
                  **values)  # fmt: skip


def row_stride(x: torch.Tensor) -> int | None:
    """The elements between consecutive rows of `x` seen as (M, V) rows of contiguous
    elements: V where it is contiguous, more for a view of wider rows (`logits[..., :V]` of a
    padded vocabulary, the fused linear loss's chunks); None where its rows are not evenly
    strided (they must be copied)."""
    V = x.shape[-1]
    if x.stride(-1) != 1 and not x.is_contiguous():
        return None
    try:  # (view keeps a 2-d tensor's strides; it may renumber a 1-row one's)
        rows = x if x.dim() == 2 else x.view(-1, V)
    except RuntimeError:  # leading dimensions that do not merge into one row index
        return None
    if rows.shape[0] <= 1:  # one row: its stride is free (a chunk's last row keeps the view's)
        return max(rows.stride(0), V)
    return rows.stride(0) if rows.stride(0) >= V else None  # (overlapping rows: None)


def _vectorizable(x: torch.Tensor, stride: int, d: torch.Tensor | None) -> bool:
    """128-bit accesses: 16-byte aligned data, and for a view of wider rows, rows a whole
    number of 16 bytes apart (dense rows of a width that is not a whole number of vectors are
    peeled: each row's phase is found in the kernel)."""
    wide = x.shape[-1] != stride
    return aligned(*data_ptrs(x, d)) and not (wide and (stride * x.element_size()) % 16)


class _PendingChecks:
    """Bad-target flags of launched calls, read without waiting: each is copied to pinned
    host memory behind an event, and read once its event has completed, by a later call or
    backward (`poll`); `wait` reads them all, synchronising. On a CPU (the interpreter) the
    kernel has run when the launch returns: the call itself raises."""

    def __init__(self) -> None:
        self.pending: list[tuple[Any, torch.Tensor, int, int]] = []

    def add(self, flag: torch.Tensor, V: int, ignore_index: int) -> None:
        if capturing():  # no copy can be made into a graph
            return
        if flag.device.type == "cpu":  # the kernel has run: this call raises
            if int(flag.item()) == BAD_TARGET:
                raise _bad_target(V, ignore_index)
            return
        host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending.append((event, host, V, ignore_index))  # read by a later call

    def poll(self, wait: bool = False) -> None:
        """Read the flags whose kernels have run (every flag with `wait`); ValueError for the
        first bad one (the others of that call and before it are dropped with it)."""
        if not self.pending:
            return
        done = [wait or e.query() for e, *_ in self.pending]
        ready = [p for p, d in zip(self.pending, done, strict=True) if d]
        self.pending = [p for p, d in zip(self.pending, done, strict=True) if not d]
        for event, host, V, ignore_index in ready:
            if wait:
                event.synchronize()
            if int(host.item()) == BAD_TARGET:
                raise _bad_target(V, ignore_index)


PENDING = _PendingChecks()


def check_targets() -> None:
    """Wait for every cross-entropy call made so far and raise ValueError if one of them
    was given a target outside [0, V) (calls raise without waiting, later: module
    docstring)."""
    PENDING.poll(wait=True)


def raise_on_bad_targets(flag: torch.Tensor, V: int, ignore_index: int) -> None:
    """ValueError where a kernel reported a target outside [0, V) into `flag`, once the
    kernel has run: now on a CPU, at a later call or backward on a GPU (no synchronisation);
    nothing while the stream is being captured into a CUDA graph."""
    PENDING.add(flag, V, ignore_index)


def fwd_values(V, dtype, index_dtype, smoothing, z_loss, grad, vectorize, softcap=False,
               strided=False) -> dict:  # fmt: skip
    """The forward kernel's table values for a call (the launch's and warmup_specs')."""
    values = dict(N=V, dtype=DTYPE_NAMES[dtype], index_dtype=INDEX_NAMES[index_dtype],
                  smoothing=bool(smoothing), z_loss=bool(z_loss), softcap=bool(softcap),
                  grad=bool(grad), vectorize=bool(vectorize))  # fmt: skip
    if strided:  # (unkeyed: the dense kernels' specs do not name it)
        values["strided"] = True
    return values


# ----------------------------------------------------------------------------- in place


@torch.library.custom_op("kbuild::cross_entropy_fwd_", mutates_args=("logits", "flag"))
def cross_entropy_fwd_(
    logits: torch.Tensor,
    target: torch.Tensor,
    coefs: torch.Tensor,
    flag: torch.Tensor,
    ignore_index: int,
    smoothing: bool,
    z_loss: bool,
    softcap: bool,
    grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward with the gradient (where `grad`) written over `logits` ((..., V), its
    rows contiguous, evenly strided: `row_stride`): per-row loss and lse (fp32). A bad target
    raises `flag` to BAD_TARGET (the caller reads it: several calls may share one flag); on
    CPU it raises at once."""
    loss, lse, d = cross_entropy_reference(logits, target, coefs, ignore_index, smoothing,
                                           z_loss, softcap, grad)  # fmt: skip
    if grad:
        logits.copy_(d)
    return loss, lse


@cross_entropy_fwd_.register_kernel("cuda")
def _fwd_inplace_cuda(logits, target, coefs, flag, ignore_index, smoothing, z_loss, softcap,
                      grad=True):  # fmt: skip
    stride = row_stride(logits)
    if stride is None:
        raise ValueError(
            "logits must be (..., V) rows of contiguous elements, evenly strided (a view of "
            "wider rows is), to take its gradient in place"
        )
    with device_guard(logits):
        loss, lse = _new_rows(logits, row_count(logits))
        _launch_fwd(logits, stride, target, coefs, loss, lse, logits if grad else None, flag,
                    ignore_index, smoothing, z_loss, softcap)  # fmt: skip
    return loss, lse


if INTERPRETED:  # CPU tensors take the CUDA path
    cross_entropy_fwd_.register_kernel("cpu")(_fwd_inplace_cuda)


@cross_entropy_fwd_.register_fake
def _fwd_inplace_fake(logits, target, coefs, flag, ignore_index, smoothing, z_loss, softcap,
                      grad=True):  # fmt: skip
    M = logits.numel() // logits.shape[-1]
    return _new_rows(logits, M)


class _InPlace(torch.autograd.Function):
    """cross_entropy with `inplace_backward`: the forward writes the gradient over the logits
    and the backward rescales it there (module docstring)."""

    @staticmethod
    def forward(ctx, logits, target, coefs, ignore_index, smoothing, z_loss, softcap, check):
        flag = torch.zeros(1, dtype=torch.int32, device=logits.device)
        loss, lse = cross_entropy_fwd_(logits, target, coefs, flag, ignore_index, smoothing,
                                       z_loss, softcap)  # fmt: skip
        if check and on_gpu(logits):
            with device_guard(logits):
                raise_on_bad_targets(flag, logits.shape[-1], ignore_index)
        ctx.save_for_backward(logits, coefs)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    def backward(ctx, dloss, dlse):
        PENDING.poll()
        d, coefs = ctx.saved_tensors
        if d.numel():
            rescale_(d, dloss, coefs)
        return d, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------- rescale


@torch.library.custom_op("kbuild::cross_entropy_rescale_", mutates_args=("dlogits",))
def rescale_(dlogits: torch.Tensor, dloss: torch.Tensor, coefs: torch.Tensor) -> None:
    """dlogits[r] *= dloss[r] / coefs[0] where dloss[r] != coefs[0] (the rows' incoming
    gradient against the one the forward assumed), in place."""
    V = dlogits.shape[-1]
    d = dlogits.view(-1, V)
    factor = dloss.reshape(-1).float() / coefs[0]
    rows = dloss.reshape(-1) != coefs[0]
    d.copy_(torch.where(rows[:, None], d.float() * factor[:, None], d.float()).to(d.dtype))


@rescale_.register_kernel("cuda")
def _rescale_cuda(dlogits, dloss, coefs) -> None:
    V = dlogits.shape[-1]
    M = row_count(dlogits)
    if M == 0:
        return
    stride = row_stride(dlogits)
    if stride is None:
        raise ValueError("dlogits must be (..., V) rows of contiguous elements, evenly strided")
    strided = {"strided": True} if stride != V else {}
    with device_guard(dlogits):
        dloss = dloss.reshape(-1).float().contiguous()
        launch_kernel(
            build_cross_entropy_rescale,
            lambda launcher: rows_grid(launcher, M),
            dlogits, dloss, coefs, M, *([stride] if strided else []),
            N=V, dtype=DTYPE_NAMES[dlogits.dtype],
            vectorize=_vectorizable(dlogits, stride, None), **strided,
        )  # fmt: skip


if INTERPRETED:
    rescale_.register_kernel("cpu")(_rescale_cuda)


@rescale_.register_fake
def _rescale_fake(dlogits, dloss, coefs) -> None:
    return None


def _setup(ctx, inputs, output) -> None:
    loss, lse, d = output
    ctx.save_for_backward(d, inputs[2])
    ctx.shape = inputs[0].shape
    # lse and the gradient output get no gradient: without this autograd filled a
    # logits-sized zero tensor for d's every backward (0.64 ms at 8192 x 128256 on an H100)
    ctx.mark_non_differentiable(lse, d)
    ctx.set_materialize_grads(False)


def _backward(ctx, dloss, dlse, ddlogits):
    PENDING.poll()
    d, coefs = ctx.saved_tensors
    nothing = (None,) * 8
    if dloss is None or not d.numel():
        return None, *nothing
    dloss = dloss.expand(d.numel() // d.shape[-1]) if dloss.dim() == 0 else dloss
    rescale_in_place(d, dloss, coefs)  # (its version bumped: a second backward fails)
    return d.view(ctx.shape), *nothing


def forward_in_place(logits, target, coefs, flag, ignore_index, smoothing, z_loss, softcap,
                     grad=True):  # fmt: skip
    """`cross_entropy_fwd_` as kbuild calls it (the fused linear loss's chunks): on plain
    eager tensors its kernel without the dispatcher (as `Op.run`), the logits' version
    bumped as the op's mutation does; else the op."""
    if not plain_eager((logits, target, coefs, flag)):
        return cross_entropy_fwd_(logits, target, coefs, flag, ignore_index, smoothing,
                                  z_loss, softcap, grad)  # fmt: skip
    out = _fwd_inplace_cuda(logits, target, coefs, flag, ignore_index, smoothing, z_loss,
                            softcap, grad)  # fmt: skip
    torch.autograd.graph.increment_version(logits)
    return out


def rescale_in_place(dlogits, dloss, coefs) -> None:
    """`rescale_` as kbuild calls it (the backward, the fused loss's chunks): see
    `forward_in_place`."""
    if not plain_eager((dlogits, dloss, coefs)):
        rescale_(dlogits, dloss, coefs)
        return
    _rescale_cuda(dlogits, dloss, coefs)
    torch.autograd.graph.increment_version(dlogits)


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
        Scalar("softcap", "bool", False),
        Scalar("grad", "bool", True),
        Scalar("check_targets", "bool", True),
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


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    inplace_backward: bool = False,
    check_targets: bool = True,
):
    """Cross-entropy of `logits` (M, V) or (..., V), float32 / float16 / bfloat16, against
    class ids `target` (M,) or (...), int32 / int64, as torch.nn.functional.cross_entropy
    with the class dimension last, plus a z-loss `lse_square_scale * lse^2` per row and an
    optional logit soft cap `softcap * tanh(logits / softcap)` (see the module docstring for
    the definitions, the design and the synchronisation `check_targets` costs).

    Returns the mean over the rows whose target is not `ignore_index` ("mean"), the sum
    ("sum"), or each row's loss in target's shape ("none"), in the logits' dtype; with
    `return_z_loss`, the pair (loss, z_loss), z_loss the z-loss term of it reduced the same
    way (for logging; no gradient flows through it). Saved for backward: the gradient itself,
    written by the forward (logits-sized; with `inplace_backward`, written over the logits,
    which then hold it: the logits must not be a leaf, and their rows contiguous, evenly
    strided, as a view of a padded vocabulary's `logits[..., :V]` is), and the 4 fp32
    coefficients; nothing else. Without `inplace_backward` such a view is copied first."""
    PENDING.poll()
    check_input("logits", logits)
    check_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    Ids("target", rows_of="logits").check(target, {"logits": logits})
    V = _classes(logits)
    for name, value in (("return_z_loss", return_z_loss), ("inplace_backward", inplace_backward),
                        ("check_targets", check_targets)):  # fmt: skip
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    coefs, n_valid = make_coefs(target, ignore_index, reduction == "mean", label_smoothing,
                                lse_square_scale, softcap, V)  # fmt: skip
    grad = torch.is_grad_enabled() and logits.requires_grad
    options = switches(ignore_index, label_smoothing, lse_square_scale, softcap)
    if inplace_backward and grad:
        if logits.is_leaf or row_stride(logits) is None:
            raise ValueError(
                "inplace_backward writes the gradient over logits, which must be (..., V) rows "
                "of contiguous elements, evenly strided, and not a leaf tensor (its values would "
                "be lost to the caller)"
            )
        rows, lse = _InPlace.apply(logits, target, coefs, *options, check_targets)
    else:
        # Op.run, not CROSS_ENTROPY(...): its argument checks are the ones above
        rows, lse, _ = CROSS_ENTROPY.run(logits, target, coefs, *options, grad,
                                         check_targets)  # fmt: skip
    loss = reduce_rows(rows, target, reduction, n_valid).to(logits.dtype)
    if not return_z_loss:
        return loss
    return loss, z_loss_of(lse, target, ignore_index, lse_square_scale, reduction, logits.dtype, V)


# ----------------------------------------------------------------------------- warming


def warmup_specs():
    """What `kbuild warmup --module kbuild.kernels.loss.cross_entropy` compiles: every kernel the
    GPU tests launch, and the benchmarks' (bench/bench_loss.py) vocabularies in bf16."""
    specs = [s for V in cases.CE_GPU_V for s in vocab_specs(V)]
    specs += [s for V in cases.CE_BENCH_V for s in vocab_specs(V, ("bf16",))]
    return list(dict.fromkeys(specs))
