"""GPT-2's encoder and the bias gradient: kbuild vs torch, bf16, copy bandwidth in the same run.

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/bench_llmc.py [out.json]

Shapes: C in BENCH_C, T = 1024, B = 64 Mi / (T * C) (L2-cold by size), V = 50257, int64 ids
with a frequent id (a third of the positions, as text has), so the backward's long runs show.
- encoder_fwd: kbuild.encoder against `wte[tokens] + wpe[:T]`; bytes: the ids, the M gathered
  wte rows, wpe's T rows, and the output.
- encoder_bwd: torch.autograd.grad of both (calls back to back; device time by the profiler
  too) and torch with `torch.use_deterministic_algorithms(True)`; bytes: dout and the ids
  read, dwte (V rows) and dwpe written.
- bias_grad: kbuild.bias_grad against `dout.sum(0)` on (M, OC) = 64 Mi elements; bytes: dout
  read once (the target is read bandwidth), dbias written.
Default file: bench/results/<gpu>_llmc_<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

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
from kbuild.cases import BENCH_C, BENCH_ELEMENTS  # noqa: E402

V, T = 50257, 1024


@contextlib.contextmanager
def deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def torch_encoder(tokens, wte, wpe):
    return wte[tokens] + wpe[: tokens.shape[1]]


def cases() -> list[Case]:
    out = []
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for C in BENCH_C:
        B = BENCH_ELEMENTS // (T * C)
        M = B * T
        tokens = torch.randint(0, V, (B, T), device="cuda")
        tokens = torch.where(torch.rand(B, T, device="cuda") < 0.33, 7, tokens)
        wte = torch.randn(V, C, **bf, requires_grad=True)
        wpe = torch.randn(T, C, **bf, requires_grad=True)
        dout = torch.randn(B, T, C, **bf)
        we, pe = wte.detach(), wpe.detach()
        fwd_bytes = M * 8 + 2 * (2 * M * C + T * C)
        out.append(Case("encoder_fwd", (M, C), fwd_bytes, {
            "kbuild": lambda we=we, pe=pe, t=tokens: kbuild.encoder(t, we, pe),
            "eager": lambda we=we, pe=pe, t=tokens: torch_encoder(t, we, pe),
        }))  # fmt: skip
        kb = grad_fn(kbuild.encoder, (tokens, wte, wpe), [wte, wpe], [dout])
        eager = grad_fn(torch_encoder, (tokens, wte, wpe), [wte, wpe], [dout])

        def eager_det(eager=eager):
            with deterministic():
                return eager()

        bwd_bytes = M * 8 + 2 * (M * C + V * C + T * C)
        out.append(Case("encoder_bwd", (M, C), bwd_bytes, {
            "kbuild": kb, "eager": eager, "eager_deterministic": eager_det,
        }))  # fmt: skip
        rows = BENCH_ELEMENTS // C
        d = torch.randn(rows, C, **bf)
        out.append(Case("bias_grad", (rows, C), 2 * (rows * C + C), {
            "kbuild": lambda d=d: kbuild.bias_grad(d),
            "eager": lambda d=d: d.sum(0),
        }))  # fmt: skip
        del dout
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", nargs="?", help="results JSON (default: see above)")
    path = parser.parse_args().out or default_path("{gpu}_llmc_{date}.json")
    copy = measure_copy()
    done = run_cases(cases(), copy, device_time=True)
    add_event_of_copy(done, copy)
    write_results(path, done, copy)


if __name__ == "__main__":
    main()
