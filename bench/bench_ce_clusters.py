"""Cross-entropy launch plans: the training forward kernel and forward + backward as users call
it (`kbuild.cross_entropy(x, t).backward()`), under every cluster size the plan accepts, at
8192 rows of bf16 logits, beside the chooser's own pick and the copy bandwidth of the same run.

    kbuild warmup --arch sm_90 --module bench/bench_ce_clusters.py --cache-dir .kbuild-aot
    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/bench_ce_clusters.py OUT.json \
        [--rows 1024] [--vocabs 128256,151936]

A cluster of c splits each row over c blocks (`cluster=` is the builder keyword naming that
plan field: plan/rows.py, `override_keywords`); 1 is one block per row, walking the row
in chunks where it does not fit in registers. Sizes 1 to the target's portable limit (8 on
sm_90) that the plan refuses at a V (slices not a whole number of vectors) are left out.

Forward + backward goes through the public function and autograd (the forward kernel writes
the gradient, the backward's rescale skips rows whose incoming gradient is the one assumed),
with the forward launch's plan forced by wrapping kbuild.kernels.loss.cross_entropy's launch for the
time of the call: nothing of the chooser changes. Every variant is first checked against an fp32
reference of the loss per row and of the whole gradient (the gradient buffer poisoned with
NaN first), and timed in ROUNDS interleaved rounds (CUDA events around back-to-back calls,
median of 50; each round's median kept, so the spread between rounds shows). The
forward + backward is also timed one call at a time (triton's do_bench, L2 flushed). Bytes:
the floor, one read of the logits and one write of their gradient, 2 x M x V x 2. Logits of
512 MB to 4.3 GB are L2-cold by size.

Memory: one V at a time; at 262144 the logits, their gradient, the lone kernel's gradient
(4.3 GB each) and the fp32 reference gradient (8.6 GB): about 22 GiB.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import kbuild  # noqa: E402
import kbuild.kernels.loss.cross_entropy as loss_op  # noqa: E402
from bench.bench_loss import forward_kernel  # noqa: E402
from bench.harness import commit, measure_copy  # noqa: E402
from kbuild.kernels.loss.kernels import (  # noqa: E402
    build_cross_entropy_fwd,
    build_cross_entropy_rescale,
)
from kbuild.plan.config import CHUNK_ITERS, RowBudget  # noqa: E402
from kbuild.plan.rows import ONLINE_WORDS, plan_rows  # noqa: E402
from kbuild.targets import target_for_arch  # noqa: E402
from kbuild.timing import median_ms  # noqa: E402

TOKENS = 8192
VOCABS = (32000, 32768, 50257, 128256, 151936, 256000, 262144)
ROUNDS = 3
ARCH = "sm_90"


# ----------------------------------------------------------------------------- plans


def plan(V: int, cluster: int | None = None):
    """The forward's plan at V in bf16 on ARCH, as row_kernel makes it (cross_entropy_fwd:
    rows_held ONLINE_WORDS, the default chunk), the chooser's where `cluster` is None."""
    budget = RowBudget(words_per_elem=ONLINE_WORDS["bf16"], chunk_iters=CHUNK_ITERS)
    forced = {} if cluster is None else {"cluster": cluster}
    target = target_for_arch(ARCH)
    return plan_rows(V, "bf16", target, budget=budget, persistent=False, **forced)


def clusters(V: int) -> list[int]:
    """Every cluster size the plan accepts at V on ARCH."""
    accepted = []
    for c in range(1, target_for_arch(ARCH).max_cluster + 1):
        try:
            plan(V, c)
        except ValueError:
            continue
        accepted.append(c)
    return accepted


def variants(V: int) -> list[tuple[str, dict]]:
    """(name, plan keywords): the chooser's pick, then each cluster size."""
    return [("chosen", {})] + [(f"cluster {c}", {"cluster": c}) for c in clusters(V)]


def describe(V: int, keywords: dict) -> dict:
    row = plan(V, keywords.get("cluster")).row
    return {"cluster": row.cluster, "threads_per_row": row.threads_per_row, "iters": row.iters,
            "vec": row.vec, "chunked": row.chunked}  # fmt: skip


def warmup_specs() -> list:
    """What `kbuild warmup --module bench/bench_ce_clusters.py` compiles: the forward kernel
    kbuild.cross_entropy launches on bf16 logits and int64 targets (training, no options)
    under each variant, and the backward's rescale, at every V."""
    specs = []
    for V in VOCABS:
        for _, keywords in variants(V):
            specs.append(build_cross_entropy_fwd.spec(**forward_values(V), **keywords))
        specs.append(build_cross_entropy_rescale.spec(N=V, dtype="bf16", vectorize=True))
    return list(dict.fromkeys(specs))


def forward_values(V: int) -> dict:
    """The forward's table values of kbuild.cross_entropy on aligned bf16 logits, i64 ids."""
    return loss_op.fwd_values(V, torch.bfloat16, torch.int64, False, False, True, True)


# ----------------------------------------------------------------------------- runs


@contextlib.contextmanager
def forced_plan(keywords: dict, calls: list):
    """kbuild.kernels.loss.cross_entropy launches its forward kernel with the plan keywords added
    (counted in `calls`); other kernels as they are."""
    launch = loss_op.launch_kernel

    def forced(definition, grid, *args, **params):
        if definition is build_cross_entropy_fwd and keywords:
            params = {**params, **keywords}
            calls.append(1)
        return launch(definition, grid, *args, **params)

    loss_op.launch_kernel = forced
    try:
        yield
    finally:
        loss_op.launch_kernel = launch


def user_step(x: torch.Tensor, t: torch.Tensor, keywords: dict, calls: list):
    """One `kbuild.cross_entropy(x, t).backward()` under the forward plan `keywords`."""

    def run():
        x.grad = None
        with forced_plan(keywords, calls):
            kbuild.cross_entropy(x, t).backward()

    return run


def reference(x: torch.Tensor, t: torch.Tensor, rows: int = 512):
    """fp32 loss per row and gradient of the mean, in row chunks."""
    M = x.shape[0]
    loss = torch.empty(M, device="cuda")
    grad = torch.empty(x.shape, device="cuda")
    for s in range(0, M, rows):
        xc = x[s : s + rows].detach().float()
        lse = torch.logsumexp(xc, dim=1)
        tc = t[s : s + rows]
        loss[s : s + rows] = lse - xc.gather(1, tc[:, None])[:, 0]
        g = torch.exp(xc - lse[:, None])
        g[torch.arange(g.shape[0], device="cuda"), tc] -= 1
        grad[s : s + rows] = g / M
    return loss, grad


def grad_error(got: torch.Tensor, want: torch.Tensor, rows: int = 512) -> float:
    """||got - want|| / ||want|| over the whole gradient (inf where anything is not finite)."""
    num = den = 0.0
    for s in range(0, got.shape[0], rows):
        g = got[s : s + rows].float()
        if not torch.isfinite(g).all():
            return float("inf")
        num += (g - want[s : s + rows]).square().sum().item()
        den += want[s : s + rows].square().sum().item()
    return (num / den) ** 0.5


def check(x, t, keywords, ref_loss, ref_grad, calls) -> dict:
    """Both paths of one variant against the reference."""
    run, loss, d = forward_kernel(x, t, keywords)
    d.fill_(float("nan"))
    run()
    torch.cuda.synchronize()
    lone = max(((loss - ref_loss).abs() / ref_loss.abs()).max().item(), grad_error(d, ref_grad))
    del run, loss, d
    before = len(calls)
    x.grad = None
    with forced_plan(keywords, calls):
        out = kbuild.cross_entropy(x, t)
        out.backward()
    torch.cuda.synchronize()
    user = max(abs(out.item() - ref_loss.mean().item()) / ref_loss.mean().item(),
               grad_error(x.grad, ref_grad))  # fmt: skip
    x.grad = None
    applied = not keywords or len(calls) > before
    return {"fwd_error": lone, "fwd_bwd_error": user, "plan_applied": applied}


def measure(V: int, copy: float) -> dict:
    torch.manual_seed(V)
    x = (torch.randn(TOKENS, V, device="cuda", dtype=torch.bfloat16) * 4).requires_grad_()
    t = torch.randint(0, V, (TOKENS,), device="cuda")
    ref_loss, ref_grad = reference(x, t)
    calls: list = []
    entries = {}
    for name, keywords in variants(V):
        entry = {"plan": describe(V, keywords)}
        try:
            entry.update(check(x, t, keywords, ref_loss, ref_grad, calls))
        except Exception as err:  # a plan that fails to launch is recorded, not timed
            entry.update(error=f"{type(err).__name__}: {err}"[:300], ok=False)
            x.grad = None
        else:
            worst = max(entry["fwd_error"], entry["fwd_bwd_error"])
            entry["ok"] = entry["plan_applied"] and worst < 2e-2
        entries[name] = entry
        print(f"V {V:6} {name:10} {entry}", flush=True)
    del ref_grad
    gc.collect()
    torch.cuda.empty_cache()
    runs = {}
    for name, keywords in variants(V):
        if entries[name]["ok"]:
            runs[name] = (forward_kernel(x, t, keywords)[0], user_step(x, t, keywords, calls))
    fwd = {name: [] for name in runs}
    both = {name: [] for name in runs}
    for _ in range(ROUNDS):  # interleaved: every variant once a round
        for name, (lone, user) in runs.items():
            fwd[name].append(median_ms(lone))
            both[name].append(median_ms(user))
    nbytes = 2 * TOKENS * V * 2
    for name, (_, user) in runs.items():
        one_at_a_time = do_bench_ms(user)
        for key, times in (("fwd", fwd[name]), ("fwd_bwd", both[name])):
            ms = statistics.median(times)
            entries[name][key] = {
                "ms": round(ms, 4),
                "gbps": round(nbytes / ms / 1e6, 1),
                "of_copy": round(nbytes / ms / 1e6 / copy, 4),
                "rounds_ms": [round(m, 4) for m in times],
            }
        entries[name]["fwd_bwd"]["do_bench_ms"] = one_at_a_time
    del runs, x, t
    gc.collect()
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "chosen_cluster": plan(V).row.cluster, "variants": entries}


def do_bench_ms(fn) -> float | None:
    try:
        from triton.testing import do_bench
    except ImportError:
        return None
    return round(do_bench(fn, return_mode="median"), 4)


def best(result: dict, key: str) -> str:
    timed = {n: e[key]["ms"] for n, e in result["variants"].items() if key in e and n != "chosen"}
    return min(timed, key=timed.get)


def table(doc: dict) -> dict:
    """The measured table as data: per V the fastest cluster (forward kernel; forward +
    backward) and every cluster's % of copy."""
    rows = {}
    for V, r in doc["vocabs"].items():
        timed = {n: e for n, e in r["variants"].items() if "fwd" in e}
        rows[V] = {
            "chosen_cluster": r["chosen_cluster"],
            "best_cluster_fwd": timed[best(r, "fwd")]["plan"]["cluster"],
            "best_cluster_fwd_bwd": timed[best(r, "fwd_bwd")]["plan"]["cluster"],
            "fwd_of_copy": {n: e["fwd"]["of_copy"] for n, e in timed.items()},
            "fwd_bwd_of_copy": {n: e["fwd_bwd"]["of_copy"] for n, e in timed.items()},
        }
    keep = ("gpu", "date", "commit", "copy_gbps", "rows", "dtype")
    return {**{k: doc[k] for k in keep}, "vocabs": rows}


def main(path: str | None) -> None:
    copy = measure_copy()
    doc = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "commit": os.environ.get("KBUILD_COMMIT", commit()),
        "torch": torch.__version__,
        "rows": TOKENS,
        "dtype": "bf16",
        "rounds": ROUNDS,
        "copy_gbps": round(copy, 1),
        "vocabs": {},
    }
    for V in VOCABS:
        doc["vocabs"][str(V)] = measure(V, copy)
    doc["copy_gbps_after"] = round(measure_copy(), 1)
    print(f"\n{doc['gpu']}, copy {doc['copy_gbps']} / {doc['copy_gbps_after']} GB/s (before / "
          "after); % of copy, forward kernel | forward + backward (median of rounds)")  # fmt: skip
    for V, r in doc["vocabs"].items():
        cells = [
            f"{n} {e['fwd']['of_copy']:6.1%} | {e['fwd_bwd']['of_copy']:6.1%}"
            for n, e in r["variants"].items()
            if "fwd" in e
        ]
        failed = [n for n, e in r["variants"].items() if not e["ok"]]
        print(f"V {V:>6} (chosen {r['chosen_cluster']}): " + "; ".join(cells)
              + (f"; FAILED {failed}" if failed else ""))  # fmt: skip
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        base, ext = os.path.splitext(path)
        with open(f"{base}_table{ext}", "w") as f:
            json.dump(table(doc), f, indent=1)
        print(f"wrote {path} and {base}_table{ext}")


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="results JSON (and its _table twin)")
    p.add_argument("--rows", type=int, default=TOKENS,
                   help=f"rows of logits a call (default {TOKENS}; the fused linear loss's "
                        "chunks hold 512-1024 at the large heads)")  # fmt: skip
    p.add_argument("--vocabs", default="", help="comma-separated V (default: all of VOCABS)")
    a = p.parse_args()
    TOKENS = a.rows
    VOCABS = tuple(int(v) for v in a.vocabs.split(",")) if a.vocabs else VOCABS
    main(a.out)
