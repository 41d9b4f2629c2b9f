"""The transformer block's memory-bound kernels at Llama-3-8B's shapes beside their peers, in
one run on one GPU: rotary embedding, SwiGLU and GeGLU (tanh), and GPT-2's GELU (tanh).

    kbuild warmup --arch sm_90 --module bench/bench_block.py --cache-dir .kbuild-aot
    pip install --no-deps liger_kernel-0.8.5-py3-none-any.whl     # pure Python (+ triton)
    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/bench_block.py [out.json]

Shapes: 8192 tokens as B 4 x T 2048, bf16. Rotary embedding: 32 query heads, 8 key heads,
head_dim 128; q and k as Hugging Face makes them, `q_proj(x).view(B, T, H, D).transpose(1, 2)`
(views (B, H, T, D) of dense (B, T, H * D) projections, read in place), cos / sin (B, T, 128)
bf16 (rotate-half tables, rope theta 500000). SwiGLU and GeGLU: intermediate 14336, gate and
up as two (8192, 14336) tensors and as one fused (8192, 28672) gate_up projection (the
gradient then taken for gate_up). GELU: GPT-2's (8192, 3072) and (8192, 4 * 4096).

Peers: the formula in torch eager (HF's `q * cos + rotate_half(q) * sin`, `F.silu(g) * u`,
`F.gelu(g, approximate="tanh") * u`, `F.gelu(x, approximate="tanh")`), torch.compile of it
(static shapes), and Liger-Kernel's `liger_rotary_pos_emb`, `LigerSiLUMulFunction`,
`LigerGELUMulFunction` where they import (an import failure is recorded under "unavailable").

Forward and backward are separate cases. Forward: one call on inputs without grad, CUDA events.
Backward: `torch.autograd.grad(outputs, inputs, dy, retain_graph=True)` of one forward's graph,
timed by the kernels' device time (profiler), as bench_rows.py times the norms' backward; dy
is laid out as each implementation's output is (`randn_like`). The gradient is the one of
the tensors the op takes (the rotary embedding's: the (B, H, T, D) views q and k; whatever
copy a (B, T, H * D) projection's backward would make of it is not counted).
Bytes moved (GB/s, and its fraction of the copy bandwidth measured in the same run): the
rotary embedding reads q and k once and writes them once, and reads cos and sin once (both
ways); the gated forward reads gate and up and writes y, its backward reads gate, up and dy
and writes dgate and dup; GELU reads x (and dy) and writes y (dx).

Every implementation is first checked against fp64 (the torch formula on fp64 copies of the
inputs) on a small case of the same widths, outputs and gradients (relative error of the
norm); one that fails or raises is dropped from the timing, its error recorded. Liger's
kernels write in place (the rotary forward into q's and k's storage, its backward into dy, the
gated backward into the saved gate and up): each implementation gets tensors of its own, and
their repeats keep rewriting them, which changes no timing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import kbuild  # noqa: E402
from bench.harness import Case, measure_copy, run_cases, write_results  # noqa: E402
from kbuild.kernels.activations import op as act  # noqa: E402
from kbuild.kernels.rope import op as rope_ops  # noqa: E402

BF16 = torch.bfloat16
TOKENS = 8192
B, T = 4, 2048  # TOKENS as HF's training batches make them
HQ, HK, D = 32, 8, 128  # Llama-3-8B's heads and head_dim
ROPE_THETA = 500000.0
INTERMEDIATE = 14336  # Llama-3-8B's MLP
GELU_SHAPES = ((TOKENS, 3072), (TOKENS, 4 * 4096))  # GPT-2 124M's MLP, and a 4096-wide one
# The checks' small cases: the same widths, so the same kernels as the timed shapes
CHECK_B, CHECK_T, CHECK_M = 2, 16, 64
TOL = 2e-2  # relative error of the norm, bf16 storage
UNAVAILABLE: dict[str, str] = {}  # peers that did not import: name -> error

# ----------------------------------------------------------------------------- inputs
# Each takes a device: "meta" gives the tensors warmup_specs() and the CPU test read the
# kernels' specs from, laid out exactly as the CUDA ones.


def rope_tensors(batch: int, seq: int, device="cuda", requires_grad: bool = False) -> tuple:
    """(q, k, cos, sin): q (B, HQ, T, D) and k (B, HK, T, D) views of dense (B, T, H * D)
    projections, as HF's attention makes them; cos / sin (B, T, D) bf16, HF's rotate-half
    tables (cat(freqs, freqs)) of positions offset per batch."""

    def projection(heads):
        p = torch.randn(batch, seq, heads * D, device=device, dtype=BF16)
        p.requires_grad_(requires_grad)
        return p.view(batch, seq, heads, D).transpose(1, 2)

    q, k = projection(HQ), projection(HK)
    freqs = 1.0 / ROPE_THETA ** (torch.arange(0, D, 2, device=device).float() / D)
    positions = (
        torch.arange(seq, device=device).float()
        + 7 * torch.arange(batch, device=device)[:, None].float()
    )
    angles = positions[..., None] * freqs  # (B, T, D / 2)
    emb = torch.cat((angles, angles), -1)
    return q, k, emb.cos().to(BF16), emb.sin().to(BF16)


def gated_tensors(
    rows: int, width: int, fused: bool, device="cuda", requires_grad: bool = False
) -> tuple:
    """(gate, up) of (rows, width), or (gate_up,) of (rows, 2 width): one fused projection."""
    shapes = [(rows, 2 * width)] if fused else [(rows, width)] * 2
    return tuple(
        torch.randn(s, device=device, dtype=BF16).requires_grad_(requires_grad) for s in shapes
    )


def gelu_tensors(rows: int, width: int, device="cuda", requires_grad: bool = False) -> tuple:
    return (torch.randn(rows, width, device=device, dtype=BF16).requires_grad_(requires_grad),)


# ----------------------------------------------------------------------------- formulas


def rotate_half(x: torch.Tensor) -> torch.Tensor:  # HF's
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(q, k, cos, sin):
    """HF's apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _pair(inputs: tuple) -> tuple:
    """(gate, up) of (gate, up) or of (gate_up,) (its halves: HF's `chunk(2, -1)`)."""
    return tuple(inputs[0].chunk(2, -1)) if len(inputs) == 1 else inputs


def torch_swiglu(*inputs):
    gate, up = _pair(inputs)
    return F.silu(gate) * up


def torch_geglu(*inputs):
    gate, up = _pair(inputs)
    return F.gelu(gate, approximate="tanh") * up


def torch_gelu(x):
    return F.gelu(x, approximate="tanh")


# ----------------------------------------------------------------------------- peers


def _liger(name: str, load: Callable[[], Callable]) -> dict:
    try:
        return {"liger": load()}
    except Exception as err:  # not installed, or not runnable here
        UNAVAILABLE[name] = f"{type(err).__name__}: {err}"[:200]
        print(f"{name}: {UNAVAILABLE[name]}", flush=True)
        return {}


def _liger_rope():
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    return lambda q, k, cos, sin: tuple(liger_rotary_pos_emb(q, k, cos, sin)[:2])


def _liger_gated(family: str):
    if family == "swiglu":
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction as function
    else:
        from liger_kernel.ops.geglu import LigerGELUMulFunction as function
    return lambda *inputs: function.apply(*_pair(inputs))


def rope_impls() -> dict:
    return {
        "kbuild": lambda q, k, cos, sin: kbuild.rope(q, k, cos, sin),
        "torch": hf_rope,
        "torch.compile": torch.compile(hf_rope, dynamic=False),
        **_liger("liger rope", _liger_rope),
    }


def gated_impls(family: str) -> dict:
    ours = {"swiglu": kbuild.swiglu, "geglu": partial(kbuild.geglu, approximate="tanh")}[family]
    formula = {"swiglu": torch_swiglu, "geglu": torch_geglu}[family]
    return {
        "kbuild": lambda *inputs: ours(*inputs),  # (gate_up,): the fused form, up=None
        "torch": formula,
        "torch.compile": torch.compile(formula, dynamic=False),
        **_liger(f"liger {family}", partial(_liger_gated, family)),
    }


def gelu_impls() -> dict:
    return {
        "kbuild": lambda x: kbuild.gelu(x, approximate="tanh"),
        "torch": torch_gelu,
        "torch.compile": torch.compile(torch_gelu, dynamic=False),
    }


# ----------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Bench:
    """One op at one shape: `make(device, requires_grad)` its inputs at the timed size,
    `small` at the check's; the gradient taken for the first `n_grad` inputs; `reference`
    the formula run in fp64."""

    op: str
    shape: tuple[int, int]
    make: Callable[..., tuple]
    small: Callable[..., tuple]
    impls: Callable[[], dict]
    reference: Callable
    n_grad: int
    fwd_bytes: int
    bwd_bytes: int


def benches() -> list[Bench]:
    q_bytes, k_bytes, cs_bytes = (B * T * n * 2 for n in (HQ * D, HK * D, 2 * D))
    rope_bytes = 2 * (q_bytes + k_bytes) + cs_bytes
    out = [
        Bench("rope", (B * T, (HQ + HK) * D), partial(rope_tensors, B, T),
              partial(rope_tensors, CHECK_B, CHECK_T), rope_impls, hf_rope, 2, rope_bytes,
              rope_bytes),
    ]  # fmt: skip
    size = TOKENS * INTERMEDIATE * 2
    for family, formula in (("swiglu", torch_swiglu), ("geglu", torch_geglu)):
        for fused in (False, True):
            out.append(Bench(
                f"{family}{' fused' if fused else ''}",
                (TOKENS, INTERMEDIATE * (2 if fused else 1)),
                partial(gated_tensors, TOKENS, INTERMEDIATE, fused),
                partial(gated_tensors, CHECK_M, INTERMEDIATE, fused),
                partial(gated_impls, family), formula, 1 if fused else 2, 3 * size, 5 * size,
            ))  # fmt: skip
    for M, N in GELU_SHAPES:
        out.append(Bench("gelu", (M, N), partial(gelu_tensors, M, N),
                         partial(gelu_tensors, CHECK_M, N), gelu_impls, torch_gelu, 1,
                         2 * M * N * 2, 3 * M * N * 2))  # fmt: skip
    return out


def _tuple(x) -> tuple:
    return tuple(x) if isinstance(x, tuple | list) else (x,)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def check(bench: Bench, impls: dict, device="cuda") -> tuple[dict, dict]:
    """Each implementation's outputs and gradients on `bench.small` inputs against the
    formula in fp64 (computed first: Liger's kernels overwrite their inputs and dy); returns
    (errors, the implementations that pass)."""
    errors, kept = {}, {}
    for name, fn in impls.items():
        torch.manual_seed(1)
        inputs = bench.small(device, requires_grad=True)
        wrt = inputs[: bench.n_grad]
        inputs64 = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
        want = _tuple(bench.reference(*inputs64))
        try:
            outs = _tuple(fn(*inputs))
            dys = [torch.randn_like(o) for o in outs]
            want_grads = torch.autograd.grad(want, inputs64[: bench.n_grad],
                                             [d.double() for d in dys])  # fmt: skip
            grads = torch.autograd.grad(outs, wrt, dys)
            pairs = list(zip(outs, want, strict=True)) + list(zip(grads, want_grads, strict=True))
            worst = max(relative(g, w) for g, w in pairs)
        except Exception as err:
            errors[name] = f"{type(err).__name__}: {err}"[:200]
            print(f"check {bench.op:14} {name:14} {errors[name]}", flush=True)
            continue
        errors[name] = worst
        print(f"check {bench.op:14} {name:14} worst relative error {worst:.2e}", flush=True)
        if worst < TOL:  # NaN fails too
            kept[name] = fn
    return errors, kept


def _forward(fn, bench: Bench) -> Callable:
    return partial(fn, *bench.make())


def _backward(fn, bench: Bench) -> Callable:
    """The gradient of one forward's graph, replayed: dy laid out as fn's outputs are."""
    inputs = bench.make(requires_grad=True)
    outs = _tuple(fn(*inputs))
    dys = [torch.randn_like(o) for o in outs]
    return partial(torch.autograd.grad, outs, inputs[: bench.n_grad], dys, retain_graph=True)


def cases(bench: Bench, impls: dict) -> tuple[Case, Case]:
    """The forward and the backward case, each implementation on tensors of its own."""
    fwd = Case(f"{bench.op} fwd", bench.shape, bench.fwd_bytes, {})
    bwd = Case(f"{bench.op} bwd", bench.shape, bench.bwd_bytes, {})
    for name, fn in impls.items():
        for case, make in ((fwd, partial(_forward, fn)), (bwd, partial(_backward, fn))):
            try:
                case.impls[name] = make(bench)
            except Exception as err:  # torch.compile at this size, memory: recorded, not fatal
                case.results[name] = {"error": f"{type(err).__name__}: {err}"[:200]}
    return fwd, bwd


# ----------------------------------------------------------------------------- warming


def _meta_specs(op, *args) -> list:
    """The specs a launch of a kbuild.Op with these (meta) arguments asks for."""
    return [k.spec(*values) for k, values in op.kernel_values(*args)]


def warmup_specs() -> list:
    """What `kbuild warmup --module bench/bench_block.py` compiles: every kbuild kernel this
    script launches, timed shapes and checks' alike, by the ops' own spec helpers on meta
    tensors made as the CUDA ones are (rope.specs_for of the HF views; the gated ops' dense,
    fused and strided forms; GELU's kernel_values)."""
    specs = []
    for batch, seq in ((B, T), (CHECK_B, CHECK_T)):
        specs += rope_ops.specs_for(*rope_tensors(batch, seq, "meta"))
    specs += act.gated_specs("swiglu", INTERMEDIATE, BF16)
    specs += act.gated_specs("geglu", INTERMEDIATE, BF16, True)
    for rows in (TOKENS, CHECK_M):
        for _, N in GELU_SHAPES:
            (x,) = gelu_tensors(rows, N, "meta")
            specs += _meta_specs(act.GELU, x, True) + _meta_specs(act.GELU.backward, x, x, True)
    return list(dict.fromkeys(specs))


# ----------------------------------------------------------------------------- main


def main(path: str | None) -> None:
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # each formula: check, fwd, bwd, forms
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    torch.manual_seed(0)
    copy = measure_copy()
    done, errors = [], {}
    for bench in benches():
        label = f"{bench.op} {bench.shape[0]}x{bench.shape[1]}"
        errors[label], impls = check(bench, bench.impls())
        fwd, bwd = cases(bench, impls)
        done += run_cases([fwd], copy)
        done += run_cases([bwd], copy, device_time=True)
        fwd.impls, bwd.impls = {}, {}  # the tensors go before the next shape's
        torch.cuda.empty_cache()
    extra = {
        "shapes": {"tokens": TOKENS, "B": B, "T": T, "heads_q": HQ, "heads_k": HK,
                   "head_dim": D, "intermediate": INTERMEDIATE, "dtype": "bf16"},
        "check_errors": errors,
        "unavailable": UNAVAILABLE,
    }  # fmt: skip
    if path:
        write_results(path, done, copy, extra)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
