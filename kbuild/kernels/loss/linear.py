"""Fused linear cross-entropy: `kbuild.linear_cross_entropy(hidden, weight, target, ...)`, the
loss of an LM head `cross_entropy(hidden @ weight.T + bias, target)` without ever holding the
logits of all tokens.

    loss = kbuild.linear_cross_entropy(hidden, lm_head.weight, labels)      # (..., H), (V, H)
    loss = kbuild.linear_cross_entropy(hidden, w, labels, softcap=30.0, lse_square_scale=1e-4)

The design. Tokens go in chunks of `chunk_size` rows, in a fixed order. Per chunk:
    logits = hidden_c @ weight.T (+ bias)             torch's matmul, (rows, V) in hidden's dtype
    cross_entropy_fwd_(logits)                        kbuild's kernel: the chunk's loss and lse,
                                                      and d loss / d logits written over logits
    dhidden_c  = dlogits @ weight                     torch's matmuls: fp32 accumulation inside
    dweight   += dlogits.T @ hidden_c                 (cuBLAS), one rounding per chunk
    dbias     += column sums of dlogits (fp32)
The chunks' logits live in one buffer whose rows are padded to a multiple of 8 columns
(`_logits_buffer`: cuBLAS's aligned kernels for a vocabulary such as GPT-2's 50257), which
the cross-entropy kernels read and write as a (rows, V) view.

For a mean or a sum the gradients are computed in the forward, scaled as `loss.backward()`
needs them (1 / n_valid, counted on the device, or 1); the backward multiplies them by the
incoming gradient (a scalar on the device: no synchronisation; it reads and writes d(weight)
once more, which an incoming gradient that is exactly 1 does not need but a check would
cost a synchronisation). For reduction="none" the forward computes the loss only and the
backward runs the chunks again with each row's incoming gradient (kernels/loss/kernels.py's
rescale), one more matmul per chunk.

Memory. At most one chunk of logits lives at a time (the gradient takes its place), plus
d(hidden) (the size of hidden) and d(weight) (the size of the weight, in its dtype), both
held from the forward to the backward: Liger-Kernel's fused linear cross-entropy keeps the
same. The chunk is chosen from the shapes so its logits are a quarter of the weight's size (or
hidden's, or 256 MiB, if larger; at least 64 rows): every chunk costs four weights of memory
traffic and a few launches, so they are few (`chunk_rows`); under torch.compile they hold
at least COMPILED_ROWS rows (inductor's unfused loss is the path to beat there); `chunk_size`
overrides it (smaller: less memory, more traffic).

Precision. The logits are rounded to hidden's dtype once (the matmul's output), the loss and
log-sum-exp are fp32, the gradient of a chunk's logits is rounded to their dtype once. d(weight)
accumulates across chunks in the weight's dtype: fp32 for an fp32 weight, under autocast too
(the weight is cast to autocast's dtype inside, for the matmuls, and each chunk's 16-bit product
is added to the fp32 sum); for a 16-bit weight each chunk's fp32 product is added to a 16-bit
running sum, one rounding per chunk (an fp32 accumulator would cost 4 bytes x V x H more:
2.1 GB at Llama-3-8B's head). fp16 logits take a mean's 1 / n after: their gradient is written
unscaled (|p - y| <= 1) and the backward multiplies the sums by 1 / n times the incoming
gradient, so a loss scale (GradScaler) applies before the small terms would flush to zero, as
torch's unfused path applies it; a softmax term below fp16's smallest subnormal (6e-8) still
flushes, where torch keeps those above 6e-8 n / scale. Fixed chunk order
and no atomics: bitwise the same every run on the same device.

Works under autograd, torch.compile(fullgraph=True) (the forward and the recompute are custom
ops with fakes), CUDA graphs (the one host read, of the bad-target flag with `check_targets`,
is skipped under capture: see kbuild/kernels/loss/cross_entropy.py on targets) and autocast (hidden
is cast to autocast's dtype first, as F.linear would, the weight inside; gradients reach fp32
weights in fp32).
"""

from __future__ import annotations

import contextlib

import torch

from ...op.opdef import Ids
from ...op.tensors import check_input, device_guard, on_gpu
from .cross_entropy import PENDING, forward_in_place, raise_on_bad_targets, rescale_in_place
from .kernels import ROW_ALIGN
from .options import check_options, make_coefs, switches, z_loss_of

MIN_ROWS = 64  # the smallest chunk chosen: fewer rows make the matmuls inefficient
MIN_CHUNK_BYTES = 256 << 20  # the logits a chunk may always hold (see chunk_rows)
# Under torch.compile the default chunk holds at least this many rows. There the path the fused
# loss replaces is inductor's unfused one, 11-18% faster than the chunks chunk_rows picks
# (H100, 2026-12-07: the Llama-3-8B head 39.8 against 44.6 ms, Gemma 2's 55.4 against 67.4);
# chunks of 4096 rows ran 6-19% faster than those (41.8 and 56.3 ms), each chunk costing a
# read and write of d(weight) whatever its rows. The memory stays below the unfused path's:
# 4096 rows of logits against all of them.
COMPILED_ROWS = 4096

# ----------------------------------------------------------------------------- chunks


def chunk_rows(M: int, V: int, H: int, itemsize: int = 2, at_least: int = 0) -> int:
    """Rows per chunk: the chunk's logits (rows x V, `itemsize` bytes each) as large as a
    quarter of the weight (V x H), or hidden (M x H) where that is larger, or 256 MiB where
    that is larger still; a multiple of MIN_ROWS, at most M.

    Each chunk reads the weight twice (its logits, d hidden) and reads and writes d(weight)
    once, 4 x V x H elements of traffic a chunk whatever its rows: so the chunks are few, and
    the memory they take stays a quarter of the weight's above what d(weight) itself needs
    (peak <= 1.25x Liger's, whose chunks are smaller). Logits about hidden's size made 128
    chunks at the Gemma 2 head (284.8 ms against Liger's 141.0 on an H100, 2026-12-07, 156 ms
    of it d(weight)'s traffic): now 14. A small head's quarter would make chunks whose
    matmuls take less time than their launches (GPT-2's: 192 rows of 50257, about 30 us of
    GPU time a matmul): the 256 MiB floor keeps them a few (GPT-2's 2624 rows, Qwen3-1.7B's
    832, Gemma-3-1B's 512), about 3% of an 8 GB card. From the shapes alone (not the free
    memory), so the chunks, and with them the rounding of a 16-bit d(weight)'s sum, are the
    same on every run, captured or not, forward and recompute. `chunk_size=` sets it (fewer
    rows: less memory, more traffic). `at_least`: rows the chunk holds in any case (where M
    has them: COMPILED_ROWS under torch.compile)."""
    budget = max(M * H, V * H // 4, MIN_CHUNK_BYTES // itemsize)  # logits elements a chunk holds
    return max(1, min(max(MIN_ROWS, at_least, _fitting_rows(budget, V)), M))


def budget_rows(memory_budget: int, V: int, itemsize: int) -> int:
    """The rows per chunk whose logits (rows x V, `itemsize` bytes each) fit `memory_budget`
    bytes: a multiple of MIN_ROWS where more than MIN_ROWS fit, at least one row."""
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int):
        raise TypeError(f"memory_budget must be None or an int (bytes), got {memory_budget!r}")
    if memory_budget < 1:
        raise ValueError(f"memory_budget must be >= 1 byte; got {memory_budget}")
    return max(1, _fitting_rows(memory_budget // itemsize, V))


def _fitting_rows(elements: int, V: int) -> int:
    """The rows of V that `elements` hold, a multiple of MIN_ROWS where more than MIN_ROWS."""
    rows = elements // V
    return rows // MIN_ROWS * MIN_ROWS if rows >= MIN_ROWS else rows


def _chunks(hidden: torch.Tensor, weight: torch.Tensor, chunk: int) -> list[tuple[int, int]]:
    M = hidden.shape[0]
    if chunk <= 0:
        chunk = chunk_rows(M, weight.shape[0], hidden.shape[1], hidden.element_size())
    return [(s, min(M, s + chunk)) for s in range(0, M, chunk)]


def _logits(h, weight, bias, out: torch.Tensor) -> torch.Tensor:
    """The chunk's logits, written into `out` (rows x V)."""
    if bias is None:
        return torch.mm(h, weight.t(), out=out)
    return torch.addmm(bias, h, weight.t(), out=out)


def _pass(hidden, weight, bias, target, coefs, options, chunk, wants, dloss=None):
    """One pass over the chunks: the rows' loss and lse (fp32) and the gradients in `wants`
    (d hidden, d weight, d bias: each a tensor or an empty one), scaled by coefs[0], or with
    `dloss` by each row's incoming gradient. Returns the flag the kernels report into.

    A weight (and bias) wider than hidden (fp32 under autocast) is cast to hidden's dtype for
    the matmuls, and d(weight) sums each chunk's 16-bit product in its own dtype."""
    ignore_index, smoothing, z_loss, softcap = options
    widened = weight.dtype != hidden.dtype  # d(weight) is wider than the chunks' products
    if widened:
        weight = weight.to(hidden.dtype)
        bias = None if bias is None else bias.to(hidden.dtype)
    M = hidden.shape[0]
    loss, lse = (hidden.new_empty(M, dtype=torch.float32) for _ in range(2))
    dh, dw, db = wants
    grad = bool(dh.numel() or dw.numel() or db.numel())
    flag = torch.zeros(1, dtype=torch.int32, device=hidden.device)
    first = True  # d(weight) is set by the first chunk's product (no zero fill, no read of it)
    chunks = _chunks(hidden, weight, chunk)
    # One buffer for every chunk's logits: a new tensor a chunk held two chunks at the peak
    # (the last one's was freed only once the next one's was made: 250 MiB more at the
    # Llama-3-8B head, 1568 MiB against 1316 measured on an H100, 2026-12-07).
    rows = max((end - start for start, end in chunks), default=0)
    buffer = _logits_buffer(hidden, rows, weight.shape[0])
    for start, end in chunks:
        h, t = hidden[start:end], target[start:end]
        logits = _logits(h, weight, bias, buffer[: end - start])  # becomes its gradient below
        loss[start:end], lse[start:end] = forward_in_place(
            logits, t, coefs, flag, ignore_index, smoothing, z_loss, softcap, grad
        )
        if not grad:
            continue
        if dloss is not None:
            rescale_in_place(logits, dloss[start:end], coefs)
        if dh.numel():
            torch.mm(logits, weight, out=dh[start:end])
        if dw.numel():
            _add_dweight(dw, logits, h, first, widened)
        if db.numel():
            db += logits.sum(0, dtype=torch.float32)
        first = False
    if first and grad:
        dw.zero_()  # no rows: no chunk set it
    return loss, lse, flag


def _logits_buffer(hidden: torch.Tensor, rows: int, V: int) -> torch.Tensor:
    """The chunks' logits, (rows, V) in hidden's dtype, each row padded to a multiple of
    ROW_ALIGN columns: a (rows, V) view of wider rows. cuBLAS takes a matrix whose rows are
    not a whole number of 16 bytes apart (GPT-2's 50257 columns) on slower kernels, for the
    logits' product and for both products of their gradient; the cross-entropy kernels read
    and write the view where it lies (a launch argument, the row stride)."""
    width = -(-V // ROW_ALIGN) * ROW_ALIGN
    return hidden.new_empty(rows, width)[:, :V]


def _add_dweight(dw, dlogits, h, first: bool, widened: bool) -> None:
    """d(weight) += dlogits.T @ h, set by the `first` chunk; a `widened` (fp32) d(weight) sums
    each chunk's 16-bit product, one rounding each."""
    if widened:
        part = torch.mm(dlogits.t(), h)
        if first:
            dw.copy_(part)
        else:
            dw.add_(part)
    elif first:
        torch.mm(dlogits.t(), h, out=dw)
    else:
        dw.addmm_(dlogits.t(), h)


@contextlib.contextmanager
def _on_device(t: torch.Tensor):
    """The device guard of a CUDA tensor (nothing for a CPU one: these ops run on both), with
    autocast off: the public function cast the inputs as autocast would, and the chunks'
    matmuls must give the logits and gradients in their dtype (the out= buffers')."""
    with device_guard(t) if on_gpu(t) else contextlib.nullcontext():
        with torch.autocast(t.device.type, enabled=False):
            yield


def _wants(hidden, weight, bias, grad_hidden, grad_weight, grad_bias, make=None):
    """(d hidden, d weight, d bias fp32): new tensors where asked, else empty ones (distinct:
    a custom op's outputs may not alias). `make(shape, like, dtype)` makes d(bias)'s sum
    (zeros); d hidden, written whole chunk by chunk, and d weight, set by the first chunk, are
    left unset."""
    make = make or (lambda shape, like, dtype: like.new_zeros(shape, dtype=dtype))
    return (
        _empty(hidden.shape if grad_hidden else 0, hidden, hidden.dtype),
        _empty(weight.shape if grad_weight else 0, weight, weight.dtype),
        make(weight.shape[0] if grad_bias and bias is not None else 0, hidden, torch.float32),
    )


def _empty(shape, like, dtype):
    return like.new_empty(shape, dtype=dtype)


def _in_forward(reduction: str, *asked: bool) -> tuple[bool, ...]:
    """The gradients the forward computes: those asked for, but for "none" (the backward's)."""
    return asked if reduction != "none" else (False,) * len(asked)


# ----------------------------------------------------------------------------- the ops


@torch.library.custom_op("kbuild::linear_cross_entropy", mutates_args=())
def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    chunk: int,
    check_targets: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (M, H), weight (V, H), bias (V,) or None, target (M,) -> the loss (fp32: () for
    a mean or sum, (M,) for "none"), each row's lse (M,) fp32, and for a mean or a sum the
    gradients asked for (module docstring), each empty where not asked, and the factor (1,)
    fp32 they still take besides the incoming gradient. softcap 0: none."""
    mean = reduction == "mean"
    cap = softcap or None
    coefs, n_valid = make_coefs(target, ignore_index, mean, label_smoothing, lse_square_scale,
                                cap, weight.shape[0])  # fmt: skip
    later = coefs.new_ones(1)
    if mean and hidden.dtype == torch.float16:  # 1 / n applied after the fp16 gradient
        later, coefs = coefs[:1].clone(), torch.cat([later, coefs[1:]])
    options = switches(ignore_index, label_smoothing, lse_square_scale, cap)
    wants = _wants(hidden, weight, bias, *_in_forward(reduction, grad_hidden, grad_weight,
                                                       grad_bias))  # fmt: skip
    with _on_device(hidden):
        rows, lse, flag = _pass(hidden, weight, bias, target, coefs, options, chunk, wants)
        if check_targets and on_gpu(hidden):
            raise_on_bad_targets(flag, weight.shape[0], ignore_index)
    if reduction == "none":
        loss = rows
    else:
        loss = rows.sum() / n_valid if mean else rows.sum()
    return loss, lse, *wants, later


@_forward.register_fake
def _forward_fake(hidden, weight, bias, target, ignore_index, label_smoothing,
                  lse_square_scale, softcap, reduction, grad_hidden, grad_weight, grad_bias,
                  chunk, check_targets):  # fmt: skip
    M = hidden.shape[0]
    loss = hidden.new_empty((M,) if reduction == "none" else (), dtype=torch.float32)
    wants = _wants(hidden, weight, bias, *_in_forward(reduction, grad_hidden, grad_weight,
                                                       grad_bias), make=_empty)  # fmt: skip
    return loss, hidden.new_empty(M, dtype=torch.float32), *wants, loss.new_empty(1)


@torch.library.custom_op("kbuild::linear_cross_entropy_backward", mutates_args=())
def _recompute(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    dloss: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reduction="none"'s backward: the chunks again, each row's gradient scaled by its
    incoming `dloss` (M,) fp32."""
    cap = softcap or None
    coefs, _ = make_coefs(target, ignore_index, False, label_smoothing, lse_square_scale, cap,
                          weight.shape[0])  # fmt: skip
    options = switches(ignore_index, label_smoothing, lse_square_scale, cap)
    wants = _wants(hidden, weight, bias, grad_hidden, grad_weight, grad_bias)
    with _on_device(hidden):
        _pass(hidden, weight, bias, target, coefs, options, chunk, wants, dloss)
    return wants


@_recompute.register_fake
def _recompute_fake(hidden, weight, bias, target, dloss, ignore_index, label_smoothing,
                    lse_square_scale, softcap, grad_hidden, grad_weight, grad_bias,
                    chunk):  # fmt: skip
    return _wants(hidden, weight, bias, grad_hidden, grad_weight, grad_bias, make=_empty)


def _setup(ctx, inputs, output) -> None:
    hidden, weight, bias, target = inputs[:4]
    ctx.options = inputs[4:8]
    ctx.reduction, ctx.chunk = inputs[8], inputs[12]
    ctx.asked = inputs[9:12]
    ctx.bias_dtype = None if bias is None else bias.dtype
    if ctx.reduction == "none":
        ctx.save_for_backward(hidden, weight, bias, target)
    else:
        ctx.save_for_backward(*output[2:])
    # Only the loss takes a gradient: without this autograd filled a zero tensor for each
    # other output in every backward, d(weight)'s the size of the weight (the second
    # weight-sized tensor of the peak: 2.1 GB against Liger's 1.1 at the Llama-3-8B head).
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx, dloss, dlse, *unused):
    # bad targets of earlier calls whose kernels have run (kernels/loss/cross_entropy.py)
    PENDING.poll()
    if ctx.reduction == "none":
        hidden, weight, bias, target = ctx.saved_tensors
        dh, dw, db = _recompute(hidden, weight, bias, target, dloss.float().contiguous(),
                                *ctx.options, *ctx.asked, ctx.chunk)  # fmt: skip
    else:
        dh, dw, db, later = ctx.saved_tensors
        g = dloss.float() * later
        for d in (dh, dw, db):  # in place: no second hidden- or weight-sized tensor
            if d.numel():
                d.mul_(g)
    grads = (
        dh if ctx.asked[0] else None,
        dw if ctx.asked[1] else None,
        db.to(ctx.bias_dtype) if ctx.asked[2] and ctx.bias_dtype is not None else None,
    )
    return *grads, *(None,) * 11


_forward.register_autograd(_backward, setup_context=_setup)


# ----------------------------------------------------------------------------- public


def _autocast(hidden: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """hidden as the matmul under autocast would take it (cast to autocast's dtype where
    autocast is on for its device; autograd carries the cast's gradient back), and whether
    autocast is on. The weight and bias are cast inside the op, so d(weight) of an fp32
    weight is summed in fp32 and reaches it without a 16-bit round trip."""
    kind = hidden.device.type
    if not torch.is_autocast_enabled(kind):
        return hidden, False
    return hidden.to(torch.get_autocast_dtype(kind)), True


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    return_z_loss: bool = False,
    check_targets: bool = True,
    memory_budget: int | None = None,
):
    """cross_entropy(hidden @ weight.T + bias, target) without the logits of all tokens.

    hidden (..., H) float32 / float16 / bfloat16; weight (V, H) and bias (V,) of its dtype and
    device (under autocast, all three are cast to autocast's dtype first, as F.linear's inputs
    are); target (...) int32 / int64 class ids. The options are kbuild.cross_entropy's
    (kbuild/kernels/loss/cross_entropy.py); `chunk_size` is the rows per chunk (default: chosen from
    the shapes, module docstring; under torch.compile at least COMPILED_ROWS, to be as fast as
    inductor's unfused loss), or `memory_budget` the bytes a chunk's logits may take (the rows
    that fit, a multiple of 64 where more than 64 fit, at least one: a smaller budget costs time,
    one more read and write of d(weight) a chunk); give one of the two. Returns the loss in
    fp32 (as Hugging Face's loss of upcast logits): the mean over rows whose target is in
    [0, V) and not `ignore_index`, the sum, or each row's ("none", target's shape); with
    `return_z_loss`, (loss, z_loss) as kbuild.cross_entropy gives them. Saved for backward:
    d(hidden) and d(weight) (and d(bias)), computed by the forward, for a mean or a sum;
    hidden, weight, bias and target for "none" (the backward recomputes the chunks' logits)."""
    PENDING.poll()
    check_input("hidden", hidden)
    check_input("weight", weight)
    check_options(ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    H = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(
            f"weight must be (V, H) with H = hidden's last dimension {H}; got {tuple(weight.shape)}"
        )
    V = weight.shape[0]
    if V < 2:
        raise ValueError(f"weight must have at least 2 rows (classes); got {V}")
    if bias is not None:
        check_input("bias", bias)
        if bias.shape != (V,):
            raise ValueError(f"bias must be (V,) = ({V},); got {tuple(bias.shape)}")
    hidden, autocast = _autocast(hidden)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != hidden.dtype and not autocast:
            raise TypeError(f"{name} must have hidden's dtype ({hidden.dtype}); got {t.dtype}")
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} must be on hidden's device {hidden.device}; got {t.device}")
    Ids("target", rows_of="hidden").check(target, {"hidden": hidden})
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)):
        raise TypeError(f"chunk_size must be None or an int, got {chunk_size!r}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    if memory_budget is not None:
        if chunk_size is not None:
            raise ValueError("give chunk_size or memory_budget, not both")
        chunk_size = budget_rows(memory_budget, V, hidden.element_size())
    elif chunk_size is None and torch.compiler.is_compiling():  # traced: COMPILED_ROWS says why
        M = hidden.numel() // H
        chunk_size = chunk_rows(M, V, H, hidden.element_size(), at_least=COMPILED_ROWS)
    for name, value in (("return_z_loss", return_z_loss), ("check_targets", check_targets)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    grad = torch.is_grad_enabled()
    asked = (
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
        grad and bias is not None and bias.requires_grad,
    )
    flat = hidden.reshape(-1, H)
    loss, lse, *_ = _forward(
        flat, weight, bias, target.reshape(-1), ignore_index, float(label_smoothing),
        float(lse_square_scale), float(softcap or 0.0), reduction, *asked, chunk_size or 0,
        check_targets,
    )  # fmt: skip
    loss = loss.view(target.shape) if reduction == "none" else loss
    if not return_z_loss:
        return loss
    return loss, z_loss_of(lse, target, ignore_index, lse_square_scale, reduction, torch.float32,
                           weight.shape[0])  # fmt: skip
