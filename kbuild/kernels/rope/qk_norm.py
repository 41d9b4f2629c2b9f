"""QK-norm then rotary embedding in one kernel: `qk_norm_rope(q, k, q_weight, k_weight, cos,
sin, eps=1e-6, offset=0.0, interleaved=False, unsqueeze_dim=1)`, what Qwen3, Gemma 3 and
OLMo-2-style attention runs as q_norm / k_norm (an RMSNorm over each head's D features) and
then Hugging Face's apply_rotary_pos_emb.

    q = q_proj(x).view(B, T, Hq, D).transpose(1, 2)  # (B, Hq, T, D): a view, not a copy
    k = k_proj(x).view(B, T, Hk, D).transpose(1, 2)
    q, k = qk_norm_rope(q, k, q_norm.weight, k_norm.weight, cos, sin, eps)

HF's Qwen3 normalises the (B, T, H, D) view before its transpose and rotates after it; per
(b, t, head) the math is the same: out = rope(rmsnorm(x) * (offset + w)) over D.

Layouts (kbuild/kernels/rope/op.py's): unsqueeze_dim=1: q (B, Hq, T, D), k (B, Hk, T, D);
unsqueeze_dim=2: (B, T, H, D). Hq and Hk may differ (GQA). q and k are read once, at their
strides, in place (the transposed views attention code makes of a projection, or of a fused
qkv projection's slices; only a view whose last dimension is not dense is copied first); the
outputs are new dense tensors of q's and k's shapes, written once.

cos / sin: (B, T, D), (1, T, D) or (T, D), of one float dtype (not necessarily q's), read at
their strides. Full rotary only: cos.shape[-1] must be D (Qwen3, Gemma 3 and OLMo 2 rotate
every feature); a partial rotary (rd < D) is refused, naming rd and D: run kbuild.rmsnorm and
kbuild.kernels.rope.op.rope for it. Rotate-half (HF's) or interleaved pairs (rope.py's docstring).

Weights: q_weight and k_weight (D,) of q's dtype or float32, both of one dtype; the norm is
x_hat * (offset + w), the offset added in fp32 (Gemma 3's 1 + w: offset=1.0).

Rounding: fp32 math, one rounding to q's dtype at the output, kbuild.rmsnorm's contract. HF's
Qwen3RMSNorm rounds x_hat to the input dtype before the weight multiply, and
apply_rotary_pos_emb rounds the normalised q once more before rotating: for 16-bit q those
two roundings (about 2^-8 each in bf16) are HF's and not kbuild's, so the two agree to the
dtype's tolerance, not bit for bit.

Backward: dq, dk, dq_weight and dk_weight. Saved for backward: q and k (the inputs, as
given: views stay views) and one fp32 rstd per head and position of each (B * H * T floats);
not the outputs. The weight gradients are deterministic: each block of the backward leaves an
fp32 partial row, summed in a fixed order (kernels/reduce.py's column sum), so they are
bitwise repeatable from run to run on one device. cos and sin get no gradient.

CUDA tensors run kernels/rope/qk_norm_kernels.py; CPU tensors the reference here, the composition of
kbuild's RMSNorm reference (kernels/norms/rmsnorm.py) and RoPE reference (kernels/rope/op.py) in
fp32.
"""

from __future__ import annotations

import torch

from ... import cases
from ...op.launch import column_sum, launcher_for
from ...op.opdef import Op, Out, Scalar, Tensors, eps
from ...op.tensors import DTYPE_NAMES, aligned, device_guard, stream_of
from ..norms.rmsnorm import rmsnorm_bwd_reference, rmsnorm_reference
from ..reduce import COLUMN_SUM
from .op import _heads_axis, _rotate, _strides, _trig_strides, check_rope, readable, vector_width
from .qk_norm_kernels import (
    BLOCKS,
    BWD_ELEMENTS,
    MAX_ELEMENTS,
    build_qk_norm_rope,
    build_qk_norm_rope_bwd,
    head_cover,
)

# ----------------------------------------------------------------------------- references


def qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps=1e-6, offset=0.0,
                           interleaved=False, unsqueeze_dim=1, store_rstd=True):  # fmt: skip
    """(q_out, k_out, q_rstd, k_rstd): rmsnorm then rope in fp32, one rounding to q's dtype;
    the rstds fp32 of q's and k's shapes without D. What CPU tensors run, and the kernels'
    contract."""
    out = []
    for x, w in ((q, q_weight), (k, k_weight)):
        n, rstd = rmsnorm_reference(x.float(), w, eps, offset)  # fp32 in, fp32 out
        out.append((_rotate(n, cos, sin, interleaved, unsqueeze_dim, False).to(x.dtype), rstd))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def qk_norm_rope_backward_reference(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, q_rstd,
                                    k_rstd, need_dq, need_dk, need_dq_weight, need_dk_weight,
                                    offset=0.0, interleaved=False, unsqueeze_dim=1):  # fmt: skip
    """(dq, dk, dq_weight, dk_weight): the gradients rotated back (rope's transpose), then
    RMSNorm's backward, fp32 math; what is not needed the op returns empty."""
    grads = []
    for dy, x, w, rstd in ((dq_out, q, q_weight, q_rstd), (dk_out, k, k_weight, k_rstd)):
        dn = _rotate(dy.float(), cos, sin, interleaved, unsqueeze_dim, True)
        grads.append(rmsnorm_bwd_reference(dn, x, w, rstd.reshape(x.shape[:-1]), offset))
    (dq, dqw), (dk, dkw) = grads
    return dq.to(q.dtype), dk.to(k.dtype), dqw, dkw


# ----------------------------------------------------------------------------- checks


def check_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, interleaved, unsqueeze_dim,
                       names=("q", "k")) -> None:  # fmt: skip
    """rope's checks (kbuild/kernels/rope/op.py), then full rotary, the weights and the head dim;
    each error names its argument."""
    check_rope(q, k, cos, sin, interleaved, unsqueeze_dim, names)
    D, rd = q.shape[-1], cos.shape[-1]
    if rd != D:
        raise ValueError(
            f"cos's last dimension (the rotary dim rd = {rd}) must be {names[0]}'s head dim D "
            f"= {D}: qk_norm_rope rotates every feature (full rotary); for a partial rotary, "
            "run kbuild.rmsnorm and kbuild.kernels.rope.op.rope"
        )
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
        if w.dtype not in (q.dtype, torch.float32):
            raise TypeError(f"{name} must be of {names[0]}'s dtype ({q.dtype}) or torch.float32; "
                            f"got {w.dtype}")  # fmt: skip
        if tuple(w.shape) != (D,):
            raise ValueError(f"{name} must be (D,) = ({D},); got shape {tuple(w.shape)}")
        if w.device != q.device:
            raise ValueError(f"{name} must be on {names[0]}'s device {q.device}; got {w.device}")
    if k_weight.dtype != q_weight.dtype:
        raise TypeError(f"k_weight must have q_weight's dtype ({q_weight.dtype}); got "
                        f"{k_weight.dtype}")  # fmt: skip
    try:
        head_cover(D, DTYPE_NAMES[q.dtype], interleaved, 1)
    except ValueError as e:
        raise ValueError(f"{names[0]}'s head dim D = {D} is not supported: {e}") from None


def _check(bound) -> None:
    check_qk_norm_rope(*(bound[n] for n in ("q", "k", "q_weight", "k_weight", "cos", "sin",
                                             "interleaved", "unsqueeze_dim")))  # fmt: skip


def _check_backward(bound) -> None:
    check_qk_norm_rope(*(bound[n] for n in ("dq_out", "dk_out", "q_weight", "k_weight", "cos",
                                             "sin", "interleaved", "unsqueeze_dim")),
                       names=("dq_out", "dk_out"))  # fmt: skip
    for name in ("q", "k"):
        if bound[name].shape != bound[f"d{name}_out"].shape:
            raise ValueError(f"{name} must have d{name}_out's shape; got "
                             f"{tuple(bound[name].shape)}")  # fmt: skip


# ----------------------------------------------------------------------------- CUDA


def _rstd_strides(rstd: torch.Tensor, x: torch.Tensor, unsqueeze_dim: int):
    """The (batch, head, position) strides of a dense (M,) rstd in x's order without D."""
    return _strides(rstd.view(*x.shape[:-1], 1), unsqueeze_dim)


def launch_vec(dtype, D, interleaved, strides, tensors, elements=MAX_ELEMENTS) -> int:
    """rope's vector width for these strides and addresses, narrowed until a head's cover fits
    (kernels/rope/qk_norm_kernels.py head_cover) with at most `elements` a thread (or vec 1)."""
    vec = vector_width(dtype, D, D, interleaved, strides, tensors)
    while vec > 1:
        try:
            if head_cover(D, DTYPE_NAMES[dtype], interleaved, vec).elements <= elements:
                break
        except ValueError:
            pass
        vec //= 2
    return vec


def aligned_weight(w: torch.Tensor) -> torch.Tensor:
    """A weight (D,) as the kernels read it, in vectors as wide as q's: contiguous and
    16-byte aligned (a copy of D elements where a view is not; the vector width is chosen
    from q, k, cos, sin and the outputs, not from the weights)."""
    w = w.contiguous()
    return w if aligned(w.data_ptr()) else w.clone()


def _geometry(x, unsqueeze_dim):
    heads = _heads_axis(unsqueeze_dim)
    return x.shape[0], x.shape[3 - heads], x.shape[heads]  # B, T, H


def forward_values(q, k, q_weight, cos, sin, eps, offset, interleaved, unsqueeze_dim,
                   store_rstd, outs) -> tuple:  # fmt: skip
    """The forward kernel's parameter values (the launch's and warmup_specs')."""
    strides = [s for t in (q, k, *outs) for s in _strides(t, unsqueeze_dim)]
    strides += [*_trig_strides(cos), *_trig_strides(sin)]
    tensors = (q, k, q_weight, cos, sin, *outs)
    vec = launch_vec(q.dtype, q.shape[-1], interleaved, strides, tensors)
    names = DTYPE_NAMES
    return (q.shape[-1], names[q.dtype], names[q_weight.dtype], names[cos.dtype], float(eps),
            float(offset), bool(interleaved), bool(store_rstd), vec), strides  # fmt: skip


def _forward_cuda(q, k, q_weight, k_weight, cos, sin, eps=1e-6, offset=0.0, interleaved=False,
                  unsqueeze_dim=1, store_rstd=True):  # fmt: skip
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    rstds = [torch.empty(x.numel() // x.shape[-1] if x.shape[-1] else 0, dtype=torch.float32,
                         device=x.device) if store_rstd else x.new_empty(0, dtype=torch.float32)
             for x in (q, k)]  # fmt: skip
    (B, T, Hq), Hk = _geometry(q, unsqueeze_dim), _geometry(k, unsqueeze_dim)[2]
    if B * T == 0 or Hq + Hk == 0:
        return q_out, k_out, *rstds
    q, k, cos, sin = readable(q), readable(k), readable(cos), readable(sin)
    q_weight, k_weight = aligned_weight(q_weight), aligned_weight(k_weight)
    values, strides = forward_values(q, k, q_weight, cos, sin, eps, offset, interleaved,
                                     unsqueeze_dim, store_rstd, (q_out, k_out))  # fmt: skip
    ptrs = [t.data_ptr() for t in (q, k, q_weight, k_weight, cos, sin, q_out, k_out)]
    rstd_strides = []
    if store_rstd:
        ptrs += [r.data_ptr() for r in rstds]
        rstd_strides = [
            s
            for r, x in zip(rstds, (q, k), strict=True)
            for s in _rstd_strides(r, x, unsqueeze_dim)
        ]
    trig = strides[12:]  # cos / sin strides last, as the kernel takes them
    device = q.get_device()
    with device_guard(q):
        launcher = launcher_for(build_qk_norm_rope, device, values)
        launcher(B * T, stream_of(device), *ptrs, T, Hq, Hk, *strides[:12], *rstd_strides, *trig)
    return q_out, k_out, *rstds


def backward_values(q, k, dq_out, dk_out, q_weight, cos, sin, offset, interleaved,
                    unsqueeze_dim, weight_grad, outs) -> tuple:  # fmt: skip
    """The backward kernel's parameter values and the strides of q, k, dq_out, dk_out and
    `outs` (dq, dk), cos, sin."""
    xs = (q, k, dq_out, dk_out, *outs)
    strides = [s for t in xs for s in _strides(t, unsqueeze_dim)]
    trig = [*_trig_strides(cos), *_trig_strides(sin)]
    tensors = (*xs, q_weight, cos, sin)
    vec = launch_vec(q.dtype, q.shape[-1], interleaved, strides + trig, tensors, BWD_ELEMENTS)
    names = DTYPE_NAMES
    return (q.shape[-1], names[q.dtype], names[q_weight.dtype], names[cos.dtype], float(offset),
            bool(interleaved), bool(weight_grad), vec), strides, trig  # fmt: skip


def _backward_cuda(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, q_rstd, k_rstd, need_dq,
                   need_dk, need_dq_weight, need_dk_weight, offset=0.0, interleaved=False,
                   unsqueeze_dim=1):  # fmt: skip
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    weight_grad = need_dq_weight or need_dk_weight
    (B, T, Hq), Hk, D = _geometry(q, unsqueeze_dim), _geometry(k, unsqueeze_dim)[2], q.shape[-1]
    dqw, dkw = torch.zeros_like(q_weight), torch.zeros_like(k_weight)
    needs = (need_dq, need_dk, need_dq_weight, need_dk_weight)
    if B * T == 0 or Hq + Hk == 0:
        return _wanted((dq, dk, dqw, dkw), needs)
    q, k, dq_out, dk_out, cos, sin = (readable(t) for t in (q, k, dq_out, dk_out, cos, sin))
    q_weight, k_weight = aligned_weight(q_weight), aligned_weight(k_weight)
    values, strides, trig = backward_values(q, k, dq_out, dk_out, q_weight, cos, sin, offset,
                                            interleaved, unsqueeze_dim, weight_grad,
                                            (dq, dk))  # fmt: skip
    rstd_strides = [s for r, x in ((q_rstd, q), (k_rstd, k))
                    for s in _rstd_strides(r, x, unsqueeze_dim)]  # fmt: skip
    grid = min(B * T, BLOCKS)
    device = q.get_device()
    tensors = [q, k, q_weight, k_weight, cos, sin, q_rstd, k_rstd, dq_out, dk_out, dq, dk]
    with device_guard(q):
        stream = stream_of(device)
        workspace = None
        if weight_grad:
            workspace = torch.empty((2, grid, D), dtype=torch.float32, device=q.device)
            tensors.append(workspace)
        launcher = launcher_for(build_qk_norm_rope_bwd, device, values)
        launcher(grid, stream, *(t.data_ptr() for t in tensors), B * T, T, Hq, Hk, *strides,
                 *rstd_strides, *trig)  # fmt: skip
        if weight_grad:
            dqw, dkw = column_sum(workspace, q_weight.dtype, device, stream)
    return _wanted((dq, dk, dqw, dkw), needs)


def _wanted(grads, needs):
    """The gradients asked for; an empty tensor for the others (what autograd reads as none)."""
    return tuple(g if need else g.new_empty(0) for g, need in zip(grads, needs, strict=True))


# ----------------------------------------------------------------------------- the op

_LAYOUT = (
    Scalar("offset", "float", 0.0),
    Scalar("interleaved", "bool", False),
    Scalar("unsqueeze_dim", "int", 1),
)
_INPUTS = tuple(Tensors(n) for n in ("q", "k", "q_weight", "k_weight", "cos", "sin"))

QK_NORM_ROPE = Op(
    "kbuild::qk_norm_rope",
    args=(*_INPUTS, eps(1e-6), *_LAYOUT, Scalar("store_rstd", "bool", True)),
    outputs=(
        Out("q_out", like="q"),
        Out("k_out", like="k"),
        Out("q_rstd", rows="q", when="store_rstd"),
        Out("k_rstd", rows="k", when="store_rstd"),
    ),
    reference=qk_norm_rope_reference,
    cuda=_forward_cuda,
    check=_check,
    # by names: the outputs' gradients, q, k, the weights, cos, sin and the rstds saved
    backward=Op(
        "kbuild::qk_norm_rope_backward",
        args=(
            Tensors("dq_out"),
            Tensors("dk_out"),
            *_INPUTS,
            Tensors("q_rstd"),
            Tensors("k_rstd"),
            *(Scalar(f"need_d{n}", "bool") for n in ("q", "k", "q_weight", "k_weight")),
            *_LAYOUT,
        ),
        outputs=(
            Out("dq", like="q", when="need_dq"),
            Out("dk", like="k", when="need_dk"),
            Out("dq_weight", like="q_weight", when="need_dq_weight"),
            Out("dk_weight", like="k_weight", when="need_dk_weight"),
        ),
        reference=qk_norm_rope_backward_reference,
        cuda=_backward_cuda,
        check=_check_backward,
    ),
)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    interleaved: bool = False,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out) = rope(rmsnorm(q) * (offset + q_weight)), the same for k with k_weight,
    per head over its D features (module docstring: layouts, rounding, what is saved).

    q (B, Hq, T, D) and k (B, Hk, T, D) (unsqueeze_dim=2: (B, T, H, D)), fp32 / fp16 / bf16,
    read at their strides; q_weight, k_weight (D,) of q's dtype or fp32; cos, sin (B, T, D),
    (1, T, D) or (T, D) (full rotary). Returns dense tensors of q's and k's shapes and dtype.
    Gradients for q, k, q_weight and k_weight; none for cos, sin. Saved for backward: q, k and
    an fp32 rstd per head and position, only when a gradient is needed."""
    tensors = (q, k, q_weight, k_weight)
    store = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )
    out = QK_NORM_ROPE(q, k, q_weight, k_weight, cos, sin, eps, offset, interleaved,
                       unsqueeze_dim, store)  # fmt: skip
    return out[0], out[1]


# ----------------------------------------------------------------------------- warming


def misaligned_tensors(device="cuda", seed: int = 0):
    """The GPU test's misaligned q (one element into its storage, bf16, D = 64): both kernels
    at vec 1, still read in place."""
    case = (2, 5, 4, 2, 64, torch.bfloat16, torch.bfloat16, torch.bfloat16, 0.0, False, 1, False)
    _, k, qw, kw, cos, sin = case_tensors(case, device, seed)
    base = torch.empty(2 * 4 * 5 * 64 + 1, dtype=torch.bfloat16, device=device)
    if device != "meta":
        base.copy_(torch.randn(base.shape, device=device))
    return base[1:].view(2, 4, 5, 64), k, qw, kw, cos, sin


def case_tensors(case, device="cuda", seed: int = 0):
    """(q, k, q_weight, k_weight, cos, sin) of a GPU case: rope's q, k and cos / sin
    (kernels/rope/op.py case_tensors), weights around 1 (around 0 where offset is 1)."""
    from .op import case_tensors as rope_case

    B, T, Hq, Hk, D, dtype, w_dtype, cs, offset, interleaved, dim, fused = case
    q, k, cos, sin = rope_case((B, T, Hq, Hk, D, D, dtype, cs, interleaved, dim, fused), device,
                               seed)  # fmt: skip
    if device == "meta":
        qw, kw = (torch.empty(D, dtype=w_dtype, device=device) for _ in range(2))
    else:
        g = torch.Generator(device=device).manual_seed(seed + 1)
        qw, kw = ((1.0 - offset + 0.1 * torch.randn(D, generator=g, device=device)).to(w_dtype)
                  for _ in range(2))  # fmt: skip
    return q, k, qw, kw, cos, sin


def specs_for(q, k, q_weight, k_weight, cos, sin, eps=1e-6, offset=0.0, interleaved=False,
              unsqueeze_dim=1, inference: bool = False) -> list:  # fmt: skip
    """The kernels a call with these tensors launches, forward (storing rstd) and backward
    (its gradients dense, as autograd's usually are; weight gradients wanted), by the
    launches' own choice of vector width; and the weight gradients' column sum. With
    `inference`, also the forward of a call whose inputs want no gradient (no rstd stored:
    under no_grad, or inputs without requires_grad), last."""
    q_, k_, cos_, sin_ = readable(q), readable(k), readable(cos), readable(sin)
    outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k)]
    forwards = []
    for store_rstd in (True, False) if inference else (True,):
        fwd, _ = forward_values(q_, k_, q_weight, cos_, sin_, eps, offset, interleaved,
                                unsqueeze_dim, store_rstd, outs)  # fmt: skip
        forwards.append(build_qk_norm_rope.spec(*fwd))
    bwd, _, _ = backward_values(q_, k_, *outs, q_weight, cos_, sin_, offset, interleaved,
                                unsqueeze_dim, True, outs)  # fmt: skip
    column_sum = COLUMN_SUM.spec(q.shape[-1], DTYPE_NAMES[q_weight.dtype], 2)
    return [forwards[0], build_qk_norm_rope_bwd.spec(*bwd), column_sum, *forwards[1:]]


def warmup_specs():
    """What `kbuild warmup --module kbuild.kernels.rope.qk_norm` compiles: every kernel the GPU
    tests launch, and the models' (fused qkv views, per-batch cos / sin; Gemma's offset 1),
    forward and backward."""
    specs = []
    for case in cases.QK_ROPE_GPU_CASES:
        specs += specs_for(*case_tensors(case, "meta"), offset=case[8], interleaved=case[9],
                           unsqueeze_dim=case[10], inference=True)  # fmt: skip
    for name, Hq, Hk, D in cases.QK_ROPE_MODELS:
        offset = 1.0 if name.startswith("Gemma") else 0.0
        for dtype in cases.ROPE_DTYPES:
            for w in dict.fromkeys((dtype, torch.float32)):
                for cs in dict.fromkeys((dtype, torch.float32)):
                    case = (1, 8, Hq, Hk, D, dtype, w, cs, offset, False, 1, True)
                    specs += specs_for(*case_tensors(case, "meta"), offset=offset,
                                       inference=True)  # fmt: skip
    specs += specs_for(*misaligned_tensors("meta"), inference=True)
    return list(dict.fromkeys(specs))
