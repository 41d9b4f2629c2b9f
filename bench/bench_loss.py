"""Cross-entropy and the fused linear cross-entropy beside their peers, in one run on one GPU.

    kbuild warmup --arch sm_90 --module bench/bench_loss.py --cache-dir .kbuild-aot
    pip install --no-deps liger_kernel-0.8.5-py3-none-any.whl     # pure Python
    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/bench_loss.py [out.json]

Cross-entropy: forward + backward (the call as training makes it: `loss.backward()` of the
mean) at 8192 tokens x V, bf16 logits, against torch eager (F.cross_entropy), torch.compile
of it, Liger-Kernel's and quack's cross-entropy where they import. GB/s counts the physical
floor, one read of the logits and one write of their gradient (2 x M x V x 2 bytes), next to
the copy bandwidth of the same run. kbuild's long rows also run their launch-plan
alternatives (a row split over `cluster` blocks) beside the chooser's pick. Peak memory:
`max_memory_allocated` over one forward + backward, above what the inputs take.

Fused linear cross-entropy at a Llama-3-8B head (H 4096, V 128256; 8192 and 16384 tokens) and
a Gemma 2 head (H 2304, V 256000, soft cap 30): time of forward + backward and peak memory of
kbuild.linear_cross_entropy, the unfused path as Hugging Face runs it (logits, upcast to fp32,
F.cross_entropy) eager and compiled, and Liger's fused linear cross-entropy.

Every implementation is first checked against an fp64 reference on a small case (a fast
wrong one must not pass for a result); a peer that fails to import or run is recorded with
its error.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import kbuild  # noqa: E402
from bench.harness import Case, measure_copy, run_cases, write_results  # noqa: E402
from kbuild.kernels.cross_entropy import build_cross_entropy_fwd, vocab_specs  # noqa: E402

TOKENS = 8192
VOCABS = (32000, 50257, 128256, 151936, 256000)
CLUSTERS = (2, 4, 8)  # plan alternatives of the long rows' forward (V >= 32000)
HEADS = (  # (name, tokens, hidden, vocabulary, soft cap)
    ("llama3-8b head", 8192, 4096, 128256, None),
    ("llama3-8b head", 16384, 4096, 128256, None),
    ("gemma2 head", 8192, 2304, 256000, 30.0),
)


def variant_specs() -> list:
    return [
        build_cross_entropy_fwd.spec(N=V, dtype="bf16", index_dtype="i64", cluster=c)
        for V in VOCABS
        for c in CLUSTERS
    ]


def warmup_specs() -> list:
    """What `kbuild warmup --module bench/bench_loss.py` compiles: every cross-entropy
    kernel of these vocabularies in bf16 (and of the checks' small V), and the alternatives."""
    specs = [s for V in (*VOCABS, 1000) for s in vocab_specs(V, ("bf16",))]
    return list(dict.fromkeys(specs + variant_specs()))


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

        found["liger"] = lambda x, t: liger_cross_entropy(x, t)
    except Exception as err:  # not installed, or not runnable here
        print(f"liger: {type(err).__name__}: {err}", flush=True)
    try:
        from quack.cross_entropy import cross_entropy as quack_ce

        found["quack"] = lambda x, t: quack_ce(x, t).mean()
    except Exception as err:
        print(f"quack: {type(err).__name__}: {err}", flush=True)
    return found


def fused_peers(softcap) -> dict:
    """name -> fn(hidden, weight, target) of the linear cross-entropy implementations."""

    def unfused(h, w, t):  # Hugging Face's path: logits, fp32 upcast, cross-entropy
        x = F.linear(h, w).float()
        if softcap is not None:
            x = softcap * torch.tanh(x / softcap)
        return F.cross_entropy(x, t)

    found = {
        "kbuild": lambda h, w, t: kbuild.linear_cross_entropy(h, w, t, softcap=softcap),
        "torch": unfused,
        "torch.compile": torch.compile(unfused),
    }
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )

        liger = LigerFusedLinearCrossEntropyLoss(softcap=softcap)
        found["liger"] = lambda h, w, t: liger(w, h, t)
    except Exception as err:
        print(f"liger fused: {type(err).__name__}: {err}", flush=True)
    return found


# ----------------------------------------------------------------------------- checks


def check(impls: dict, make, reference) -> dict:
    """Each implementation's loss and gradients on a small case against fp64; a failing one
    is dropped from the timing (its error recorded)."""
    errors, kept = {}, {}
    for name, fn in impls.items():
        inputs = make()
        try:
            loss = fn(*inputs)
            grads = torch.autograd.grad(loss, [a for a in inputs if a.requires_grad])
        except Exception as err:
            errors[name] = f"{type(err).__name__}: {err}"[:200]
            continue
        want, want_grads = reference(*inputs)
        worst = abs(loss.double().item() - want.item()) / abs(want.item())
        for g, r in zip(grads, want_grads, strict=True):
            worst = max(worst, ((g.double() - r).norm() / r.norm()).item())
        errors[name] = worst
        print(f"check {name:14} worst relative error {worst:.2e}", flush=True)
        if worst < 2e-2:
            kept[name] = fn
    return errors, kept


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


def peak_mib(run, inputs) -> float:
    """Peak memory of one call above what was allocated before it (the inputs), MiB."""
    for a in inputs:
        a.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)


# ----------------------------------------------------------------------------- cases


def ce_cases() -> tuple[list[Case], dict]:
    def small():
        x = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16) * 4
        t = torch.randint(0, 1000, (64,), device="cuda")
        return x.requires_grad_(), t

    errors, impls = check(peers(), small, ce_reference)
    cases, memory = [], {}
    for V in VOCABS:
        x = (torch.randn(TOKENS, V, device="cuda", dtype=torch.bfloat16) * 4).requires_grad_()
        t = torch.randint(0, V, (TOKENS,), device="cuda")
        runs = {name: step(fn, (x, t)) for name, fn in impls.items()}
        memory[f"ce {V}"] = {name: peak_mib(run, (x,)) for name, run in runs.items()}
        for c in (None, *CLUSTERS):  # the training forward kernel alone, under each plan
            plan = {} if c is None else {"cluster": c}
            runs["fwd kernel " + (f"cluster {c}" if c else "chosen")] = forward_kernel(x, t, plan)
        cases.append(Case("cross_entropy fwd+bwd", (TOKENS, V), 2 * TOKENS * V * 2, runs))
    return cases, {"check_errors": errors, "peak_mib": memory}


def forward_kernel(x: torch.Tensor, t: torch.Tensor, plan: dict):
    """The cross-entropy forward kernel (training: it writes the gradient) launched alone on
    (M, V) logits under launch-plan overrides `plan` ({}: the chosen plan)."""
    from kbuild.ops.launch import rows_grid

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

    return run


def fused_cases() -> tuple[list[Case], dict]:
    cases, memory, errors = [], {}, {}
    for name, tokens, H, V, cap in HEADS:

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

        errors[name], impls = check(fused_peers(cap), small, reference)
        h = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
        w = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * H**-0.5).requires_grad_()
        t = torch.randint(0, V, (tokens,), device="cuda")
        runs = {n: step(fn, (h, w, t)) for n, fn in impls.items()}
        memory[f"{name} {tokens}"] = {n: peak_mib(run, (h, w)) for n, run in runs.items()}
        print(f"peak MiB {name} {tokens}: {memory[f'{name} {tokens}']}", flush=True)
        # bytes: the floor of the loss alone is moot here (matmuls dominate): hidden + weight
        # read, their gradients written; reported for scale, time is the figure
        nbytes = 2 * (tokens * H + V * H) * 2
        cases.append(Case(f"linear_cross_entropy {name}", (tokens, V), nbytes, runs))
    return cases, {"fused_check_errors": errors, "fused_peak_mib": memory}


def main(path: str | None) -> None:
    copy = measure_copy()
    ce, ce_extra = ce_cases()
    cases = run_cases(ce, copy)
    fused, fused_extra = fused_cases()
    cases += run_cases(fused, copy)
    if path:
        write_results(path, cases, copy, {**ce_extra, **fused_extra})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
