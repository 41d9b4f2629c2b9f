"""Where a training step's time goes, stock model beside kbuild.nn.swap_norms (torch.profiler).

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/model_profile.py OUT_DIR
        [--model gpt2-355m] [--steps 3]

For one model of bench/models.py in eager mode: STEPS profiled training steps of each variant
after warm-up, then per variant the step time (CUDA events), the GPU's busy time (the union
of kernel intervals, so idle gaps show as step - busy), and the kernels grouped by name with
count and total device time per step. The two tables side by side say whether a difference
is in the norm kernels, in other kernels (the neighbours of a norm), or in idle GPU time
(host or synchronisation). Writes OUT_DIR/profile_MODEL.json and the profiler tables.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kbuild.nn  # noqa: E402
from bench.models import _batches, _build, _configs  # noqa: E402


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def host_gaps(trace: dict, steps: int) -> list[dict]:
    """GPU idle time that the host caused, by the operator that launched the kernel after the
    gap: a gap counts where that kernel's launch call ended after the GPU ran dry (the host
    was late, not the GPU busy). The operator is the outermost one open on the launching
    thread (a module's op in the forward, the autograd node in the backward)."""
    events = trace["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    ops: dict[object, list[dict]] = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            ops.setdefault(e["tid"], []).append(e)
    for lst in ops.values():
        lst.sort(key=lambda e: e["ts"])

    def outermost(launch) -> str:
        best = None
        for op in ops.get(launch["tid"], []):
            if op["ts"] > launch["ts"]:
                break
            if op["ts"] + op["dur"] >= launch["ts"] and (best is None or op["dur"] > best["dur"]):
                best = op
        return best["name"] if best else "(no operator)"

    by_op: dict[str, list[float]] = {}
    busy_until = None
    for k in kernels:
        if busy_until is not None and k["ts"] > busy_until:
            launch = launches.get(k.get("args", {}).get("correlation"))
            if launch is not None and launch["ts"] + launch["dur"] > busy_until:
                gap = k["ts"] - busy_until
                by_op.setdefault(outermost(launch), []).append(gap)
        end = k["ts"] + k["dur"]
        busy_until = end if busy_until is None else max(busy_until, end)
    rows = sorted(
        ((n, sum(g) / steps, len(g) / steps) for n, g in by_op.items()), key=lambda r: -r[1]
    )
    return [
        {"op": n[:120], "idle_us_per_step": round(t, 1), "gaps_per_step": round(c, 1)}
        for n, t, c in rows
    ]


def hf_step(model):
    """One training step of a Hugging Face causal LM on a batch of ids (fused AdamW)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def profile_steps(step, batches, steps: int, out_dir: str, label: str) -> dict:
    """Profile `steps` calls of step(batch) after 3 warm-up calls: step times, GPU busy time,
    host-caused idle by operator, kernels by name (all per step)."""
    for ids in batches[:3]:
        step(ids)
    torch.cuda.synchronize()
    events = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for ids in batches[3 : 3 + steps]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(ids)
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
    step_ms = sorted(s.elapsed_time(e) for s, e in events)
    kernels: dict[str, list[float]] = {}
    intervals = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            kernels.setdefault(ev.name, []).append(ev.device_time)
            start = ev.time_range.start
            intervals.append((start, start + ev.device_time))
    trace_path = os.path.join(out_dir, f"trace_{label}.json")
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        gaps = host_gaps(json.load(f), steps)
    os.remove(trace_path)  # large; the gap table below is what is kept
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40)
    with open(os.path.join(out_dir, f"profile_{label}.txt"), "w") as f:
        f.write(table)
    rows = sorted(
        ((name, len(t) / steps, sum(t) / steps) for name, t in kernels.items()),
        key=lambda r: -r[2],
    )
    return {
        "step_ms": step_ms,
        "busy_ms_per_step": round(_busy_us(intervals) / steps / 1e3, 3),
        "kernel_ms_per_step": round(sum(r[2] for r in rows) / 1e3, 3),
        "launches_per_step": round(sum(r[1] for r in rows), 1),
        "host_idle_ms_per_step": round(sum(g["idle_us_per_step"] for g in gaps) / 1e3, 3),
        "host_idle_by_op": gaps[:40],
        "kernels": [
            {"name": n[:140], "per_step": round(c, 1), "us_per_step": round(t, 1)}
            for n, c, t in rows
        ],
    }


def print_profile(label: str, r: dict) -> None:
    print(
        f"{label}: step {r['step_ms']} ms, GPU busy {r['busy_ms_per_step']} ms, "
        f"kernels {r['kernel_ms_per_step']} ms, {r['launches_per_step']} launches"
    )
    print(f"  GPU idle caused by the host: {r['host_idle_ms_per_step']} ms per step")
    for g in r["host_idle_by_op"][:15]:
        print(f"  {g['idle_us_per_step']:10.1f} us idle {g['gaps_per_step']:7.1f} gaps  {g['op']}")
    for k in r["kernels"][:12]:
        print(f"  {k['us_per_step']:10.1f} us {k['per_step']:7.1f}x  {k['name'][:100]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--model", default="gpt2-355m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", default="", help="B,T instead of the model's own")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    config, batch, seq, _ = _configs()[args.model]
    if args.batch:
        batch, seq = (int(v) for v in args.batch.split(","))
    stock = _build(config)
    swapped = copy.deepcopy(stock)
    kbuild.nn.swap_norms(swapped)
    batches = _batches(config.vocab_size, batch, seq, 3 + args.steps)
    result = {"gpu": torch.cuda.get_device_name(), "model": args.model, "batch": [batch, seq]}
    for label, model in (("stock", stock), ("kbuild", swapped)):
        name = f"{args.model}_{label}"
        r = profile_steps(hf_step(model), batches, args.steps, args.out_dir, name)
        result[label] = r
        print_profile(label, r)
    with open(os.path.join(args.out_dir, f"profile_{args.model}_{batch}x{seq}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
