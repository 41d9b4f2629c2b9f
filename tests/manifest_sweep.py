"""Kernel specs of the manifests as the op calls that launch them, and those calls run on the
interpreter against fp64 (tests/test_interpret_manifest_cpu.py picks the specs).

`call_for(spec)` is the call of a public op (kbuild.rmsnorm, kbuild.cross_entropy, ...) that
launches `spec` at a few rows: a training step (forward and backward) for a backward kernel,
a forward with gradients wanted (mode "forward": statistics stored, no backward run) for a
forward storing statistics, an inference call for one storing none. Run as a module in a
process with KBUILD_INTERPRET=<arch> and KBUILD_RECORD=FILE (the record shows which specs
the calls launched):

    python -m tests.manifest_sweep CALLS.json RESULTS.jsonl

it makes each call with seeded inputs and holds every output and gradient to fp64 torch (the
GPU tests' GRAD_TOL of the output's dtype, by norm and by max; dx of the norms against the
size of its terms, tests/reference.py `dx_terms`), writing one JSON line a call: {"label",
"error": None or what failed, "seconds"}; where the interpreter's race check stopped the
call, "without_race_check": the same call's checks with it off (the values still count).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import kbuild
from kbuild.spec import KernelSpec, Scalar

from .gpu_utils import GRAD_TOL
from .reference import assert_close_rel, dx_terms, layernorm_grads, rmsnorm_grads

TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
INDEX = {"i32": torch.int32, "i64": torch.int64}
# The cross-entropy options as the calls switch them on (kbuild.cross_entropy's arguments).
SMOOTHING, Z_LOSS, SOFTCAP = 0.1, 1e-2, 30.0
IGNORE = -100


@dataclass(frozen=True)
class Call:
    """A public op called on rows of N at a few rows, with `options` (op-specific, sorted)."""

    op: str
    N: int
    options: tuple[tuple[str, Scalar], ...]

    @classmethod
    def make(cls, op: str, N: int, **options: Scalar) -> Call:
        return cls(op, N, tuple(sorted(options.items())))

    def replace(self, **changes: Scalar) -> Call:
        return Call.make(self.op, self.N, **{**dict(self.options), **changes})

    def trainings(self) -> list[Call]:
        """The training steps that launch the forward a "forward" call checks (its backward
        too): the same call with mode "train" (the fused form's with and without a residual
        gradient); none for other calls."""
        if dict(self.options).get("mode") != "forward":
            return []
        if self.op == "fused_add_rmsnorm":
            return [self.replace(mode="train", dres=dres) for dres in (False, True)]
        return [self.replace(mode="train")]

    @property
    def rows(self) -> int:
        """A few rows: three (a peeled row's first three phases), two of the widest (their
        interpretation costs the most)."""
        return 3 if self.N <= 16384 else 2

    @property
    def label(self) -> str:
        given = ", ".join(f"{k}={v}" for k, v in (("N", self.N), *self.options))
        return f"{self.op}({given})"

    def to_json(self) -> dict:
        return {"op": self.op, "N": self.N, "options": dict(self.options)}

    @classmethod
    def from_json(cls, data: dict) -> Call:
        return cls.make(data["op"], data["N"], **data["options"])


# ----------------------------------------------------------------------------- spec -> call


def call_for(spec: KernelSpec) -> Call:
    """The op call that launches `spec` (ValueError for a kernel no call here reaches)."""
    p = spec.kwargs
    name = spec.kernel
    if name in ("rmsnorm_fwd", "rmsnorm_bwd"):
        w = p["weight_dtype"]
        if name == "rmsnorm_fwd":
            mode = "forward" if p["store_rstd"] else "infer"
        else:  # a weight that takes no gradient: frozen
            mode = "train" if p["compute_dw"] or w is None else "frozen"
        return Call.make("rmsnorm", p["N"], dtype=p["dtype"], weight=w, eps=p.get("eps", 1e-6),
                         offset=p.get("offset", 0.0), aligned=p["vectorize"],
                         strided=p.get("strided", False), mode=mode)  # fmt: skip
    if name in ("fused_add_rmsnorm_fwd", "fused_add_rmsnorm_bwd"):
        if name.endswith("fwd"):
            mode = "forward" if p["store_rstd"] else "infer"
            dres, residual_in = False, p.get("residual_in_dtype")
        else:
            mode, dres, residual_in = "train", p["has_dresidual_out"], p.get("dresidual_dtype")
        return Call.make("fused_add_rmsnorm", p["N"], dtype=p["dtype"], weight=p["weight_dtype"],
                         residual=p["residual_dtype"], residual_in=residual_in,
                         eps=p.get("eps", 1e-6), offset=p.get("offset", 0.0), mode=mode,
                         dres=dres)  # fmt: skip
    if name == "layernorm_fwd":
        return Call.make("layernorm", p["N"], dtype=p["dtype"], weight=p["weight_dtype"],
                         bias=p["bias_dtype"], eps=p["eps"],
                         mode="forward" if p["store_stats"] else "infer")  # fmt: skip
    if name == "layernorm_bwd":  # the manifests' backwards: dw and db wherever w and b are
        bias = (p["weight_dtype"] or p["dtype"]) if p["compute_db"] else None
        return Call.make("layernorm", p["N"], dtype=p["dtype"], weight=p["weight_dtype"],
                         bias=bias, eps=1e-5, mode="train")  # fmt: skip
    if name == "column_sum":  # dw (and db, two planes) of a norm's training step
        d = p["out_dtype"]
        if p.get("planes", 1) == 2:
            return Call.make("layernorm", p["N"], dtype=d, weight=d, bias=d, eps=1e-5, mode="train")
        return Call.make("rmsnorm", p["N"], dtype=d, weight=d, eps=1e-6, offset=0.0, aligned=True,
                         strided=False, mode="train")  # fmt: skip
    if name == "bias_grad":
        return Call.make("bias_grad", p["OC"], dtype=p["dtype"])
    if name.startswith("encoder_"):
        index = p.get("index_dtype", "i32")  # the wpe pass reads no ids
        accumulate = p.get("accumulate", False)  # kbuild.encoder_backward adds into dwpe
        return Call.make("encoder", p["C"], dtype=p["dtype"], index=index,
                         mode="accumulate" if accumulate else "train")  # fmt: skip
    if name == "rope":
        if p["interleaved"] or p["vec"] != 16 // TORCH[p["dtype"]].itemsize:
            raise ValueError(f"no call here launches {spec.short()} (interleaved or narrow)")
        return Call.make("rope", p["D"], rd=p["rd"], dtype=p["dtype"], cs_dtype=p["cs_dtype"])
    if name in ("cross_entropy_fwd", "cross_entropy_rescale"):
        fwd = name == "cross_entropy_fwd"
        options = {k: p.get(k, False) for k in ("smoothing", "z_loss", "softcap")}
        return Call.make("cross_entropy", p["N"], dtype=p["dtype"],
                         index=p["index_dtype"] if fwd else "i64", grad=p["grad"] if fwd else True,
                         many_rows="cluster" in p, **options)  # fmt: skip
    family, _, form = name.partition("_")
    if family == "gelu":
        return Call.make("gelu", p["N"], dtype=p["dtype"], tanh=p["tanh"])
    if family in ("swiglu", "geglu"):
        layout = next((f for f in ("strided", "fused") if f in form), "dense")
        return Call.make(family, p["N"], dtype=p["dtype"], tanh=p.get("tanh"), layout=layout)
    if name in ("user_softmax_fwd", "user_softmax_bwd"):
        return Call.make("example_softmax", p["N"], dtype=p["dtype"])
    raise ValueError(f"no call here launches {spec.short()}")


# ----------------------------------------------------------------------------- checks


def close(out: torch.Tensor, ref: torch.Tensor, what: str, tol=None, floor=None) -> None:
    """`out` within `tol` (the GPU tests' GRAD_TOL of out's dtype) of fp64 `ref`."""
    assert_close_rel(out, ref, GRAD_TOL[out.dtype] if tol is None else tol, what, floor)


def param_tol(*tensors: torch.Tensor) -> float:
    """A parameter gradient's tolerance: its own dtype's plus the rows' (the GPU tests')."""
    return sum(GRAD_TOL[t.dtype] for t in tensors)


class Inputs:
    """Seeded tensors of one call (the seed is the call's label)."""

    def __init__(self, label: str):
        self.g = torch.Generator().manual_seed(zlib.crc32(label.encode()))

    def randn(self, *shape, dtype=torch.float32, scale=1.0, offset=0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=self.g) * scale + offset).to(dtype)

    def param(self, n: int, dtype: str | None) -> torch.Tensor | None:
        """A weight or bias, values far from 0 and 1 (one ignored or applied twice shows)."""
        return None if dtype is None else self.randn(n, dtype=TORCH[dtype], scale=0.7, offset=0.4)

    def misaligned(self, *shape, dtype) -> torch.Tensor:
        """A dense tensor one element into its storage: not 16-byte aligned."""
        return self.randn(torch.Size(shape).numel() + 1, dtype=dtype)[1:].view(shape)


def wanted(*tensors: torch.Tensor | None) -> list[torch.Tensor]:
    return [t for t in tensors if t is not None and t.requires_grad]


# ----------------------------------------------------------------------------- the norms


def qk_view(inputs: Inputs, N: int, dtype, pad: int) -> torch.Tensor:
    """The q of a fused qkv projection (B, T, H, D = N) = (1, 2, 2, N), read by RMSNorm in
    place: rows `pad` elements longer than q, k and v (a stride not a whole number of 16-byte
    vectors where pad is odd)."""
    heads, kv, T = 2, 1, 2
    qkv = inputs.randn(1, T, (heads + 2 * kv) * N + pad, dtype=dtype)
    return qkv[..., : heads * N].view(1, T, heads, N)


def run_rmsnorm(c: Call, inputs: Inputs, dtype, weight, eps, offset, aligned, strided, mode):
    M, N, dt = c.rows, c.N, TORCH[dtype]
    if strided:
        x = qk_view(inputs, N, dt, pad=0 if aligned else 1)
    elif aligned:
        x = inputs.randn(M, N, dtype=dt)
    else:
        x = inputs.misaligned(M, N, dtype=dt)
    w = inputs.param(N, weight)
    x.requires_grad_(mode != "infer")
    if w is not None:
        w.requires_grad_(mode in ("forward", "train"))
    y = kbuild.rmsnorm(x, w, eps, offset or None)
    dy = inputs.randn(*x.shape, dtype=dt)
    ref_y, ref_dx, ref_dw, _ = rmsnorm_grads(x.detach(), w, dy, eps, offset=offset)
    close(y, ref_y, "y")
    if mode in ("infer", "forward"):
        return
    grads = torch.autograd.grad(y, wanted(x, w), dy)
    floor = dx_terms(x, None if w is None else w.detach() + offset, dy, eps)
    close(grads[0], ref_dx, "dx", floor=floor)
    if mode == "train" and w is not None:
        close(grads[1], ref_dw, "dw", param_tol(w, x))


def run_fused_add_rmsnorm(c: Call, inputs: Inputs, dtype, weight, residual, residual_in, eps,
                          offset, mode, dres):  # fmt: skip
    M, N, dt = c.rows, c.N, TORCH[dtype]
    x = inputs.randn(M, N, dtype=dt).requires_grad_(mode != "infer")
    r = inputs.randn(M, N, dtype=TORCH[residual_in or dtype]).requires_grad_(mode != "infer")
    w = inputs.param(N, weight)
    if w is not None:
        w.requires_grad_(mode != "infer")
    out, res = kbuild.fused_add_rmsnorm(x, r, w, eps, residual_in_fp32=residual == "f32",
                                        offset=offset or None)  # fmt: skip
    res_ref = (x.detach().double() + r.detach().double()).to(TORCH[residual])
    assert torch.equal(res, res_ref), "residual_out is not x + residual rounded once"
    dy = inputs.randn(M, N, dtype=dt)
    dres_out = inputs.randn(M, N, dtype=res.dtype) if dres else None
    ref_y, ref_d, ref_dw, _ = rmsnorm_grads(res_ref, w, dy, eps, dresidual_out=dres_out,
                                            offset=offset)  # fmt: skip
    close(out, ref_y, "out")
    if mode in ("infer", "forward"):
        return
    outputs, grads_in = ([out, res], [dy, dres_out]) if dres else ([out], [dy])
    grads = torch.autograd.grad(outputs, wanted(x, r, w), grads_in)
    floor = dx_terms(res_ref, None if w is None else w.detach() + offset, dy, eps)
    close(grads[0], ref_d, "dx", floor=floor)
    close(grads[1], ref_d, "dresidual", tol=GRAD_TOL[dt], floor=floor)
    if w is not None:
        close(grads[2], ref_dw, "dw", param_tol(w, x))


def run_layernorm(c: Call, inputs: Inputs, dtype, weight, bias, eps, mode):
    M, N, dt = c.rows, c.N, TORCH[dtype]
    x = inputs.randn(M, N, dtype=dt, offset=0.5).requires_grad_(mode != "infer")
    w, b = inputs.param(N, weight), inputs.param(N, bias)
    for p in (w, b):
        if p is not None:
            p.requires_grad_(mode != "infer")
    y = kbuild.layernorm(x, w, b, eps)
    dy = inputs.randn(M, N, dtype=dt)
    ref_y, ref_dx, ref_dw, ref_db = layernorm_grads(x, w, b, dy, eps)
    close(y, ref_y, "y")
    if mode in ("infer", "forward"):
        return
    grads = iter(torch.autograd.grad(y, wanted(x, w, b), dy))
    close(next(grads), ref_dx, "dx", floor=dy.double() * (1.0 if w is None else w.double()))
    for p, ref, what in ((w, ref_dw, "dw"), (b, ref_db, "db")):
        if p is not None:
            close(next(grads), ref, what, param_tol(p, x))


# ----------------------------------------------------------------------------- llm.c ops


def run_encoder(c: Call, inputs: Inputs, dtype, index, mode):
    """GPT-2's embedding: a training step (forward, then dwte and dwpe by autograd), or
    kbuild.encoder_backward adding into existing gradients ("accumulate")."""
    C, dt, V, B, T = c.N, TORCH[dtype], 5, 2, 3
    tokens = torch.randint(0, V, (B, T), generator=inputs.g, dtype=INDEX[index])
    tokens[1, 2] = tokens[0, 0]  # an id at two positions: its rows add up
    wte, wpe = inputs.randn(V, C, dtype=dt), inputs.randn(T + 1, C, dtype=dt)
    dout = inputs.randn(B, T, C, dtype=dt)
    wte_d, wpe_d = wte.double().requires_grad_(), wpe.double().requires_grad_()
    ref = wte_d[tokens.long()] + wpe_d[:T]
    ref_dwte, ref_dwpe = torch.autograd.grad(ref, [wte_d, wpe_d], dout.double())
    if mode == "accumulate":
        dwte, dwpe = inputs.randn(V, C, dtype=dt), inputs.randn(T + 1, C, dtype=dt)
        ref_dwte, ref_dwpe = ref_dwte + dwte.double(), ref_dwpe + dwpe.double()
        kbuild.encoder_backward(dout, tokens, dwte, dwpe)
    else:
        out = kbuild.encoder(tokens, wte.requires_grad_(), wpe.requires_grad_())
        close(out, ref, "out")
        dwte, dwpe = torch.autograd.grad(out, [wte, wpe], dout)
    close(dwte, ref_dwte, "dwte")
    close(dwpe, ref_dwpe, "dwpe")


def run_bias_grad(c: Call, inputs: Inputs, dtype):
    dout = inputs.randn(c.rows, c.N, dtype=TORCH[dtype])
    close(kbuild.bias_grad(dout), dout.double().sum(0), "dbias")


# ----------------------------------------------------------------------------- rotary, MLP


def run_rope(c: Call, inputs: Inputs, rd, dtype, cs_dtype):
    """q and k as views of one fused qkv projection (B, T, H, D), rotate-half."""
    from kbuild.kernels.rope.op import case_tensors

    D, dt = c.N, TORCH[dtype]
    case = (1, 3, 4, 2, D, rd, dt, TORCH[cs_dtype], False, 1, True)
    q, k, cos, sin = case_tensors(case, "cpu", seed=zlib.crc32(c.label.encode()))
    q.requires_grad_(), k.requires_grad_()
    outs = kbuild.rope(q, k, cos, sin)
    dq_out, dk_out = inputs.randn(*q.shape, dtype=dt), inputs.randn(*k.shape, dtype=dt)
    grads = torch.autograd.grad(outs, [q, k], [dq_out, dk_out])

    cos_d, sin_d = cos.double().unsqueeze(1), sin.double().unsqueeze(1)  # (B, 1, T, rd)

    def rotated(x):  # fp64: x[:rd] cos + rotate_half(x[:rd]) sin, the rest as it is
        v = x[..., :rd]
        a, b = v.chunk(2, -1)
        return torch.cat((v * cos_d + torch.cat((-b, a), -1) * sin_d, x[..., rd:]), -1)

    q_d, k_d = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    refs = rotated(q_d), rotated(k_d)
    ref_grads = torch.autograd.grad(refs, [q_d, k_d], [dq_out.double(), dk_out.double()])
    names = ("q", "k", "dq", "dk")
    for out, ref, what in zip((*outs, *grads), (*refs, *ref_grads), names, strict=True):
        close(out, ref, what)


def run_gated(c: Call, inputs: Inputs, family: str, dtype, tanh, layout):
    """swiglu / geglu on gate and up: dense, the halves of one (M, 2N) projection passed
    separately (strided), or that projection whole (fused)."""
    M, N, dt = c.rows, c.N, TORCH[dtype]
    gate_up = inputs.randn(M, 2 * N, dtype=dt, scale=2.0).requires_grad_()
    if layout == "dense":
        gate, up = (t.detach().contiguous().requires_grad_() for t in gate_up.chunk(2, -1))
    else:
        gate, up = gate_up.chunk(2, -1)
    args = (gate_up,) if layout == "fused" else (gate, up)
    approximate = "tanh" if tanh else "none"
    y = kbuild.swiglu(*args) if family == "swiglu" else kbuild.geglu(*args, approximate=approximate)
    dy = inputs.randn(M, N, dtype=dt)
    if layout == "fused":  # one gradient, d(gate_up), of both halves
        grads = torch.autograd.grad(y, [gate_up], dy)[0].chunk(2, -1)
    else:
        grads = torch.autograd.grad(y, [gate, up], dy)
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    act = F.silu(g64) if family == "swiglu" else F.gelu(g64, approximate=approximate)
    ref = act * u64
    ref_grads = torch.autograd.grad(ref, [g64, u64], dy.double())
    for out, r, what in zip((y, *grads), (ref, *ref_grads), ("y", "dgate", "dup"), strict=True):
        close(out, r, what)


def run_gelu(c: Call, inputs: Inputs, dtype, tanh):
    approximate = "tanh" if tanh else "none"
    x = inputs.randn(c.rows, c.N, dtype=TORCH[dtype], scale=2.0).requires_grad_()
    y = kbuild.gelu(x, approximate)
    dy = inputs.randn(*x.shape, dtype=x.dtype)
    (dx,) = torch.autograd.grad(y, [x], dy)
    x64 = x.detach().double().requires_grad_()
    ref = F.gelu(x64, approximate=approximate)
    close(y, ref, "y")
    close(dx, torch.autograd.grad(ref, [x64], dy.double())[0], "dx")


# ----------------------------------------------------------------------------- losses


def cross_entropy_rows(x, t, smoothing, z_loss, softcap):
    """(per-row loss, lse) in fp64: torch's cross-entropy plus z * lse^2 (0 on ignored rows),
    of the logits capped as cap * tanh(x / cap)."""
    xc = SOFTCAP * torch.tanh(x / SOFTCAP) if softcap else x
    ls = SMOOTHING if smoothing else 0.0
    rows = F.cross_entropy(xc, t.long(), reduction="none", label_smoothing=ls,
                           ignore_index=IGNORE)  # fmt: skip
    lse = torch.logsumexp(xc, -1)
    return rows + torch.where(t != IGNORE, (Z_LOSS if z_loss else 0.0) * lse * lse, 0.0), lse


@contextlib.contextmanager
def many_rows_from(M: int):
    """kbuild.cross_entropy's plan of many rows (MANY_ROWS: one block a row on cluster
    targets) for calls of M rows: the manifests warm it for 2048 rows and more."""
    from kbuild.kernels.loss import kernels as ce

    many, ce.MANY_ROWS = ce.MANY_ROWS, M
    try:
        yield
    finally:
        ce.MANY_ROWS = many


def run_cross_entropy(c: Call, inputs: Inputs, dtype, index, grad, many_rows, smoothing,
                      z_loss, softcap):  # fmt: skip
    """kbuild.cross_entropy per row (reduction "none"), its backward rescaling the rows by an
    incoming gradient of its own per row. The plan of many rows on a target without clusters
    is never the op's (it keeps the chooser's): there its spec is launched directly."""
    from kbuild.interpret.launcher import interpret_target

    M, V, dt = c.rows, c.N, TORCH[dtype]
    x = inputs.randn(M, V, dtype=dt, scale=3.0)
    t = torch.randint(0, V, (M,), generator=inputs.g, dtype=INDEX[index])
    t[1] = IGNORE
    x64 = x.double().requires_grad_()
    ref, ref_lse = cross_entropy_rows(x64, t, smoothing, z_loss, softcap)
    if many_rows and interpret_target().max_cluster == 1:
        return launch_cross_entropy(x, t, x64, ref, ref_lse, grad, smoothing, z_loss, softcap)
    options = dict(label_smoothing=SMOOTHING if smoothing else 0.0,
                   lse_square_scale=Z_LOSS if z_loss else 0.0,
                   softcap=SOFTCAP if softcap else None)  # fmt: skip
    x.requires_grad_(grad)
    with many_rows_from(M) if many_rows else contextlib.nullcontext():
        loss = kbuild.cross_entropy(x, t, reduction="none", **options)
    close(loss.float(), ref, "loss", tol=GRAD_TOL[dt])
    if grad:
        dloss = inputs.randn(M, dtype=dt) + 1.5
        (dx,) = torch.autograd.grad(loss, [x], dloss)
        close(dx, torch.autograd.grad(ref, [x64], dloss.double())[0], "dlogits")


def launch_cross_entropy(x, t, x64, ref, ref_lse, grad, smoothing, z_loss, softcap):
    """The forward's many-rows spec (cluster=1) launched as kbuild.cross_entropy launches it:
    per-row loss and lse, and with `grad` the gradient of the rows' sum."""
    from kbuild.kernels.loss.cross_entropy import fwd_values
    from kbuild.kernels.loss.kernels import build_cross_entropy_fwd
    from kbuild.op.launch import rows_grid

    M, V = x.shape
    coefs = torch.tensor([1.0, SMOOTHING, Z_LOSS, SOFTCAP])
    loss, lse = torch.empty(M), torch.empty(M)
    d = torch.empty_like(x) if grad else None
    flag = torch.zeros(1, dtype=torch.int32)
    values = fwd_values(V, x.dtype, t.dtype, smoothing, z_loss, grad, True, softcap)
    args = (x, t, coefs, loss, lse, *([d] if grad else []), flag, M, IGNORE)
    kbuild.launch(build_cross_entropy_fwd, lambda launcher: rows_grid(launcher, M), *args,
                  **values, cluster=1)  # fmt: skip
    close(loss, ref, "loss", tol=GRAD_TOL[x.dtype])
    close(lse, ref_lse, "lse", tol=GRAD_TOL[x.dtype])
    assert int(flag) == 0, "a valid target was reported bad"
    if grad:
        close(d, torch.autograd.grad(ref.sum(), [x64])[0], "dlogits")


# ----------------------------------------------------------------------------- users' kernels


def run_example_softmax(c: Call, inputs: Inputs, dtype):
    """examples/custom_softmax.py's op (its two kernels), forward and backward."""
    from .examples import import_example

    softmax = import_example().softmax
    x = inputs.randn(c.rows, c.N, dtype=TORCH[dtype], scale=3.0).requires_grad_()
    y = softmax(x)
    dy = inputs.randn(*x.shape, dtype=x.dtype)
    (dx,) = torch.autograd.grad(y, [x], dy)
    x64 = x.detach().double().requires_grad_()
    ref = torch.softmax(x64, -1)
    close(y, ref, "y")
    close(dx, torch.autograd.grad(ref, [x64], dy.double())[0], "dx")


def run_row_api_nll(c: Call, inputs: Inputs, index):
    """tests/test_row_api_cpu.py's loss kernel (a per-row id, a gather at it, the columns
    compared with it, a bad id reported), launched as a user launches it."""
    from kbuild.op.launch import rows_grid

    from .test_row_api_cpu import NLL, build_nll

    nll = kbuild.kernel("test_row_api_nll", **NLL)(build_nll)
    M, N = c.rows, c.N
    logits = inputs.randn(M, N, dtype=torch.bfloat16)
    t = torch.randint(0, N, (M,), generator=inputs.g, dtype=INDEX[index])
    t[-1] = N  # out of range: reported, column 0 read instead
    loss, hit = torch.empty(M), torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    flag = torch.zeros(1, dtype=torch.int32)
    kbuild.launch(nll, lambda launcher: rows_grid(launcher, M), logits, t, loss, hit, flag, M,
                  N=N, dtype="bf16", index=index)  # fmt: skip
    safe = torch.where(t < N, t, 0).long()
    assert torch.equal(loss, -logits.float().gather(1, safe[:, None])[:, 0]), "loss"
    assert torch.equal(hit, F.one_hot(safe, N).to(hit.dtype)), "hit"
    assert int(flag) == 3, f"the bad id raised the flag to {int(flag)}, not 3"


def run_user_scale(c: Call, inputs: Inputs):
    """tests/test_user_kernels_cpu.py's kernel from a user's module (y = 2 x, importing its
    factor from a module beside it), launched with kbuild.launch."""
    import importlib

    from .test_user_kernels_cpu import USER_KERNEL

    x, y = inputs.randn(c.rows, c.N), torch.full((c.rows, c.N), float("nan"))
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "sweep_scale_helper.py").write_text("FACTOR = 2.0\n")
        source = USER_KERNEL.format(name="sweep_scale", helper="sweep_scale_helper")
        (Path(folder) / "sweep_scale.py").write_text(source)
        sys.path.insert(0, folder)
        try:
            build_scale = importlib.import_module("sweep_scale").build_scale
            kbuild.launch(build_scale, -(-x.numel() // 128), x, y, c.rows, N=c.N)
        finally:
            sys.path.remove(folder)
    assert torch.equal(y, 2 * x), "y is not 2 x"


RUNNERS = {
    "rmsnorm": run_rmsnorm,
    "fused_add_rmsnorm": run_fused_add_rmsnorm,
    "layernorm": run_layernorm,
    "encoder": run_encoder,
    "bias_grad": run_bias_grad,
    "rope": run_rope,
    "swiglu": lambda c, inputs, **o: run_gated(c, inputs, "swiglu", **o),
    "geglu": lambda c, inputs, **o: run_gated(c, inputs, "geglu", **o),
    "gelu": run_gelu,
    "cross_entropy": run_cross_entropy,
    "example_softmax": run_example_softmax,
    "row_api_nll": run_row_api_nll,
    "user_scale": run_user_scale,
}


def attempt(call: Call) -> Exception | None:
    """None where every check of the call held, else what failed."""
    try:
        RUNNERS[call.op](call, Inputs(call.label), **dict(call.options))
    except Exception as err:
        return err
    return None


def described(err: Exception | None) -> str | None:
    return None if err is None else "".join(traceback.format_exception(err, limit=-4))


@contextlib.contextmanager
def race_check_off():
    was = os.environ.get("KBUILD_INTERPRET_RACES")
    os.environ["KBUILD_INTERPRET_RACES"] = "0"  # read at each launch (interpret/machine.py)
    try:
        yield
    finally:
        if was is None:
            del os.environ["KBUILD_INTERPRET_RACES"]
        else:
            os.environ["KBUILD_INTERPRET_RACES"] = was


def run(call: Call) -> dict:
    """The call's result line (module docstring)."""
    from kbuild.interpret import RaceError

    start = time.perf_counter()
    err = attempt(call)
    result = {"label": call.label, "error": described(err)}
    if isinstance(err, RaceError):
        with race_check_off():
            result["without_race_check"] = described(attempt(call))
    return {**result, "seconds": round(time.perf_counter() - start, 3)}


def main(calls_path: str, results_path: str) -> None:
    torch.set_num_threads(1)  # one process per arch runs beside the other
    calls = [Call.from_json(c) for c in json.loads(Path(calls_path).read_text())]
    with open(results_path, "a", encoding="utf-8") as out:
        for call in calls:
            out.write(json.dumps(run(call)) + "\n")
            out.flush()


if __name__ == "__main__":
    main(*sys.argv[1:])
