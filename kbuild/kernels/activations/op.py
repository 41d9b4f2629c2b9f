"""GELU and the gated MLP activations: `kbuild.kernels.activations.op.swiglu(gate, up=None)`,
`geglu(gate, up=None, approximate="tanh")` and `gelu(x, approximate="none")`.

    h = swiglu(gate_proj(x), up_proj(x))          # Llama, Mistral, Qwen: silu(gate) * up
    h = swiglu(gate_up_proj(x))                   # Phi-3: one (..., 2I) projection
    h = geglu(gate, up)                           # Gemma: gelu_pytorch_tanh(gate) * up
    h = gelu(fc(x))                               # GPT-2: the tanh approximation

Each is a `kbuild.Op` declared as a user declares one (examples/custom_softmax.py), over the
kernels of kernels/activations/kernels.py: fp32 math whatever the storage dtype (bf16, fp16, fp32),
one rounding of each output. Saved for backward: the inputs only (gate and up, or x), never
the activation's output; the backward recomputes the activation, so an MLP keeps no
(..., I) tensor of its own for it.

The forms of (gate, up), each its own op:
- two dense tensors: `kbuild::swiglu` / `kbuild::geglu`, all declarations (the C++ generic
  kernel and autograd run it where the extension loads);
- up=None: gate is the fused (..., 2I) output of one gate_up projection, its first half the
  gate (`gate, up = gate_up.chunk(2, -1)`). `kbuild::swiglu_fused` reads both halves in place
  and its backward writes d(gate_up) as one (..., 2I) tensor. Both launch from Python: the
  generic C++ kernel allocates outputs of an input's shape or one value per row, not of half
  an input's width, and checks no tensor against twice another's width (the backward's
  gate_up against dy: a `check=` function);
- strided views (the two halves of a (..., 2I) tensor passed separately, a slice of a
  wider one): `kbuild::swiglu_strided` reads them in place where both lay their rows out
  alike (`common.grouped_rows`: one stride over the outer dimensions, the same for both);
  otherwise it copies them first. Its gradients are dense (..., I) tensors (autograd adds them
  into the (..., 2I) one the views came from: use the fused form to write it directly).
  Rows of I not a whole number of 16-byte vectors are read element by element in place.
A gate_up that is itself not contiguous is copied first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import cases
from ...op.launch import launcher_for, rows_grid
from ...op.opdef import Launch, Like, Op, Out, Rows, Scalar, Tensors
from ...op.tensors import (
    DTYPE_NAMES,
    aligned,
    check_input,
    check_like,
    device_guard,
    grouped_rows,
    row_count,
    stream_of,
)
from ...registry import group_magic
from . import kernels as kernels

APPROXIMATIONS = ("tanh", "none")  # torch.nn.functional.gelu's

# ----------------------------------------------------------------------------- references


def _act(kind: str, g: torch.Tensor) -> torch.Tensor:
    """act(g) in fp32: torch's functions, but GPT-2's GELU as the kernels take it, g
    sigmoid(2u) (torch's 0.5 g (1 + tanh u) cancels for g << 0: 2% off at g = -5)."""
    if kind == "silu":
        return F.silu(g)
    if kind == "gelu_tanh":
        c, k = kernels.SQRT_2_OVER_PI, kernels.GELU_CUBIC
        return g * torch.sigmoid(2 * c * (g + k * g**3))
    return F.gelu(g)


def _slope(kind: str, g: torch.Tensor) -> torch.Tensor:
    """act'(g) in fp32: the kernels' formulas (kernels/activations/kernels.py)."""
    if kind == "silu":
        return torch.sigmoid(g) * (1 + g * torch.sigmoid(-g))  # 1 - s as sigmoid(-g)
    if kind == "gelu_tanh":
        c, k = kernels.SQRT_2_OVER_PI, kernels.GELU_CUBIC
        z = 2 * c * (g + k * g**3)
        s = torch.sigmoid(z)
        return s + g * s * torch.sigmoid(-z) * 2 * c * (1 + 3 * k * g * g)
    cdf = 0.5 + 0.5 * torch.erf(g * kernels.INV_SQRT_2)
    return cdf + g * torch.exp(-0.5 * g * g) * kernels.INV_SQRT_2PI


def _kind(tanh: bool | None) -> str:
    """The activation of a gated op's scalars: silu without one (swiglu), else GELU's."""
    return "silu" if tanh is None else kernels.gelu_kind(tanh)


def gated_reference(gate, up, tanh=None):
    """y = act(gate) up in fp32, rounded once to gate's dtype: what CPU tensors run."""
    return (_act(_kind(tanh), gate.float()) * up.float()).to(gate.dtype)


def gated_backward_reference(gate, up, dy, tanh=None):
    """(dgate, dup) = (dy up act'(gate), dy act(gate)), fp32 math."""
    kind, g, d = _kind(tanh), gate.float(), dy.float()
    return (d * up.float() * _slope(kind, g)).to(gate.dtype), (d * _act(kind, g)).to(gate.dtype)


def fused_reference(gate_up, tanh=None):
    """gated_reference of the two halves of gate_up (..., 2I)."""
    return gated_reference(*gate_up.chunk(2, -1), tanh)


def fused_backward_reference(dy, gate_up, tanh=None):
    """d(gate_up) (..., 2I): (dgate, dup) side by side."""
    return torch.cat(gated_backward_reference(*gate_up.chunk(2, -1), dy, tanh), -1)


def gelu_reference(x, tanh):
    return _act(kernels.gelu_kind(tanh), x.float()).to(x.dtype)


def gelu_backward_reference(x, dy, tanh):
    return (dy.float() * _slope(kernels.gelu_kind(tanh), x.float())).to(x.dtype)


# ----------------------------------------------------------------------------- checks


def _check_fused(bound) -> None:
    n = bound["gate_up"].shape[-1]
    if n % 2:
        raise ValueError(
            "gate (the fused gate_up projection, up=None) must have an even last dimension "
            f"(..., 2I); got {tuple(bound['gate_up'].shape)}"
        )


def _check_fused_backward(bound) -> None:
    dy, gate_up = bound["dy"], bound["gate_up"]
    if gate_up.shape != (*dy.shape[:-1], 2 * dy.shape[-1]):
        raise ValueError(
            f"gate_up must have the shape (..., 2I) of dy's (..., I) {tuple(dy.shape)}; got "
            f"{tuple(gate_up.shape)}"
        )
    check_like("dy", dy, gate_up[..., : dy.shape[-1]], "gate_up's halves")


def _check_pair(bound) -> None:
    """The strided ops' tensors (Tensors: not copied to dense rows by the op)."""
    check_input("gate", bound["gate"])
    check_like("up", bound["up"], bound["gate"], "gate")
    if "dy" in bound:
        check_like("dy", bound["dy"], bound["gate"], "gate")


def _half(bound) -> tuple:
    """The fused op's output shape: gate_up's (..., 2I) as (..., I)."""
    shape = bound["gate_up"].shape
    return (*shape[:-1], shape[-1] // 2)


# ----------------------------------------------------------------------------- strided


def strided_layout(gate: torch.Tensor, up: torch.Tensor) -> tuple[int, int] | None:
    """(x_group, x_stride) where gate and up lay their rows out alike at a stride the strided
    kernels read in place (common.grouped_rows), else None (dense rows, or rows to copy)."""
    if gate.numel() == 0 or gate.stride() != up.stride():
        return None
    layout = grouped_rows(gate)
    if layout is None or layout[0] == row_count(gate):  # not readable, or dense after all
        return None
    return layout


def _strided_values(kernel, gate, tanh, layout, ptrs) -> tuple:
    """The strided kernel's table values: 16-byte vectors where every row starts aligned."""
    N, size = gate.shape[-1], gate.element_size()
    vectorize = aligned(*ptrs, layout[1] * size) and N * size % 16 == 0
    return (N, DTYPE_NAMES[gate.dtype], *(() if tanh is None else (tanh,)), vectorize)


def _strided_launch(dense: Op, strided_kernel, names: tuple[str, ...]):
    """The strided ops' CUDA kernel: gate and up read in place at their stride (the other
    tensors dense), or copied to dense rows and run by the dense op's launch."""

    def cuda(gate, up, *rest):
        tanh = rest[-1] if rest and isinstance(rest[-1], bool) else None
        tensors = [t if t.is_contiguous() else t.contiguous() for t in rest if torch.is_tensor(t)]
        layout = strided_layout(gate, up)
        if layout is None:  # copies, then the dense kernel
            args = (gate.contiguous(), up.contiguous(), *tensors)
            return dense.run(*args, *(() if tanh is None else (tanh,)))
        outs = tuple(torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) for _ in names)
        M = row_count(gate)
        if M == 0 or gate.shape[-1] == 0:
            return outs[0] if len(outs) == 1 else outs
        ptrs = [t.data_ptr() for t in (gate, up, *tensors, *outs)]
        values = _strided_values(strided_kernel, gate, tanh, layout, ptrs)
        device = gate.get_device()
        with device_guard(gate):
            launcher = launcher_for(strided_kernel, device, values)
            group, stride = layout
            launcher(rows_grid(launcher, M), stream_of(device), *ptrs, M, group, stride,
                     group_magic(group))  # fmt: skip
        return outs[0] if len(outs) == 1 else outs

    return cuda


# ----------------------------------------------------------------------------- the ops


def _declare(family: str, fwd, bwd, strided_fwd, strided_bwd, fused_fwd, fused_bwd, gelu: bool):
    """The three gated ops of one activation (module docstring): (dense, strided, fused)."""
    scalars = (Scalar("tanh", "bool"),) if gelu else ()
    pair = (Rows("gate"), Like("up", "gate"))
    dense = Op(
        f"kbuild::{family}",
        args=(*pair, *scalars),
        outputs=(Out("y", like="gate"),),
        launch=Launch(fwd),
        reference=gated_reference,
        backward=Op(
            f"kbuild::{family}_backward",
            args=(*pair, Like("dy", "gate"), *scalars),
            outputs=(Out("dgate", like="gate"), Out("dup", like="gate")),
            launch=Launch(bwd),
            reference=gated_backward_reference,
        ),
    )
    views = (Tensors("gate"), Tensors("up"))
    strided = Op(
        f"kbuild::{family}_strided",
        args=(*views, *scalars),
        outputs=(Out("y", like="gate"),),
        cuda=_strided_launch(dense, strided_fwd, ("y",)),
        check=_check_pair,
        reference=gated_reference,
        backward=Op(
            f"kbuild::{family}_strided_backward",
            args=(*views, Tensors("dy"), *scalars),
            outputs=(Out("dgate", like="gate"), Out("dup", like="gate")),
            cuda=_strided_launch(dense.backward, strided_bwd, ("dgate", "dup")),
            check=_check_pair,
            reference=gated_backward_reference,
        ),
    )
    fused = Op(
        f"kbuild::{family}_fused",
        args=(Rows("gate_up"), *scalars),
        outputs=(Out("y", like="gate_up", shape=_half),),
        launch=Launch(fused_fwd, values={"N": lambda bound: bound["gate_up"].shape[-1] // 2}),
        check=_check_fused,
        reference=fused_reference,
        backward=Op(
            f"kbuild::{family}_fused_backward",
            args=(Rows("dy"), Rows("gate_up"), *scalars),  # dy first: N = I, dy's dtype
            outputs=(Out("dgate_up", like="gate_up"),),
            launch=Launch(fused_bwd),
            check=_check_fused_backward,
            reference=fused_backward_reference,
        ),
    )
    return dense, strided, fused


K = kernels
SWIGLU = _declare("swiglu", K.build_swiglu_fwd, K.build_swiglu_bwd, K.build_swiglu_strided_fwd,
                  K.build_swiglu_strided_bwd, K.build_swiglu_fused_fwd, K.build_swiglu_fused_bwd,
                  gelu=False)  # fmt: skip
GEGLU = _declare("geglu", K.build_geglu_fwd, K.build_geglu_bwd, K.build_geglu_strided_fwd,
                 K.build_geglu_strided_bwd, K.build_geglu_fused_fwd, K.build_geglu_fused_bwd,
                 gelu=True)  # fmt: skip
GELU = Op(
    "kbuild::gelu",
    args=(Rows("x"), Scalar("tanh", "bool")),
    outputs=(Out("y", like="x"),),
    launch=Launch(K.build_gelu_fwd),
    reference=gelu_reference,
    backward=Op(
        "kbuild::gelu_backward",
        args=(Rows("x"), Like("dy", "x"), Scalar("tanh", "bool")),
        outputs=(Out("dx", like="x"),),
        launch=Launch(K.build_gelu_bwd),
        reference=gelu_backward_reference,
    ),
)


# ----------------------------------------------------------------------------- public


def _tanh(approximate: object) -> bool:
    if not isinstance(approximate, str):
        raise TypeError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be 'tanh' or 'none'; got {approximate!r}")
    return approximate == "tanh"


def _gated(ops: tuple[Op, Op, Op], gate, up, tanh: bool | None) -> torch.Tensor:
    dense, strided, fused = ops
    scalars = () if tanh is None else (tanh,)
    check_input("gate", gate)
    if up is None:
        _check_fused({"gate_up": gate})
        return fused(gate, *scalars)
    check_like("up", up, gate, "gate")
    if gate.is_contiguous() and up.is_contiguous():
        return dense(gate, up, *scalars)
    return strided(gate, up, *scalars)


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up, the gated MLP of Llama, Mistral and Qwen.

    gate, up: (..., I) float32 / float16 / bfloat16, of one shape, dtype and device; either
    may be a strided view (read in place where both lay their rows out alike, else copied).
    up=None: gate is the fused (..., 2I) output of one gate_up projection, gate its first I
    columns and up the rest (Phi-3's `gate, up = x.chunk(2, -1)`), read without a copy.
    Returns y (..., I) of gate's dtype: fp32 math, one rounding. Saved for backward: gate and
    up (or gate_up) only; the backward recomputes silu and writes dgate and dup (or one
    d(gate_up) of (..., 2I))."""
    return _gated(SWIGLU, gate, up, None)


def geglu(
    gate: torch.Tensor, up: torch.Tensor | None = None, approximate: str = "tanh"
) -> torch.Tensor:
    """gelu(gate, approximate) * up, the gated MLP of Gemma (gelu_pytorch_tanh: "tanh").

    approximate: "tanh" (GPT-2's 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))) or "none"
    (the erf form), as torch.nn.functional.gelu. Shapes, dtypes, the fused form (up=None) and
    what is saved for backward as `swiglu`."""
    return _gated(GEGLU, gate, up, _tanh(approximate))


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """torch.nn.functional.gelu(x, approximate), its signature and default (the erf form);
    approximate="tanh" is GPT-2's (llm.c's).

    x: (..., N) float32 / float16 / bfloat16 (a non-contiguous x is copied first). Returns y
    of x's shape and dtype: fp32 math, one rounding. Saved for backward: x only; dx = dy
    gelu'(x), recomputed from x."""
    return GELU(x, _tanh(approximate))


# ----------------------------------------------------------------------------- warming

FAMILIES = {"swiglu": SWIGLU, "geglu": GEGLU}


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def gated_specs(family: str, N: int, dtype: torch.dtype, tanh: bool | None = None) -> list:
    """The specs a gated op asks for on aligned rows of I = N: its dense, fused and strided
    (the halves of one (M, 2N) tensor) forms, forward and backward."""
    dense, strided, fused = FAMILIES[family]
    scalars = () if tanh is None else (tanh,)
    x, gu = _meta(1, N, dtype=dtype), _meta(1, 2 * N, dtype=dtype)
    both = dense.kernel_values(x, x, *scalars) + dense.backward.kernel_values(x, x, x, *scalars)
    both += fused.kernel_values(gu, *scalars) + fused.backward.kernel_values(x, gu, *scalars)
    specs = [k.spec(*values) for k, values in both]
    layout, ptrs = (1, 2 * N), (0, N * gu.element_size())  # where the halves of gu start
    for k in (getattr(kernels, f"build_{family}_strided_{p}") for p in ("fwd", "bwd")):
        specs.append(k.spec(*_strided_values(k, x, tanh, layout, ptrs)))
    return specs


def warmup_specs():
    """What `kbuild warmup --module kbuild.kernels.activations.op` compiles: every kernel the GPU
    tests launch (each form, forward and backward, both GELU forms) and each model width's
    in bf16, fp16 and fp32."""
    specs = []
    for N in cases.ACTIVATION_GPU_N:
        for dtype in cases.ACTIVATION_GPU_DTYPES:
            misaligned = (N, dtype) == cases.ACTIVATION_MISALIGNED
            specs += gated_specs("swiglu", N, dtype)
            for tanh in (True, False):
                specs += gated_specs("geglu", N, dtype, tanh)
            specs += GELU.warm_specs(N, dtype, misaligned=misaligned)
            if misaligned:
                for dense in (SWIGLU[0], GEGLU[0]):
                    specs += dense.warm_specs(N, dtype)
    for family, N in cases.ACTIVATION_MODELS:
        for dtype in cases.ACTIVATION_GPU_DTYPES:
            if family == "gelu":
                x = _meta(1, N, dtype=dtype)
                both = GELU.kernel_values(x, True) + GELU.backward.kernel_values(x, x, True)
                specs += [k.spec(*values) for k, values in both]
            else:
                specs += gated_specs(family, N, dtype, None if family == "swiglu" else True)
    return list(dict.fromkeys(specs))
