"""Training steps of Hugging Face models, stock beside kbuild.nn.swap_norms, as users run them.

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/models.py OUT_DIR
        [--models gpt2-124m,...] [--modes eager,compile,reduce-overhead] [--no-explain]

Models are built from configs (random weights, no download) in bf16 on one GPU; a step is
forward, cross-entropy loss, backward and a fused AdamW update. For each model and mode
(eager, torch.compile default, optionally reduce-overhead) the stock model and its swapped
copy (same initial weights, same batches) each run WARMUP steps, then ROUNDS rounds of
STEPS_PER_ROUND timed steps each, the two models taking turns (ms per step: the median of
CUDA-event times per step; host ms: until the step's work is queued, the median too). The
loss of every step is recorded: both curves start from the same weights, so they agree to
bf16 noise. Graph breaks are counted with torch._dynamo.explain on the stock and the swapped
model. Writes
OUT_DIR/models.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kbuild.nn  # noqa: E402

WARMUP, ROUNDS, STEPS_PER_ROUND = 3, 6, 3
STEPS = ROUNDS * STEPS_PER_ROUND


def _configs():
    from transformers import GPT2Config, LlamaConfig, Qwen3Config

    llama = dict(vocab_size=32000, rms_norm_eps=1e-6, max_position_embeddings=1024)
    gpt2 = dict(n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # curves
    return {
        # name: (config, batch, sequence length, modes)
        "gpt2-124m": (
            GPT2Config(n_embd=768, n_layer=12, n_head=12, **gpt2),
            8, 1024, ("eager", "compile"),
        ),
        "gpt2-355m": (
            GPT2Config(n_embd=1024, n_layer=24, n_head=16, **gpt2),
            4, 1024, ("eager", "compile"),
        ),
        # Host-bound GPT-2 steps (GPU busy about half the wall time): kbuild's per-call host
        # cost decides these, not its kernels (bench/model_profile.py shows which).
        "gpt2-d1024-l6": (
            GPT2Config(n_embd=1024, n_layer=6, n_head=16, **gpt2),
            4, 1024, ("eager", "compile"),
        ),
        "gpt2-d768-l4": (
            GPT2Config(n_embd=768, n_layer=4, n_head=12, **gpt2),
            8, 512, ("eager", "compile"),
        ),
        "llama-2048": (
            LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                        num_attention_heads=16, num_key_value_heads=16, **llama),
            4, 1024, ("eager", "compile"),
        ),
        # QK-norm: RMSNorm over each head's 128 values of q and k (swap_norms swaps them too)
        "qwen3-2048": (
            Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        vocab_size=32000, rms_norm_eps=1e-6, max_position_embeddings=1024),
            4, 1024, ("eager", "compile"),
        ),
        "llama-4096": (
            LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=4,
                        num_attention_heads=32, num_key_value_heads=32, **llama),
            4, 1024, ("eager", "compile"),
        ),
    }  # fmt: skip


def _build(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(device="cuda", dtype=torch.bfloat16).train()


def _batches(vocab: int, batch: int, seq: int, count: int):
    g = torch.Generator(device="cuda").manual_seed(1)
    return [torch.randint(0, vocab, (batch, seq), device="cuda", generator=g) for _ in range(count)]


class _Trainer:
    """One model's training loop: step(ids) runs forward, loss, backward and AdamW, with CUDA
    events around each step and the host time until the step's work is queued."""

    def __init__(self, model, mode: str, loss_of=None):
        # loss_of(forward, batch) -> loss; default: a Hugging Face causal LM on a batch of ids
        self.loss_of = loss_of or (lambda forward, ids: forward(input_ids=ids, labels=ids).loss)
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        self.forward = model
        if mode != "eager":
            self.forward = torch.compile(model, mode=None if mode == "compile" else mode)
        self.mode = mode
        self.losses, self.events, self.host_ms = [], [], []

    def step(self, ids, timed: bool) -> None:
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        loss = self.loss_of(self.forward, ids)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        end.record()
        self.losses.append(loss.detach())
        if timed:
            self.host_ms.append(1e3 * (time.perf_counter() - t0))
            self.events.append((start, end))

    def result(self) -> dict:
        torch.cuda.synchronize()
        ms = sorted(s.elapsed_time(e) for s, e in self.events)
        host = sorted(self.host_ms)
        return {
            "ms_per_step": round(ms[len(ms) // 2], 3),
            "host_ms_per_step": round(host[len(host) // 2], 3),
            "losses": [round(float(v), 5) for v in self.losses],
        }


def _train_interleaved(models: dict, batches, mode: str, loss_of=None) -> dict:
    """Train every model on the same batches, alternating ROUNDS rounds of STEPS_PER_ROUND
    steps each (the order flips every round), so a change of the GPU's clocks or of the
    machine's load during the run weighs on all of them alike."""
    trainers = {label: _Trainer(m, mode, loss_of) for label, m in models.items()}
    for label, t in trainers.items():
        w0 = time.perf_counter()
        for ids in batches[:WARMUP]:
            t.step(ids, timed=False)
        torch.cuda.synchronize()
        print(f"  {label} {mode}: warm-up {time.perf_counter() - w0:.1f} s", flush=True)
    order = list(trainers)
    for r in range(ROUNDS):
        for label in order if r % 2 == 0 else order[::-1]:
            first = WARMUP + r * STEPS_PER_ROUND
            for ids in batches[first : first + STEPS_PER_ROUND]:
                trainers[label].step(ids, timed=True)
    return {label: t.result() for label, t in trainers.items()}


def _graph_breaks(model, ids) -> int:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    torch._dynamo.reset()
    return explained.graph_break_count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--models", default="", help="comma-separated names (default: all)")
    parser.add_argument("--modes", default="", help="comma-separated; default: each model's")
    parser.add_argument("--no-explain", action="store_true", help="skip graph-break counts")
    parser.add_argument("--batch", default="", help="B,T for every model instead of its own")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(
        args.out_dir, f"models{'_' + args.batch.replace(',', 'x') if args.batch else ''}.json"
    )
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "models": {}}
    for name, (config, batch, seq, modes) in _configs().items():
        if args.models and name not in args.models.split(","):
            continue
        modes = args.modes.split(",") if args.modes else modes
        if args.batch:  # e.g. 1,64: the GPU has almost nothing to do, steps show host time
            batch, seq = (int(v) for v in args.batch.split(","))
        stock = _build(config)
        swapped = copy.deepcopy(stock)
        names = kbuild.nn.swap_norms(swapped)
        batches = _batches(config.vocab_size, batch, seq, WARMUP + STEPS)
        entry = {"batch": [batch, seq], "swapped": len(names), "modes": {}}
        if not args.no_explain:
            entry["graph_breaks"] = {
                "stock": _graph_breaks(stock, batches[0]),
                "kbuild": _graph_breaks(swapped, batches[0]),
            }
        for mode in modes:
            row = _train_interleaved(
                {"stock": copy.deepcopy(stock), "kbuild": copy.deepcopy(swapped)}, batches, mode
            )
            torch._dynamo.reset()
            row["speedup"] = round(row["stock"]["ms_per_step"] / row["kbuild"]["ms_per_step"], 3)
            pairs = zip(row["stock"]["losses"], row["kbuild"]["losses"], strict=True)
            diffs = [abs(a - b) for a, b in pairs]
            row["max_loss_diff"] = round(max(diffs), 5)
            entry["modes"][mode] = row
            print(f"{name} {mode}: stock {row['stock']['ms_per_step']:.2f} ms, kbuild "
                  f"{row['kbuild']['ms_per_step']:.2f} ms, x{row['speedup']:.3f}, "
                  f"loss diff {row['max_loss_diff']:.4f}", flush=True)  # fmt: skip
        print(f"{name}: swapped {len(names)} norms, graph breaks {entry.get('graph_breaks')}")
        result["models"][name] = entry
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        del stock, swapped
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
