"""llm.c's kernels as PyTorch functions: GPT-2's encoder and the linear layer's bias gradient.

    out = kbuild.encoder(tokens, wte, wpe)      # (B, T, C) = wte[tokens] + wpe[:T]
    y = kbuild.linear(x, weight, bias)          # x @ weight.T + bias; dbias by kbuild
    db = kbuild.bias_grad(dout)                 # dout summed over every row, fp32 sums

They are kbuild::* operators, each declared once (`Op`: schema, CPU reference, fake,
autograd; the CUDA kernels launch from Python, kernels/llmc/launch.py), so they work eagerly, under
torch.compile(fullgraph=True) and inside CUDA graphs, on CPU as on the GPU. The gradients of
wte, wpe and bias are deterministic: bitwise the same on every run (no float atomics).

Token ids are not range-checked on CUDA by default (a check reads every id back to the host,
a synchronisation per call): an id outside [0, V) gives a NaN row in the forward and adds
nothing in the backward, never an out-of-bounds access. `check_ids=True` checks them (and
synchronises); CPU tensors are always checked.
"""

from __future__ import annotations

import torch

from ...op.opdef import STANDIN, Op, Out, Rows, Scalar, Tensors
from ...op.tensors import INDEX_NAMES, check_input, contiguous, device_guard, on_gpu
from ..norms import api
from .launch import bias_grad as _bias_grad_launch
from .launch import (
    bias_grad_reference,
    encoder_bwd,
    encoder_bwd_reference,
    encoder_fwd,
    encoder_reference,
)

# ----------------------------------------------------------------------------- kernels


def _encoder_fwd_cuda(tokens, wte, wpe):
    with device_guard(wte):
        return encoder_fwd(tokens.contiguous(), wte.contiguous(), wpe.contiguous())


def _encoder_bwd_cpu(dout, tokens, vocab, positions, need_wte, need_wpe):
    dwte, dwpe = encoder_bwd_reference(dout, tokens, vocab, positions)
    return dwte.to(dout.dtype), dwpe.to(dout.dtype)


def _encoder_bwd_cuda(dout, tokens, vocab, positions, need_wte, need_wpe):
    C = dout.shape[-1]
    with device_guard(dout):
        dout = dout.contiguous()
        dwte = dwpe = None
        if need_wte:  # every id's row is added to: untouched rows stay zero
            dwte = torch.zeros(vocab, C, dtype=dout.dtype, device=dout.device)
        if need_wpe:  # rows [0, T) are written whole, the rest are zero
            dwpe = torch.empty(positions, C, dtype=dout.dtype, device=dout.device)
            dwpe[tokens.shape[-1] :].zero_()
        encoder_bwd(dout, tokens.contiguous(), dwte, dwpe, add_to_dwpe=False)
    empty = dout.new_empty(0)
    return (dwte if need_wte else empty), (dwpe if need_wpe else empty)


def _bias_grad_cuda(dout):
    with device_guard(dout):
        return _bias_grad_launch(contiguous(dout).view(-1, dout.shape[-1]))


def _encoder_setup(ctx, inputs, output):
    tokens, wte, wpe = inputs
    ctx.save_for_backward(tokens)
    ctx.vocab, ctx.positions = wte.shape[0], wpe.shape[0]


def _encoder_backward(ctx, dout):
    (tokens,) = ctx.saved_tensors
    need_wte, need_wpe = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    dwte, dwpe = ENCODER_BWD.run(dout, tokens, ctx.vocab, ctx.positions, need_wte, need_wpe)
    return None, (dwte if need_wte else None), (dwpe if need_wpe else None)


# ----------------------------------------------------------------------------- the operators
# Their launches are Python's (kernels/llmc/launch.py), bias_grad's the C++ extension's
# where it loads.

ENCODER_FWD = Op(
    "kbuild::encoder_fwd",
    args=(Tensors("tokens"), Rows("wte"), Rows("wpe")),
    outputs=(Out("out", like="wte", shape=lambda b: (*b["tokens"].shape, b["wte"].shape[1])),),
    reference=encoder_reference,
    cuda=_encoder_fwd_cuda,
    autograd=(_encoder_setup, _encoder_backward),
)


def _table(bound, rows: str) -> tuple:
    """The shape of an embedding table's gradient: (rows, C)."""
    return bound[rows], bound["dout"].shape[-1]


ENCODER_BWD = Op(
    "kbuild::encoder_bwd",
    args=(
        Rows("dout"),
        Tensors("tokens"),
        Scalar("vocab", "SymInt"),
        Scalar("positions", "SymInt"),
        Scalar("need_wte", "bool"),
        Scalar("need_wpe", "bool"),
    ),
    outputs=(
        Out("dwte", like="dout", shape=lambda b: _table(b, "vocab"), when="need_wte"),
        Out("dwpe", like="dout", shape=lambda b: _table(b, "positions"), when="need_wpe"),
    ),
    reference=_encoder_bwd_cpu,
    cuda=_encoder_bwd_cuda,
)
BIAS_GRAD = Op(
    "kbuild::bias_grad",
    args=(Rows("dout"),),
    outputs=(Out("dbias", like="dout", shape=lambda b: (b["dout"].shape[-1],)),),
    reference=bias_grad_reference,
    cuda=_bias_grad_cuda,
    native=True,  # the extension's C++ kernel (two launches by handle) where it loads
)
STANDIN.register_until_native(BIAS_GRAD)  # the Python kernel until then

encoder_fwd_op = ENCODER_FWD.overload
encoder_bwd_op = ENCODER_BWD.overload
bias_grad_op = BIAS_GRAD.overload


# ----------------------------------------------------------------------------- checks


def _check_tokens(tokens: object) -> torch.Tensor:
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dtype not in INDEX_NAMES:
        raise TypeError(f"tokens must be torch.int32 or torch.int64 ids; got {tokens.dtype}")
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be (B, T); got shape {tuple(tokens.shape)}")
    return tokens


def _check_table(name: str, t: object, what: str) -> torch.Tensor:
    check_input(name, t)
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D ({what}, C); got shape {tuple(t.shape)}")
    return t


def check_encoder_args(tokens, wte, wpe, check_ids: bool) -> None:
    _check_tokens(tokens)
    _check_table("wte", wte, "vocab_size")
    _check_table("wpe", wpe, "max_positions")
    if wpe.dtype != wte.dtype:
        raise TypeError(f"wpe must have wte's dtype ({wte.dtype}); got {wpe.dtype}")
    if wpe.shape[1] != wte.shape[1]:
        raise ValueError(
            f"wpe must have wte's embedding dim C = {wte.shape[1]}; got {wpe.shape[1]}"
        )
    for name, t in (("wte", wte), ("wpe", wpe)):
        if t.device != tokens.device:
            raise ValueError(f"{name} must be on tokens' device {tokens.device}; got {t.device}")
    T = tokens.shape[1]
    if T > wpe.shape[0]:
        raise ValueError(
            f"sequence length T = {T} exceeds wpe's {wpe.shape[0]} positions (max_positions)"
        )
    if (check_ids or not on_gpu(tokens)) and tokens.numel() and not torch.compiler.is_compiling():
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= wte.shape[0]:
            bad = low if low < 0 else high
            raise ValueError(f"tokens must be ids in [0, {wte.shape[0]}) (wte's rows); got {bad}")


# ----------------------------------------------------------------------------- public


def encoder(
    tokens: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor, check_ids: bool = False
) -> torch.Tensor:
    """GPT-2's token + position embedding: out[b, t] = wte[tokens[b, t]] + wpe[t].

    tokens: (B, T) int32 or int64 ids; wte: (V, C) and wpe: (max_positions >= T, C), one
    float dtype, on tokens' device. Returns (B, T, C) in wte's dtype (the sum taken in fp32).
    Differentiable in wte and wpe, deterministically. `check_ids`: check on CUDA that every
    id is in [0, V) (reads them back: a synchronisation); unchecked, a bad id gives a NaN row.
    """
    check_encoder_args(tokens, wte, wpe, check_ids)
    return encoder_fwd_op(tokens, wte, wpe)


def encoder_backward(
    dout: torch.Tensor,
    tokens: torch.Tensor,
    dwte: torch.Tensor | None = None,
    dwpe: torch.Tensor | None = None,
) -> None:
    """Add the encoder's gradients into existing ones, in place: dwte[v] += the sum of
    dout[b, t] over the positions where tokens[b, t] == v, dwpe[t] += the sum over b of
    dout[b, t]. For a hand-written training loop whose wte gradient already holds the tied
    output projection's part (GPT-2): no second (V, C) tensor and no add. Deterministic."""
    _check_tokens(tokens)
    check_input("dout", dout)
    B, T = tokens.shape
    if dout.dim() != 3 or dout.shape[:2] != (B, T):
        raise ValueError(f"dout must be (B, T, C) = ({B}, {T}, C); got {tuple(dout.shape)}")
    C = dout.shape[2]
    for name, g in (("dwte", dwte), ("dwpe", dwpe)):
        if g is None:
            continue
        check_input(name, g)
        if g.dim() != 2 or g.shape[1] != C or g.dtype != dout.dtype or g.device != dout.device:
            raise ValueError(
                f"{name} must be a contiguous (rows, {C}) tensor of dout's dtype and device; "
                f"got {tuple(g.shape)} {g.dtype} on {g.device}"
            )
        if not g.is_contiguous():
            raise ValueError(f"{name} must be contiguous (it is written in place)")
    if dwpe is not None and dwpe.shape[0] < T:
        raise ValueError(f"dwpe has {dwpe.shape[0]} rows, fewer than T = {T}")
    if not on_gpu(dout):
        V = dwte.shape[0] if dwte is not None else int(tokens.max()) + 1
        gte, gpe = encoder_bwd_reference(dout, tokens, V, T)
        if dwte is not None:
            dwte.add_(gte.to(dwte.dtype))
        if dwpe is not None:
            dwpe[:T].add_(gpe.to(dwpe.dtype))
        return
    with device_guard(dout):
        encoder_bwd(contiguous(dout), contiguous(tokens), dwte, dwpe, add_to_dwpe=True)


def bias_grad(dout: torch.Tensor) -> torch.Tensor:
    """dbias = dout summed over every dimension but the last, in dout's dtype, from fp32 sums
    in a fixed order (bitwise the same on every run)."""
    check_input("dout", dout)
    return bias_grad_op(dout)


class LinearFunction(torch.autograd.Function):
    """y = x @ weight.T + bias (torch's matmul); the backward's dbias is kbuild's bias_grad,
    dx and dweight are torch's matmuls (cuBLAS). Under torch.autocast the backward runs
    with the forward's autocast state, as torch's own linear does."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        device = x.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        device, dtype, enabled = ctx.autocast
        with torch.autocast(device, dtype, enabled=enabled):
            dy2 = dy.reshape(-1, dy.shape[-1])
            dx = dy @ weight if need_x else None
            dw = dy2.t() @ x.reshape(-1, x.shape[-1]) if need_w else None
        # The engine casts each gradient to its input's dtype (an fp32 master weight's too).
        db = bias_grad_op(dy2) if need_b and ctx.has_bias else None
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch.nn.functional.linear whose bias gradient is kbuild's deterministic column sum.

    x: (..., IN); weight: (OUT, IN); bias: (OUT,) or None; one float dtype and device (under
    torch.autocast, any: autocast casts them, fp32 master weights included). Eager CUDA
    calls run forward and backward in C++ (kbuild/native) where the extension loads."""
    if api._native is not None and not torch.compiler.is_compiling():
        y = api._native.linear(x, weight, bias)  # the common CUDA case, whole, in C++
        if y is not None:
            return y
    check_input("x", x)
    check_input("weight", weight)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight must be (out_features, {x.shape[-1]}) to match x's last dimension; "
            f"got {tuple(weight.shape)}"
        )
    tensors = [("weight", weight)]
    if bias is not None:
        check_input("bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be ({weight.shape[0]},); got {tuple(bias.shape)}")
        tensors.append(("bias", bias))
    autocast = torch.is_autocast_enabled(x.device.type)  # it casts them to one dtype
    for name, t in tensors:
        if t.dtype != x.dtype and not autocast:
            raise TypeError(f"{name} must have x's dtype ({x.dtype}); got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}; got {t.device}")
    if bias is None or not torch.is_grad_enabled() or not bias.requires_grad:
        return torch.nn.functional.linear(x, weight, bias)  # nothing for kbuild to do
    return LinearFunction.apply(x, weight, bias)
