"""Train a GPT-2 whose embedding, norms and linears are kbuild's, beside the same model on
torch's modules: same initial weights, same batches, the two taking turns step by step; the
loss of both and, on a GPU, their tokens/s.

    python examples/train_gpt2.py                      # GPU: GPT-2 124M shape, bf16, 300 steps
    python examples/train_gpt2.py --device cpu         # CPU: the tiny model, 20 steps, a minute

The corpus needs no download: the bytes of the Python standard library's own source files
(byte-level tokens, ids 0-255 of GPT-2's vocabulary padded to 50304 entries). The model is
GPT-2 in plain PyTorch: kbuild.nn.GPT2Embedding (wte + wpe, deterministic backward),
kbuild.nn.LayerNorm, kbuild.nn.Linear (kbuild's bias gradient), kbuild.gelu (the tanh form),
torch's attention (scaled_dot_product_attention) and an output projection tied to wte whose
loss is kbuild.linear_cross_entropy (the 50304-wide logits never built). `--impl torch` swaps
in torch.nn.Embedding, LayerNorm, Linear, F.gelu and the logits' F.cross_entropy; `--impl
both` (the default) trains both.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kbuild.nn  # noqa: E402

MODELS = {  # name: (layers, heads, width, sequence length)
    "gpt2-124m": (12, 12, 768, 1024),
    "tiny": (2, 4, 128, 64),
}
VOCAB = 50304  # GPT-2's 50257, padded to a multiple of 128 as llm.c does
# Default steps per device. On a CPU a step of the tiny model (both models) takes about 2.3 s
# on 2 cores (the 50304-wide logits' matmuls and softmax most of it): 20 steps are about a
# minute, the loss going from 10.45 to 7.61 (2026-12-05: 68 s of CPU time; 100 s wall on 2
# cores shared with other jobs).
STEPS = {"cuda": 300, "cpu": 20}
# The 124M model on a CPU, not run to the end here: about 6 x 124M x 8192 = 6e12 FLOPs per step
# of one model at batch 8, so minutes per step for the two at the ~50 GFLOP/s of 2 cores.
SLOW_CPU = (
    "gpt2-124m on a CPU: an estimated 4 minutes per step of both models on 2 cores (about 6e12 "
    "FLOPs each), 20 steps over an hour; --model tiny runs in about a minute"
)


class TorchEmbedding(nn.Module):
    """wte(tokens) + wpe(positions) in torch, with GPT2Embedding's parameter names."""

    def __init__(self, vocab: int, positions: int, width: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(positions, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]


def torch_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def kbuild_gelu(x: torch.Tensor) -> torch.Tensor:
    return kbuild.gelu(x, approximate="tanh")


class Block(nn.Module):
    def __init__(self, width: int, heads: int, norm, linear, gelu=torch_gelu):
        super().__init__()
        self.heads, self.gelu = heads, gelu
        self.ln_1, self.ln_2 = norm(width), norm(width)
        self.qkv, self.attn_proj = linear(width, 3 * width), linear(width, width)
        self.fc, self.mlp_proj = linear(width, 4 * width), linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(self.gelu(self.fc(self.ln_2(x))))


PARTS = ("embed", "norm", "linear", "gelu", "loss")  # what kbuild can supply


class GPT(nn.Module):
    def __init__(self, layers: int, heads: int, width: int, positions: int, kbuild_parts=PARTS):
        """`kbuild_parts`: which of PARTS are kbuild's modules (the rest are torch's)."""
        super().__init__()
        unknown = set(kbuild_parts) - set(PARTS)
        if unknown:
            raise ValueError(f"kbuild_parts must be among {PARTS}; got {sorted(unknown)}")
        embed = kbuild.nn.GPT2Embedding if "embed" in kbuild_parts else TorchEmbedding
        norm = kbuild.nn.LayerNorm if "norm" in kbuild_parts else nn.LayerNorm
        linear = kbuild.nn.Linear if "linear" in kbuild_parts else nn.Linear
        gelu = kbuild_gelu if "gelu" in kbuild_parts else torch_gelu
        self.fused_loss = "loss" in kbuild_parts
        self.embed = embed(VOCAB, positions, width)
        self.blocks = nn.ModuleList(Block(width, heads, norm, linear, gelu) for _ in range(layers))
        self.ln_f = norm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)
        self.lm_head.weight = self.embed.wte.weight  # tied, as in GPT-2

    def init_weights(self, layers: int) -> None:
        """GPT-2's: normal(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)."""
        for name, p in self.named_parameters():
            if p.dim() == 1:  # norm weights 1, every bias 0
                (nn.init.ones_ if name.endswith("weight") else nn.init.zeros_)(p)
            else:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if self.fused_loss:  # the logits never built; the loss in fp32, as the upcast below
            return kbuild.linear_cross_entropy(x, self.lm_head.weight, targets)
        logits = self.lm_head(x)
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def corpus(nbytes: int) -> torch.Tensor:
    """Byte tokens of the standard library's .py files, in a fixed (sorted) order."""
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= nbytes:
            break
    return torch.frombuffer(bytearray(data[:nbytes]), dtype=torch.uint8).long()


def batches(data: torch.Tensor, steps: int, B: int, T: int, device) -> list:
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(data) - T - 1, (steps, B), generator=g)
    out = []
    for row in starts:
        chunk = torch.stack([data[s : s + T + 1] for s in row.tolist()])
        out.append((chunk[:, :-1].to(device), chunk[:, 1:].to(device)))
    return out


class Trainer:
    """One model, its optimizer and its record: step() runs one training step and times it."""

    def __init__(self, model: GPT, lr: float, steps: int, compile_model: bool, label: str):
        self.on_gpu = next(model.parameters()).is_cuda
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=self.on_gpu)
        self.forward = torch.compile(model) if compile_model else model
        self.lr, self.steps, self.label = lr, steps, label
        self.losses, self.times = [], []

    def step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> None:
        t0 = time.perf_counter()
        for group in self.opt.param_groups:  # linear warm-up over the first 10% of the steps
            group["lr"] = self.lr * min(1.0, (step + 1) / max(1, self.steps // 10))
        loss = self.forward(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss.detach())
        if self.on_gpu:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - t0)

    def result(self, tokens_per_step: int) -> dict:
        """Losses and the median step time after the first five steps (compiles, warm-up)."""
        step_s = statistics.median(self.times[min(5, len(self.times) - 1) :])
        return {"losses": [round(float(v), 5) for v in self.losses],
                "ms_per_step": round(1e3 * step_s, 3),
                "tokens_per_s": round(tokens_per_step / step_s)}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, defaults that depend on the device filled in."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", choices=MODELS, help="default: gpt2-124m on a GPU, tiny on a CPU"
    )
    parser.add_argument("--impl", choices=("kbuild", "torch", "both"), default="both")
    parser.add_argument(
        "--steps", type=int, help=f"default: {STEPS['cuda']} on a GPU, {STEPS['cpu']} on a CPU"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument("--log-every", type=int, help="default: every 25 steps, or 6 lines")
    parser.add_argument("--json", help="write the losses and step times here")
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = "gpt2-124m" if args.device.startswith("cuda") else "tiny"
    if args.steps is None:
        args.steps = STEPS["cuda" if args.device.startswith("cuda") else "cpu"]
    if args.log_every is None:
        args.log_every = max(1, min(25, args.steps // 6))
    return args


def main() -> None:
    args = parse_args()
    layers, heads, width, T = MODELS[args.model]
    print(f"{args.model} on {args.device}: {layers} layers, width {width}, sequence {T}, "
          f"{args.steps} steps of batch {args.batch}", flush=True)  # fmt: skip
    if args.model == "gpt2-124m" and not args.device.startswith("cuda"):
        print(SLOW_CPU, flush=True)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    data = batches(corpus(4 << 20), args.steps, args.batch, T, args.device)
    torch.manual_seed(0)
    reference = GPT(layers, heads, width, T, kbuild_parts=())
    reference.init_weights(layers)
    state = reference.state_dict()
    impls = ("kbuild", "torch") if args.impl == "both" else (args.impl,)
    trainers = {}
    for impl in impls:
        model = GPT(layers, heads, width, T, kbuild_parts=PARTS if impl == "kbuild" else ())
        model.load_state_dict(state)  # the same initial weights for both
        model.to(device=args.device, dtype=dtype)
        trainers[impl] = Trainer(model, args.lr, args.steps, args.compile, impl)
    # The models take turns step by step, first one then the other, so a machine whose speed
    # drifts (clocks, other processes) slows both alike.
    for step, (x, y) in enumerate(data):
        order = list(trainers.values()) if step % 2 == 0 else list(trainers.values())[::-1]
        for trainer in order:
            trainer.step(step, x, y)
        if step % args.log_every == 0 or step == len(data) - 1:
            print(f"step {step:4d}  " + "  ".join(
                f"{t.label} loss {t.losses[-1].item():.4f}" for t in trainers.values()
            ), flush=True)  # fmt: skip
    results = {impl: t.result(args.batch * T) for impl, t in trainers.items()}
    for impl, r in results.items():
        print(f"{impl}: {r['tokens_per_s']:,} tokens/s ({r['ms_per_step']:.1f} ms per step), "
              f"final loss {r['losses'][-1]:.4f}", flush=True)  # fmt: skip
    if len(results) == 2:
        ours, theirs = results["kbuild"], results["torch"]
        pairs = zip(ours["losses"], theirs["losses"], strict=True)
        diff = max(abs(a - b) for a, b in pairs)
        print(f"largest loss difference {diff:.4f}")
        if args.device.startswith("cuda"):
            speed = ours["tokens_per_s"] / theirs["tokens_per_s"]
            print(f"kbuild / torch: {speed:.3f}x tokens/s (steps interleaved)")
        else:  # kbuild's ops run their torch reference on the CPU: a ratio would be noise
            print("no speed ratio on the CPU: kbuild runs its plain torch reference there")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
