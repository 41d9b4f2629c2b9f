"""Cross-entropy and the fused linear cross-entropy beside their peers, in one run on one GPU.

    kbuild warmup --arch sm_90 --module bench/bench_loss.py --cache-dir .kbuild-aot
    pip install --no-deps liger_kernel-0.8.5-py3-none-any.whl     # pure Python
    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/bench_loss.py [out.json]
        [--parts ce,fused] [--heads "gemma2 head,..."] [--chunks 256,512,1024,2048,4096]
        [--skip torch.compile]

Cross-entropy: forward + backward (the call as training makes it: `loss.backward()` of the
mean) at 8192 tokens x V, bf16 logits, against torch eager (F.cross_entropy), torch.compile
of it, Liger-Kernel's and quack's cross-entropy where they import. GB/s counts the physical
floor, one read of the logits and one write of their gradient (2 x M x V x 2 bytes), next to
the copy bandwidth of the same run. kbuild's forward kernel alone (the chooser's plan) is
timed beside them; bench/bench_ce_clusters.py times its launch-plan alternatives. Peak memory:
`max_memory_allocated` over one forward + backward, above what the inputs take.

Liger writes the gradient over the logits it is given (its forward stores d(logits) in the
input tensor): it gets a copy of its own, restored from the shared logits before each timed
call outside the timing (harness `prepare`); its check computes the reference before the call.
On 2026-12-07 (7cc59e8) the check computed the reference after the call, from logits Liger
had overwritten (relative error 1.05), and Liger's row was dropped; had it passed, every peer
timed after it would have read Liger's gradient in place of the logits.

Fused linear cross-entropy at a Llama-3-8B head (H 4096, V 128256; 8192 and 16384 tokens), a
Gemma 2 head (H 2304, V 256000, soft cap 30) and the other heads of bench/patch_models.py's
models (Qwen3-1.7B, Gemma-3-1B, GPT-2; 8192 tokens): time of forward + backward and peak
memory of kbuild.linear_cross_entropy, the unfused path as Hugging Face runs it (logits,
upcast to fp32, F.cross_entropy) eager and compiled, and Liger's fused linear cross-entropy.
`--chunks` times kbuild at other rows per chunk beside the chosen one (`chunk_rows`): the
measurements its rule comes from. At a vocabulary not a multiple of 8 (GPT-2's), "kbuild rows
not padded" is kbuild with its chunks' logits rows V wide (the layout before 2026-12-07's
a62b6b8), and "torch V padded" the unfused path with the weight padded to 64 rows more: what
an odd row stride costs cuBLAS. `--heads gpt2,gemma2` names heads without " head" too.

Every implementation is first checked against an fp64 reference on a small case (a fast
wrong one must not pass for a result); a peer that fails to import or run is recorded with
its error, and one that changes its inputs is named ("inputs_overwritten").

Memory (80 GB cards): each case's tensors are made, timed and freed before the next, so the
peak is the largest case's. Expected, one case alive at a time: the cross-entropy part about
24 GiB at V = 256000 (the logits, Liger's copy, the lone kernel's gradient and the gradient,
4.2 GB each, plus torch eager's log-softmax and its gradient); the fused part about 33 GiB,
the unfused eager path at the Gemma 2 head (fp32 logits, the soft cap's tanh, log-softmax and
their gradients, 8.4 GB each). Measured on an H100 on 2026-12-07 (c5da4c6): 23.6 and 32.5 GiB
allocated (bench/results/loss_h100_2026-12-07.json, `case_peak_gib`). Before, the fused part
ran out of memory at 73 GiB allocated: every cross-entropy case's tensors were still alive.
The run prints each case's peak.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import kbuild  # noqa: E402
from bench.harness import Case, measure_copy, run_cases, write_results  # noqa: E402
from kbuild.kernels.loss import linear as linear_loss  # noqa: E402
from kbuild.kernels.loss.kernels import build_cross_entropy_fwd, vocab_specs  # noqa: E402

TOKENS = 8192
VOCABS = (32000, 50257, 128256, 151936, 256000)
HEADS = (  # (name, tokens, hidden, vocabulary, soft cap)
    ("llama3-8b head", 8192, 4096, 128256, None),
    ("llama3-8b head", 16384, 4096, 128256, None),
    ("gemma2 head", 8192, 2304, 256000, 30.0),
    # the other heads of bench/patch_models.py's models, at their 8192 tokens a step
    ("qwen3-1.7b head", 8192, 2048, 151936, None),
    ("gemma3-1b head", 8192, 1152, 262144, None),
    ("gpt2 head", 8192, 768, 50257, None),
)
CHUNKS = (256, 512, 1024, 2048, 4096)  # `--chunks`: kbuild's rows per chunk, timed beside


def warmup_specs() -> list:
    """What `kbuild warmup --module bench/bench_loss.py` compiles: every cross-entropy
    kernel of these vocabularies and of the heads' in bf16 (and of the checks' small V)."""
    vocabs = (*VOCABS, *(head[3] for head in HEADS), 1000)
    return list(dict.fromkeys(s for V in vocabs for s in vocab_specs(V, ("bf16",))))


# ----------------------------------------------------------------------------- peers


def peers() -> dict:
    """The cross-entropy implementations that import here: name -> fn(logits, target)."""
    found = {
        "kbuild": lambda x, t: kbuild.cross_entropy(x, t),
        "torch": lambda x, t: F.cross_entropy(x, t),
        "torch.compile": torch.compile(lambda x, t: F.cross_entropy(x, t)),
    }
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy

        found["liger"] = overwrites_logits(lambda x, t: liger_cross_entropy(x, t))
    except Exception as err:  # not installed, or not runnable here
        print(f"liger: {type(err).__name__}: {err}", flush=True)
    try:
        from quack.cross_entropy import cross_entropy as quack_ce

        found["quack"] = lambda x, t: quack_ce(x, t).mean()
    except Exception as err:
        print(f"quack: {type(err).__name__}: {err}", flush=True)
    return found


def fused_peers(softcap, chunks=(), vocab=None) -> dict:
    """name -> fn(hidden, weight, target) of the linear cross-entropy implementations; kbuild
    also at each of `chunks` rows per chunk ("kbuild chunk=R") beside its chosen chunk. Where
    `vocab` is not a multiple of 64, "torch V padded" is the unfused path with the weight's
    rows padded to one (zeros, sliced off the logits), as nanoGPT pads GPT-2's 50257: what
    the logits' odd row stride costs cuBLAS."""

    def unfused(h, w, t, pad=0):  # Hugging Face's path: logits, fp32 upcast, cross-entropy
        x = F.linear(h, F.pad(w, (0, 0, 0, pad)) if pad else w)
        x = (x[:, : w.shape[0]] if pad else x).float()
        if softcap is not None:
            x = softcap * torch.tanh(x / softcap)
        return F.cross_entropy(x, t)

    found = {
        "kbuild": lambda h, w, t: kbuild.linear_cross_entropy(h, w, t, softcap=softcap),
        **{
            f"kbuild chunk={rows}": lambda h, w, t, rows=rows: kbuild.linear_cross_entropy(
                h, w, t, softcap=softcap, chunk_size=rows
            )
            for rows in chunks
        },
        "torch": unfused,
        "torch.compile": torch.compile(unfused),
    }
    if vocab is not None and vocab % 64:
        found["torch V padded"] = lambda h, w, t: unfused(h, w, t, pad=-vocab % 64)
    if vocab is not None and vocab % linear_loss.ROW_ALIGN:
        found["kbuild rows not padded"] = _rows_not_padded(found["kbuild"])
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )

        liger = LigerFusedLinearCrossEntropyLoss(softcap=softcap)
        found["liger"] = lambda h, w, t: liger(w, h, t)
    except Exception as err:
        print(f"liger fused: {type(err).__name__}: {err}", flush=True)
    return found


def _rows_not_padded(fn):
    """kbuild's fused loss `fn` with its chunks' logits rows V wide, not padded to a multiple
    of ROW_ALIGN columns (kernels/loss/linear.py `_logits_buffer`): what the padding saves."""

    def run(*args):
        was, linear_loss.ROW_ALIGN = linear_loss.ROW_ALIGN, 1
        try:
            return fn(*args)  # (a mean's gradients are computed here, in the forward)
        finally:
            linear_loss.ROW_ALIGN = was

    return run


def overwrites_logits(fn):
    """Mark a cross-entropy `fn` that writes the gradient over the logits it is given."""
    fn.overwrites_logits = True
    return fn


def free() -> None:
    """Give the last case's memory back before the next case allocates."""
    gc.collect()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- checks


def check(impls: dict, make, reference) -> tuple[dict, dict, list]:
    """Each implementation's loss and gradients on a small case against fp64, the reference
    taken before the call (an implementation may overwrite its inputs); a failing one is
    dropped from the timing (its error recorded). Returns the errors, the kept
    implementations and the names of those that changed their inputs."""
    errors, kept, overwrote = {}, {}, []
    for name, fn in impls.items():
        inputs = make()
        want, want_grads = reference(*inputs)
        before = [a.detach().clone() for a in inputs]
        try:
            loss = fn(*inputs)
            grads = torch.autograd.grad(loss, [a for a in inputs if a.requires_grad])
        except Exception as err:
            errors[name] = f"{type(err).__name__}: {err}"[:200]
            continue
        if any(not torch.equal(a.detach(), b) for a, b in zip(inputs, before, strict=True)):
            overwrote.append(name)
            print(f"check {name:14} changed its inputs", flush=True)
        worst = abs(loss.double().item() - want.item()) / abs(want.item())
        for g, r in zip(grads, want_grads, strict=True):
            worst = max(worst, ((g.double() - r).norm() / r.norm()).item())
        errors[name] = worst
        print(f"check {name:14} worst relative error {worst:.2e}", flush=True)
        if worst < 2e-2:
            kept[name] = fn
    return errors, kept, overwrote


def ce_reference(x, t):
    xd = x.detach().double().requires_grad_()
    loss = F.cross_entropy(xd, t)
    return loss, torch.autograd.grad(loss, [xd])


def step(fn, inputs):
    """One forward + backward as training calls it."""
    trainable = [a for a in inputs if a.requires_grad]

    def run():
        for a in trainable:
            a.grad = None
        fn(*inputs).backward()

    return run


def own_logits_step(fn, x: torch.Tensor, t: torch.Tensor, scratch: torch.Tensor):
    """`step` of a cross-entropy that overwrites its logits, on a copy of `x` of its own;
    its `prepare` (run before each timed call, untimed) copies `x` back, then reads a 128 MB
    `scratch` so that the copy's last lines leave L2 (written back) as they would before
    logits fresh from a matmul are read."""
    own = x.detach().clone().requires_grad_()
    run = step(fn, (own, t))

    def prepare():
        own.detach().copy_(x)
        scratch.sum()

    run.prepare = prepare
    run.inputs = (own,)
    return run


def peak_mib(run, inputs) -> float:
    """Peak memory of one call above what was allocated before it (the inputs), MiB."""
    inputs = getattr(run, "inputs", inputs)
    for a in inputs:
        a.grad = None
    if hasattr(run, "prepare"):
        run.prepare()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)


# ----------------------------------------------------------------------------- cases


def run_case(case: Case, copy: float, peaks: dict, device_too: bool = False) -> Case:
    """Time one case, record its peak memory (GiB, everything allocated) and free it;
    `device_too`: its kernels' GPU time beside the call's (harness.run_cases)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    run_cases([case], copy, device_too=device_too)
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    peaks[f"{case.op} {case.shape}"] = peak
    print(f"  peak {peak} GiB allocated", flush=True)
    case.impls = {}
    return case


def ce_cases(copy: float) -> tuple[list[Case], dict]:
    def small():
        x = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16) * 4
        t = torch.randint(0, 1000, (64,), device="cuda")
        return x.requires_grad_(), t

    errors, impls, overwrote = check(peers(), small, ce_reference)
    cases, memory, peaks = [], {}, {}
    scratch = torch.empty(64 << 20, device="cuda", dtype=torch.bfloat16).normal_()
    for V in VOCABS:
        x = (torch.randn(TOKENS, V, device="cuda", dtype=torch.bfloat16) * 4).requires_grad_()
        t = torch.randint(0, V, (TOKENS,), device="cuda")
        runs = {
            name: own_logits_step(fn, x, t, scratch)
            if getattr(fn, "overwrites_logits", False)
            else step(fn, (x, t))
            for name, fn in impls.items()
        }
        memory[f"ce {V}"] = {name: peak_mib(run, (x,)) for name, run in runs.items()}
        runs["fwd kernel chosen"] = forward_kernel(x, t)[0]  # the training forward kernel alone
        case = Case("cross_entropy fwd+bwd", (TOKENS, V), 2 * TOKENS * V * 2, runs)
        cases.append(run_case(case, copy, peaks, device_too=True))  # host-bound, or not
        del x, t, runs, case
        free()
    del scratch
    free()
    extra = {"check_errors": errors, "inputs_overwritten": overwrote, "peak_mib": memory}
    return cases, {**extra, "case_peak_gib": peaks}


def forward_kernel(x: torch.Tensor, t: torch.Tensor, plan: dict | None = None):
    """The cross-entropy forward kernel (training: it writes the gradient, scaled for a
    mean) launched alone on (M, V) bf16 logits and i64 ids under launch-plan overrides
    `plan` (None: the chosen plan); returns the call and its (loss, gradient) outputs."""
    from kbuild.op.launch import rows_grid

    plan = plan or {}

    M, V = x.shape
    x = x.detach()
    loss = torch.empty(M, device="cuda")
    lse, flag = torch.empty_like(loss), torch.zeros(1, dtype=torch.int32, device="cuda")
    coefs = torch.tensor([1 / M, 0, 0, 0], device="cuda")
    d = torch.empty_like(x)
    args = (x, t, coefs, loss, lse, d, flag, M, -100)

    def run():
        kbuild.launch(build_cross_entropy_fwd, lambda launcher: rows_grid(launcher, M), *args,
                      N=V, dtype="bf16", index_dtype="i64", **plan)  # fmt: skip

    return run, loss, d


def fused_cases(copy: float, heads=HEADS, chunks=(), skip=()) -> tuple[list[Case], dict]:
    """The fused heads: every peer, and kbuild at each of `chunks` rows per chunk."""
    from kbuild.kernels.loss.linear import chunk_rows

    cases, memory, errors, overwrote, peaks, chosen = [], {}, {}, {}, {}, {}
    for name, tokens, H, V, cap in heads:
        chosen[f"{name} {tokens}"] = rows_chosen = chunk_rows(tokens, V, H)

        def small(H=H, V=V):
            h = torch.randn(256, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
            w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * H**-0.5
            t = torch.randint(0, V, (256,), device="cuda")
            return h, w.requires_grad_(), t

        def reference(h, w, t, cap=cap):
            hd, wd = (a.detach().double().requires_grad_() for a in (h, w))
            x = F.linear(hd, wd)
            x = x if cap is None else cap * torch.tanh(x / cap)
            loss = F.cross_entropy(x, t)
            return loss, torch.autograd.grad(loss, [hd, wd])

        sweep = [rows for rows in chunks if rows < tokens and rows != rows_chosen]
        found = {k: f for k, f in fused_peers(cap, sweep, V).items() if k not in skip}
        errors[name], impls, overwrote[name] = check(found, small, reference)
        h = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
        w = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * H**-0.5).requires_grad_()
        t = torch.randint(0, V, (tokens,), device="cuda")
        runs = {n: step(fn, (h, w, t)) for n, fn in impls.items()}
        memory[f"{name} {tokens}"] = {n: peak_mib(run, (h, w)) for n, run in runs.items()}
        print(f"peak MiB {name} {tokens}: {memory[f'{name} {tokens}']}", flush=True)
        # bytes: the floor of the loss alone is moot here (matmuls dominate): hidden + weight
        # read, their gradients written; reported for scale, time is the figure
        nbytes = 2 * (tokens * H + V * H) * 2
        case = Case(f"linear_cross_entropy {name}", (tokens, V), nbytes, runs)
        cases.append(run_case(case, copy, peaks))
        del h, w, t, runs, impls, case
        free()
    extra = {"fused_check_errors": errors, "fused_inputs_overwritten": overwrote}
    extra["fused_chunk_rows_chosen"] = chosen
    return cases, {**extra, "fused_peak_mib": memory, "fused_case_peak_gib": peaks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", help="results JSON")
    p.add_argument("--parts", default="ce,fused", help="ce, fused or both (default)")
    p.add_argument("--heads", default="", help="comma-separated head names (default: all)")
    p.add_argument("--skip", default="", help="comma-separated peers not to run (torch.compile)")
    p.add_argument("--chunks", default="", help=f"kbuild rows per chunk to time beside "
                   f"the chosen one, e.g. {','.join(map(str, CHUNKS))}")  # fmt: skip
    a = p.parse_args()
    parts = set(a.parts.split(","))
    if not parts or parts - {"ce", "fused"}:
        p.error(f"--parts takes ce and/or fused; got {a.parts!r}")
    named = a.heads.split(",")  # "gpt2 head" or "gpt2"
    heads = [h for h in HEADS if not a.heads or {h[0], h[0].removesuffix(" head")} & set(named)]
    chunks = [int(c) for c in a.chunks.split(",") if c]
    copy = measure_copy()
    cases, extra = [], {}
    if "ce" in parts:
        found, more = ce_cases(copy)
        cases, extra = cases + found, {**extra, **more}
    if "fused" in parts:
        found, more = fused_cases(copy, heads, chunks, a.skip.split(","))
        cases, extra = cases + found, {**extra, **more}
    peaks = {**extra.get("case_peak_gib", {}), **extra.get("fused_case_peak_gib", {})}
    print(f"largest case peak: {max(peaks.values(), default=0)} GiB allocated", flush=True)
    if a.out:
        write_results(a.out, cases, copy, extra)


if __name__ == "__main__":
    main()
