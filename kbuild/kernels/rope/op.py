"""Rotary position embedding: `rope(q, k, cos, sin, interleaved=False, unsqueeze_dim=1)`,
Hugging Face's `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` as one kernel.

    cos, sin = rotary_emb(x, position_ids)          # HF's: (B, T, rd), in x's dtype
    q = q_proj(x).view(B, T, Hq, D).transpose(1, 2)  # (B, Hq, T, D): a view, not a copy
    k = k_proj(x).view(B, T, Hk, D).transpose(1, 2)
    q, k = kbuild.kernels.rope.op.rope(q, k, cos, sin)

Layouts. unsqueeze_dim=1: q (B, Hq, T, D) and k (B, Hk, T, D); unsqueeze_dim=2: (B, T, H, D)
(HF unsqueezes cos / sin at that dimension to broadcast them over the heads). Hq and Hk may
differ (GQA). q and k are read at their strides, in place: the transposed views attention code
makes of a projection, or of a fused qkv projection's slices, cost no copy (only a view whose
last dimension is not dense is copied first). The outputs are new dense tensors of q's and
k's shapes (contiguous in that shape).

cos / sin: (B, T, rd), or (T, rd) / (1, T, rd) shared by the batch (read at stride 0), fp32,
fp16 or bf16 (both of one dtype; not necessarily q's). rd = cos.shape[-1], even, <= D: the
first rd features of each head rotate, the rest pass through unchanged (partial rotary,
GPT-NeoX / Phi's `partial_rotary_factor`).

    rotate-half (HF's):     out = x * cos + rotate_half(x) * sin,
                            rotate_half(x) = cat(-x2, x1), x1, x2 the halves of x[..., :rd]
    interleaved=True (GPT-J, original Llama, Cohere): pairs (x[2i], x[2i+1]) rotate,
                            out[2i]     = x[2i] cos[2i]       - x[2i+1] sin[2i]
                            out[2i + 1] = x[2i + 1] cos[2i+1] + x[2i] sin[2i + 1]

Every entry of cos and sin is read in both layouts: rotate-half expects HF's cat(freqs, freqs)
(entries i and i + rd/2 one angle), interleaved HF's GPT-J-style repeat_interleave(freqs, 2)
(entries 2i and 2i + 1 one angle); other cos / sin give exactly the formulas above.

fp32 math, one rounding to q's dtype (fp32, fp16, bf16; k of the same dtype).

Backward: dq, dk by the transpose of the rotation, the same kernel (`inverse`): dx = dy * cos
- R(dy * sin) (the rotation by -theta for HF's cos / sin), written dense. Saved for backward:
cos and sin only (no copy). cos and sin get no gradient (HF's come from a buffer with no
grad): if they require one, autograd gives them None.

One launch handles q and k together (one block per position, over the heads of q and of k):
each of q and k is read once and written once, cos / sin once per position.
"""

from __future__ import annotations

import torch

from ... import cases
from ...op.launch import launcher_for
from ...op.opdef import Op, Out, Scalar, Tensors
from ...op.tensors import DTYPE_NAMES, device_guard, stream_of
from .kernels import build_rope

# ----------------------------------------------------------------------------- references


def _heads_axis(unsqueeze_dim: int) -> int:
    return 1 if unsqueeze_dim == 1 else 2


def _trig(table: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    """cos or sin (T, rd) / (B, T, rd) as fp32 (B or 1, 1, T, rd) or (B or 1, T, 1, rd)."""
    t = table.float()
    if t.dim() == 2:
        t = t.unsqueeze(0)
    return t.unsqueeze(unsqueeze_dim)


def _rotated(v: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """R(v): rotate_half's cat(-v2, v1), or (-v[2i + 1], v[2i]) per pair."""
    if interleaved:
        pairs = v.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
    a, b = v.chunk(2, -1)
    return torch.cat((-b, a), -1)


def _rotate(x, cos, sin, interleaved, unsqueeze_dim, inverse):
    """x rotated (or by the transpose, `inverse`) in fp32, rounded once to x's dtype."""
    rd = cos.shape[-1]
    c, s = _trig(cos, unsqueeze_dim), _trig(sin, unsqueeze_dim)
    x32 = x.float()
    v = x32[..., :rd]
    if inverse:  # the transpose: dy * c - R(dy * s)
        out = v * c - _rotated(v * s, interleaved)
    else:
        out = v * c + _rotated(v, interleaved) * s
    return torch.cat((out, x32[..., rd:]), -1).to(x.dtype)


def rope_reference(q, k, cos, sin, interleaved=False, unsqueeze_dim=1):
    """(q_out, k_out) in fp32 torch math, one rounding to q's dtype: what CPU tensors run,
    and the kernel's contract."""
    return (
        _rotate(q, cos, sin, interleaved, unsqueeze_dim, False),
        _rotate(k, cos, sin, interleaved, unsqueeze_dim, False),
    )


def rope_backward_reference(
    dq_out, dk_out, cos, sin, need_dq, need_dk, interleaved=False, unsqueeze_dim=1
):
    """(dq, dk): the gradients rotated back (the transpose), fp32 math; empty where not
    needed."""
    empty = dq_out.new_empty(0)
    return (
        _rotate(dq_out, cos, sin, interleaved, unsqueeze_dim, True) if need_dq else empty,
        _rotate(dk_out, cos, sin, interleaved, unsqueeze_dim, True) if need_dk else empty,
    )


# ----------------------------------------------------------------------------- checks

_FLOATS = "torch.float32, torch.float16 or torch.bfloat16"


def _float_tensor(name: str, t: torch.Tensor) -> None:
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"{name} must be {_FLOATS}; got {t.dtype}")


def check_rope(q, k, cos, sin, interleaved, unsqueeze_dim, names=("q", "k")) -> None:
    """Every argument's check, its error naming it (`names`: what q and k are called)."""
    qn, kn = names
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int):
        raise TypeError(f"unsqueeze_dim must be an int (1 or 2), got {unsqueeze_dim!r}")
    if unsqueeze_dim not in (1, 2):
        raise ValueError(
            f"unsqueeze_dim must be 1 (q, k of (B, H, T, D)) or 2 ((B, T, H, D)); got "
            f"{unsqueeze_dim}"
        )
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {interleaved!r}")
    shape = "(B, H, T, D)" if unsqueeze_dim == 1 else "(B, T, H, D)"
    for name, x in ((qn, q), (kn, k)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        _float_tensor(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D {shape}; got shape {tuple(x.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"{kn} must have {qn}'s dtype ({q.dtype}); got {k.dtype}")
    heads = _heads_axis(unsqueeze_dim)
    B, T, D = q.shape[0], q.shape[3 - heads], q.shape[3]
    expected = [B, k.shape[heads], T, D] if heads == 1 else [B, T, k.shape[heads], D]
    if list(k.shape) != expected:
        raise ValueError(
            f"{kn} must be {shape} with {qn}'s B = {B}, T = {T} and D = {D} (its own H); got "
            f"shape {tuple(k.shape)}"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        _float_tensor(name, t)
    if (
        cos.dim() not in (2, 3)
        or cos.shape[-2] != T
        or (cos.dim() == 3 and cos.shape[0] not in (1, B))
    ):
        raise ValueError(
            f"cos must be (B, T, rd), (1, T, rd) or (T, rd) with B = {B} and T = {T} from "
            f"{qn}; got shape {tuple(cos.shape)}"
        )
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}; got {tuple(sin.shape)}")
    if sin.dtype != cos.dtype:
        raise TypeError(f"sin must have cos's dtype ({cos.dtype}); got {sin.dtype}")
    rd = cos.shape[-1]
    if rd % 2 or rd < 2:
        raise ValueError(
            f"cos's last dimension (the rotary dim rd) must be even and >= 2; got {rd}"
        )
    if rd > D:
        raise ValueError(
            f"cos's last dimension (the rotary dim rd = {rd}) must be at most {qn}'s head dim "
            f"D = {D}"
        )
    for name, t in ((kn, k), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on {qn}'s device {q.device}; got {t.device}")


def _check(bound) -> None:
    check_rope(bound["q"], bound["k"], bound["cos"], bound["sin"], bound["interleaved"],
               bound["unsqueeze_dim"])  # fmt: skip


def _check_backward(bound) -> None:
    check_rope(bound["dq_out"], bound["dk_out"], bound["cos"], bound["sin"],
               bound["interleaved"], bound["unsqueeze_dim"], ("dq_out", "dk_out"))  # fmt: skip


# ----------------------------------------------------------------------------- CUDA


def _strides(x: torch.Tensor, unsqueeze_dim: int) -> tuple[int, int, int]:
    """x's (batch, head, position) strides in elements; 0 for a dimension of one (its
    stride means nothing and may be anything)."""
    order = (0, 1, 2) if unsqueeze_dim == 1 else (0, 2, 1)
    return tuple(x.stride(d) if x.shape[d] > 1 else 0 for d in order)


def _trig_strides(t: torch.Tensor) -> tuple[int, int]:
    """cos / sin's (batch, position) strides; 0 for a table shared by the batch."""
    if t.dim() == 2:
        return 0, (t.stride(0) if t.shape[0] > 1 else 0)
    return tuple(t.stride(d) if t.shape[d] > 1 else 0 for d in (0, 1))


def readable(t: torch.Tensor) -> torch.Tensor:
    """t itself when the kernel reads it in place (its last dimension dense), else a dense
    copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def vector_width(dtype, D, rd, interleaved, strides, tensors) -> int:
    """The widest access (elements, 16 bytes at most) that every stride, the rotating and
    passing spans and every tensor's address are multiples of."""
    unit = rd if interleaved else rd // 2
    vec = 16 // dtype.itemsize
    while vec > 1:
        spans = unit % vec == 0 and (D - rd) % vec == 0 and all(s % vec == 0 for s in strides)
        fits = all(t.data_ptr() % min(16, vec * t.element_size()) == 0 for t in tensors)
        if spans and fits:
            break
        vec //= 2
    return vec


def _launch(x_q, x_k, cos, sin, out_q, out_k, interleaved, unsqueeze_dim, inverse) -> None:
    """One launch over both (q, k) -> (out_q, out_k); x_q or x_k None: its heads skipped."""
    ref = x_q if x_q is not None else x_k
    heads = _heads_axis(unsqueeze_dim)
    B, T, D = ref.shape[0], ref.shape[3 - heads], ref.shape[3]
    Hq = x_q.shape[heads] if x_q is not None else 0
    Hk = x_k.shape[heads] if x_k is not None else 0
    if B * T == 0 or Hq + Hk == 0 or D == 0:
        return
    # a missing side: the other's tensors (never read: its head count is 0)
    x_q, out_q = (x_q, out_q) if x_q is not None else (x_k, out_k)
    x_k, out_k = (x_k, out_k) if x_k is not None else (x_q, out_q)
    x_q, x_k, cos, sin = readable(x_q), readable(x_k), readable(cos), readable(sin)
    strides = [s for t in (x_q, x_k, out_q, out_k) for s in _strides(t, unsqueeze_dim)]
    strides += [*_trig_strides(cos), *_trig_strides(sin)]
    tensors = (x_q, x_k, cos, sin, out_q, out_k)
    values = rope_values(x_q.dtype, cos.dtype, D, cos.shape[-1], interleaved, inverse,
                         vector_width(x_q.dtype, D, cos.shape[-1], interleaved,
                                      strides, tensors))  # fmt: skip
    device = ref.get_device()
    launcher = launcher_for(build_rope, device, values)
    launcher(B * T, stream_of(device), *(t.data_ptr() for t in tensors), T, Hq, Hk, *strides)


def rope_values(dtype, cs_dtype, D, rd, interleaved, inverse, vec) -> tuple:
    """The kernel's parameter values in the table's order (the launch's and warmup_specs')."""
    names = DTYPE_NAMES
    return (D, rd, names[dtype], names[cs_dtype], bool(interleaved), bool(inverse), vec)


def _rope_cuda(q, k, cos, sin, interleaved=False, unsqueeze_dim=1):
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    with device_guard(q):
        _launch(q, k, cos, sin, q_out, k_out, interleaved, unsqueeze_dim, False)
    return q_out, k_out


def _rope_backward_cuda(dq_out, dk_out, cos, sin, need_dq, need_dk, interleaved=False,
                        unsqueeze_dim=1):  # fmt: skip
    def out(dy, need):
        return torch.empty_like(dy, memory_format=torch.contiguous_format) if need else None

    dq, dk = out(dq_out, need_dq), out(dk_out, need_dk)
    with device_guard(dq_out):
        _launch(dq_out if need_dq else None, dk_out if need_dk else None, cos, sin, dq, dk,
                interleaved, unsqueeze_dim, True)  # fmt: skip
    empty = dq_out.new_empty(0)
    return (dq if need_dq else empty), (dk if need_dk else empty)


# ----------------------------------------------------------------------------- the op

_LAYOUT = (Scalar("interleaved", "bool", False), Scalar("unsqueeze_dim", "int", 1))

ROPE = Op(
    "kbuild::rope",
    args=(Tensors("q"), Tensors("k"), Tensors("cos"), Tensors("sin"), *_LAYOUT),
    outputs=(Out("q_out", like="q"), Out("k_out", like="k")),
    reference=rope_reference,
    cuda=_rope_cuda,
    check=_check,
    # by names: the gradients of q_out and k_out, cos and sin saved, whether q and k want one
    backward=Op(
        "kbuild::rope_backward",
        args=(
            Tensors("dq_out"),
            Tensors("dk_out"),
            Tensors("cos"),
            Tensors("sin"),
            Scalar("need_dq", "bool"),
            Scalar("need_dk", "bool"),
            *_LAYOUT,
        ),
        outputs=(
            Out("dq", like="dq_out", when="need_dq"),
            Out("dk", like="dk_out", when="need_dk"),
        ),
        reference=rope_backward_reference,
        cuda=_rope_backward_cuda,
        check=_check_backward,
    ),
)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out): q and k rotated by cos / sin, as HF's apply_rotary_pos_emb (module
    docstring: layouts, partial rotary, the interleaved pairs, what is saved).

    q (B, Hq, T, D) and k (B, Hk, T, D) (unsqueeze_dim=2: (B, T, H, D)), fp32 / fp16 / bf16,
    read at their strides; cos, sin (B, T, rd), (1, T, rd) or (T, rd), rd even <= D. Returns
    dense tensors of q's and k's shapes and dtype. Gradients for q and k; none for cos, sin."""
    return ROPE(q, k, cos, sin, interleaved, unsqueeze_dim)


# ----------------------------------------------------------------------------- warming


def case_tensors(case, device="cuda", seed: int = 0):
    """(q, k, cos, sin) of a GPU case: HF-style cos / sin of angles up to a few radians, per
    batch (B, T, rd); q and k dense, or views of one fused qkv projection."""
    B, T, Hq, Hk, D, rd, dtype, cs, interleaved, dim, fused = case
    meta = device == "meta"
    g = None if meta else torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, dtype=dtype):
        if meta:
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.randn(shape, generator=g, device=device).to(dtype)

    if fused:
        qkv = randn(B, T, (Hq + 2 * Hk) * D)
        q, k, _ = qkv.split([Hq * D, Hk * D, Hk * D], -1)
        q, k = q.view(B, T, Hq, D), k.view(B, T, Hk, D)
    else:
        q, k = randn(B, T, Hq, D), randn(B, T, Hk, D)
    if dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if not fused:
            q, k = q.contiguous(), k.contiguous()
    if meta:
        return q, k, randn(B, T, rd, dtype=cs), randn(B, T, rd, dtype=cs)
    freqs = 1.0 / (10000.0 ** (torch.arange(0, rd, 2, device=device).float() / rd))
    positions = torch.arange(T, device=device).float() + torch.arange(B, device=device)[:, None]
    angles = positions[..., None] * freqs  # (B, T, rd / 2): each batch its own offsets
    emb = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
    return q, k, emb.cos().to(cs), emb.sin().to(cs)


def specs_for(q, k, cos, sin, interleaved=False, unsqueeze_dim=1) -> list:
    """The kernels a call with these tensors launches, forward and backward (its gradients
    dense, as autograd's usually are), by the launch's own choice of vector width."""
    D, rd = q.shape[-1], cos.shape[-1]
    q_, k_, cos_, sin_ = readable(q), readable(k), readable(cos), readable(sin)
    outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k)]
    specs = []
    for inverse, (a, b) in ((False, (q_, k_)), (True, outs)):
        strides = [s for t in (a, b, *outs) for s in _strides(t, unsqueeze_dim)]
        strides += [*_trig_strides(cos_), *_trig_strides(sin_)]
        vec = vector_width(q.dtype, D, rd, interleaved, strides,
                           (a, b, cos_, sin_, *outs))  # fmt: skip
        values = rope_values(q.dtype, cos.dtype, D, rd, interleaved, inverse, vec)
        specs.append(build_rope.spec(*values))
    return specs


def warmup_specs():
    """What `kbuild warmup --module kbuild.kernels.rope.op` compiles: every kernel the GPU tests
    launch, and the models' (fused qkv views, per-batch cos / sin), forward and backward."""
    specs = []
    for case in cases.ROPE_GPU_CASES:
        specs += specs_for(*case_tensors(case, "meta"), case[8], case[9])
    for _, Hq, Hk, D, rd in cases.ROPE_MODELS:
        for dtype in cases.ROPE_DTYPES:
            for cs in dict.fromkeys((dtype, torch.float32)):
                case = (1, 8, Hq, Hk, D, rd, dtype, cs, False, 1, True)
                specs += specs_for(*case_tensors(case, "meta"), False, 1)
    D, rd, dtype, cs, interleaved = cases.ROPE_MISALIGNED
    specs.append(build_rope.spec(*rope_values(dtype, cs, D, rd, interleaved, False, 1)))
    return list(dict.fromkeys(specs))
