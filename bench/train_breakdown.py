"""examples/train_gpt2.py's model, part by part: which kbuild module gains or loses time.

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/train_breakdown.py OUT_DIR
        [--model gpt2-124m] [--batch 8] [--modes eager,compile] [--profile]

Variants of the same GPT-2 (same initial weights, same batches of the example's corpus):
torch's modules only, kbuild's embedding + norms + linears (the example's kbuild model), and
each kbuild part alone. They train interleaved (bench/models.py: rounds of steps, order
flipped each round), ms per step by CUDA events and host ms until the step is queued. With
--profile, the torch and all-kbuild steps are also profiled (bench/model_profile.py: GPU busy
time, host-caused idle by operator, kernels by name). Writes OUT_DIR/train_breakdown.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from train_gpt2 import GPT, MODELS, PARTS, batches, corpus  # noqa: E402

from bench.model_profile import print_profile, profile_steps  # noqa: E402
from bench.models import STEPS, WARMUP, _train_interleaved  # noqa: E402

VARIANTS = {"torch": (), "kbuild": PARTS, **{f"only_{p}": (p,) for p in PARTS}}


def _loss(forward, batch):
    return forward(*batch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--model", choices=MODELS, default="gpt2-124m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--modes", default="eager")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    layers, heads, width, T = MODELS[args.model]
    data = batches(corpus(4 << 20), WARMUP + STEPS, args.batch, T, "cuda")
    torch.manual_seed(0)
    reference = GPT(layers, heads, width, T, kbuild_parts=())
    reference.init_weights(layers)
    state = reference.state_dict()

    def build(parts):
        model = GPT(layers, heads, width, T, kbuild_parts=parts)
        model.load_state_dict(state)
        return model.to(device="cuda", dtype=torch.bfloat16)

    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "model": args.model, "batch": [args.batch, T]}  # fmt: skip
    for mode in args.modes.split(","):
        models = {label: build(parts) for label, parts in VARIANTS.items()}
        runs = _train_interleaved(models, data, mode, loss_of=_loss)
        base = runs["torch"]["ms_per_step"]
        for label, r in runs.items():
            r["speed_vs_torch"] = round(base / r["ms_per_step"], 4)
            print(f"{mode:8s} {label:12s} {r['ms_per_step']:8.3f} ms/step (host "
                  f"{r['host_ms_per_step']:7.3f})  {r['speed_vs_torch']:.3f}x torch")  # fmt: skip
        result[mode] = runs
        del models
    if args.profile:
        for label in ("torch", "kbuild"):
            model = build(VARIANTS[label])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

            def step(batch, model=model, opt=opt):
                model(*batch).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            r = profile_steps(step, data, 3, args.out_dir, f"train_{label}")
            print_profile(label, r)
            result[f"profile_{label}"] = r
    with open(os.path.join(args.out_dir, "train_breakdown.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
