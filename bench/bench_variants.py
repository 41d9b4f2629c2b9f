"""The RMSNorm variants today's models need, beside plain RMSNorm in the same run (bf16, H200).

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/bench_variants.py [out.json]
        [--only PREFIX]

- Weight offset (Gemma: y = x_hat * (1 + w)): kbuild.rmsnorm(..., offset=1.0) against the
  plain kernel (the target: equal within noise) and torch eager / torch.compile of Gemma's
  formula, forward (inference) and backward (dx and dw, kernels' device time and calls back
  to back). Bytes: forward reads x and writes y; backward reads x and dy and writes dx.
- Liger 0.8.5 (Triton) beside them where its wheel is installed: its RMSNorm has the
  offset (casting_mode "gemma") and plain rows ("llama").
- QK-norm rows (RMSNorm over head_dim = 64, 128, 256 on millions of rows): kbuild.rmsnorm
  forward and backward against torch eager and torch.compile of F.rms_norm, on dense rows
  and on the q of a fused qkv projection (a strided (T, H, D) view, read in place).
- An fp32 residual stream: fused_add_rmsnorm with bf16 x and an fp32 residual (a later
  layer of a stack run with residual_in_fp32) against torch's same math, forward and
  backward. Bytes: forward reads x (2) and the residual (4), writes y (2) and the stream (4);
  backward reads the stream (4), dy (2) and d(stream) (4), writes dx (2) and d(residual) (4).
Shapes: BENCH_N (QK_N for the QK rows) at 64 Mi elements (L2-cold by size).
Default file: bench/results/<gpu>_variants_<date>.json (with --only qk:
<gpu>_variants_qk_<date>.json, as h200_variants_qk_2026-12-04.json).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kbuild  # noqa: E402
from bench.harness import (  # noqa: E402
    Case,
    add_event_of_copy,
    default_path,
    grad_fn,
    measure_copy,
    run_cases,
    write_results,
)
from kbuild.cases import BENCH_ELEMENTS, BENCH_N, QK_HEADS, QK_N, STREAM_BENCH_N  # noqa: E402


def _liger():
    """Liger's RMSNorm (Triton) where it is installed (bench/NOTES.md: the wheel travels to
    the GPU machine), else None: (x, w, offset, casting_mode) -> y, differentiable."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    # in_place=False: the timed backward is replayed (retain_graph), so dy must survive.
    return lambda x, w, offset, mode: LigerRMSNormFunction.apply(x, w, 1e-6, offset, mode, False)


def gemma_rmsnorm(x, w, eps=1e-6):
    """transformers' GemmaRMSNorm forward: fp32 math, (1 + w) in fp32, one rounding."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (y * (1.0 + w.float())).to(x.dtype)


def cases() -> tuple[list[Case], list[Case]]:
    torch._functorch.config.donated_buffer = False  # replayed backward graphs (retain_graph)
    compiled = torch.compile(gemma_rmsnorm)
    liger = _liger()
    forwards, backwards = [], []
    for N in BENCH_N:
        M = BENCH_ELEMENTS // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.rand(N, device="cuda") * 0.02 - 0.01).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        xi, wi = x.detach(), w.detach()
        elem = x.numel() * 2
        fwd = {
            "kbuild_plain": lambda xi=xi, wi=wi: kbuild.rmsnorm(xi, wi, 1e-6),
            "kbuild_offset": lambda xi=xi, wi=wi: kbuild.rmsnorm(xi, wi, 1e-6, offset=1.0),
            "eager": lambda xi=xi, wi=wi: gemma_rmsnorm(xi, wi),
            "compile": lambda xi=xi, wi=wi: compiled(xi, wi),
        }
        if liger is not None:  # Gemma's casting mode: fp32 math, 1 + w in fp32
            fwd["liger"] = lambda xi=xi, wi=wi: liger(xi, wi, 1.0, "gemma")
        forwards.append(Case("rmsnorm_offset_fwd", (M, N), 2 * elem, fwd))
        offset = lambda x, w: kbuild.rmsnorm(x, w, 1e-6, offset=1.0)  # noqa: E731
        bwd = {
            "kbuild_plain": grad_fn(kbuild.rmsnorm, (x, w), [x, w], [dy]),
            "kbuild_offset": grad_fn(offset, (x, w), [x, w], [dy]),
            "eager": grad_fn(gemma_rmsnorm, (x, w), [x, w], [dy]),
            "compile": grad_fn(compiled, (x, w), [x, w], [dy]),
        }
        if liger is not None:
            bwd["liger"] = grad_fn(lambda x, w: liger(x, w, 1.0, "gemma"), (x, w), [x, w], [dy])
        backwards.append(Case("rmsnorm_offset_bwd", (M, N), 3 * elem, bwd))
    compiled_rms = torch.compile(F.rms_norm)
    for N in QK_N:
        M = BENCH_ELEMENTS // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        xi, wi = x.detach(), w.detach()
        elem = x.numel() * 2
        fwd = {
            "kbuild": lambda xi=xi, wi=wi: kbuild.rmsnorm(xi, wi, 1e-6),
            "eager": lambda xi=xi, wi=wi, N=N: F.rms_norm(xi, (N,), wi, 1e-6),
            "compile": lambda xi=xi, wi=wi, N=N: compiled_rms(xi, (N,), wi, 1e-6),
        }
        if liger is not None:
            fwd["liger"] = lambda xi=xi, wi=wi: liger(xi, wi, 0.0, "llama")
        forwards.append(Case("qk_rmsnorm_fwd", (M, N), 2 * elem, fwd))
        bwd = {
            "kbuild": grad_fn(kbuild.rmsnorm, (x, w), [x, w], [dy]),
            "eager": grad_fn(F.rms_norm, (x, (N,), w, 1e-6), [x, w], [dy]),
            "compile": grad_fn(compiled_rms, (x, (N,), w, 1e-6), [x, w], [dy]),
        }
        if liger is not None:
            bwd["liger"] = grad_fn(lambda x, w: liger(x, w, 0.0, "llama"), (x, w), [x, w], [dy])
        backwards.append(Case("qk_rmsnorm_bwd", (M, N), 3 * elem, bwd))
        # The same rows as the q of a fused qkv projection: a (B, T, H, D) view, read in
        # place by kbuild; "kbuild_copy" is the call with the copy kbuild made before.
        tokens = M // QK_HEADS
        qkv = torch.randn(tokens, 3 * QK_HEADS * N, device="cuda", dtype=torch.bfloat16)
        qkv.requires_grad_()
        q = qkv.view(tokens, 3, QK_HEADS, N)[:, 0]
        qi, dq = q.detach(), dy.view(tokens, QK_HEADS, N)
        fwd = {
            "kbuild": lambda qi=qi, wi=wi: kbuild.rmsnorm(qi, wi, 1e-6),
            "kbuild_copy": lambda qi=qi, wi=wi: kbuild.rmsnorm(qi.contiguous(), wi, 1e-6),
            "eager": lambda qi=qi, wi=wi, N=N: F.rms_norm(qi, (N,), wi, 1e-6),
            "compile": lambda qi=qi, wi=wi, N=N: compiled_rms(qi, (N,), wi, 1e-6),
        }
        forwards.append(Case("qk_view_rmsnorm_fwd", (M, N), 2 * elem, fwd))
        bwd = {
            "kbuild": grad_fn(kbuild.rmsnorm, (q, w), [q, w], [dq]),
            "eager": grad_fn(F.rms_norm, (q, (N,), w, 1e-6), [q, w], [dq]),
            "compile": grad_fn(compiled_rms, (q, (N,), w, 1e-6), [q, w], [dq]),
        }
        backwards.append(Case("qk_view_rmsnorm_bwd", (M, N), 3 * elem, bwd))

    def torch_stream(x, r, w):
        s = r + x.float()
        return (F.rms_norm(s, (s.shape[-1],), eps=1e-6) * w).to(x.dtype), s

    compiled_stream = torch.compile(torch_stream)
    for N in STREAM_BENCH_N:
        M = BENCH_ELEMENTS // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        r = torch.randn(M, N, device="cuda", dtype=torch.float32, requires_grad=True)
        w = torch.randn(N, device="cuda", dtype=torch.float32, requires_grad=True)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        ds = torch.randn(M, N, device="cuda", dtype=torch.float32)
        xi, ri, wi = x.detach(), r.detach(), w.detach()
        fwd = {
            "kbuild": lambda xi=xi, ri=ri, wi=wi: kbuild.fused_add_rmsnorm(xi, ri, wi, 1e-6),
            "eager": lambda xi=xi, ri=ri, wi=wi: torch_stream(xi, ri, wi),
            "compile": lambda xi=xi, ri=ri, wi=wi: compiled_stream(xi, ri, wi),
        }
        forwards.append(Case("fp32_stream_fwd", (M, N), 12 * M * N, fwd))
        bwd = {
            "kbuild": grad_fn(
                lambda x, r, w: kbuild.fused_add_rmsnorm(x, r, w, 1e-6),
                (x, r, w),
                [x, r, w],
                [dy, ds],
            ),
            "eager": grad_fn(torch_stream, (x, r, w), [x, r, w], [dy, ds]),
            "compile": grad_fn(compiled_stream, (x, r, w), [x, r, w], [dy, ds]),
        }
        backwards.append(Case("fp32_stream_bwd", (M, N), 16 * M * N, bwd))
    return forwards, backwards


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", nargs="?", help="results JSON (default: see above)")
    parser.add_argument("--only", default="", help="the cases whose name starts with this (qk)")
    args = parser.parse_args()
    only = args.only
    path = args.out or default_path(f"{{gpu}}_variants{'_' + only if only else ''}_{{date}}.json")
    copy = measure_copy()
    forwards, backwards = cases()
    forwards = [c for c in forwards if c.op.startswith(only)]
    backwards = [c for c in backwards if c.op.startswith(only)]
    run_cases(forwards, copy)
    add_event_of_copy(run_cases(backwards, copy, device_time=True), copy)
    write_results(path, forwards + backwards, copy)


if __name__ == "__main__":
    main()
