"""Hugging Face models end to end: stock, Liger-Kernel's `apply_liger_kernel_to_<family>` and
`kbuild.nn.patch`, each variant in its own process, from the same initial weights on the same
batches.

    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/patch_models.py OUT_DIR
        [--models llama3-8b-l2,...] [--modes eager,compile] [--variants stock,liger,kbuild]
        [--no-longest] [--warmup 3] [--steps 10] [--timeout 900]
    python bench/patch_models.py --write-configs DIR     # each model's config.json, for warmup
    python bench/patch_models.py OUT_DIR --device cpu --tiny --modes eager ...   # CPU check

Models: random weights from the config (no download), bf16, sdpa attention, no dropout, fused
AdamW (lr 3e-4); the loss is the model's own, `model(input_ids=ids, labels=ids).loss`, so
Liger's and kbuild's fused linear cross-entropy replace what a user's training loop runs. Every
step is 8192 tokens, sized so stock eager (its fp32 logits included) fits one H200 (141 GB)
comfortably: estimated, not yet measured, under about 60 GB for each, so an H100 serves too.

  name            shape of      layers    hidden  inter  heads/kv (head_dim)  vocab   B x T
  llama3-8b-l2    Llama-3-8B    2 of 32    4096   14336   32/8 (128)          128256  2 x 4096
  mistral-7b-l2   Mistral-7B    2 of 32    4096   14336   32/8 (128)           32768  2 x 4096
  qwen3-1.7b-l4   Qwen3-1.7B    4 of 28    2048    6144   16/8 (128), tied    151936  2 x 4096
  gemma2-2b-l4    Gemma-2-2B    4 of 26    2304    9216    8/4 (256), tied    256000  2 x 4096
                  (final_logit_softcapping 30; attention softcap 50, which sdpa leaves out)
  gemma3-1b-l4    Gemma-3-1B    4 of 26    1152    6912    4/1 (256), tied    262144  2 x 4096
                  (3 sliding-window layers of 512, 1 global)
  gpt2-124m       GPT-2 124M    12 of 12    768    3072   12 (64), tied        50257  8 x 1024

Variants, each a separate `--worker` process per model (Liger patches modeling modules for the
whole process, so the processes must not share):
  stock   the model as transformers builds it
  liger   `apply_liger_kernel_to_<family>(rope=True, cross_entropy=False,
          fused_linear_cross_entropy=True, rms_norm=True, swiglu/geglu=True)` (those of the
          arguments its signature has) before the model is built; GPT-2: Liger has none, "not
          supported" is recorded; an import failure is recorded as the variant's error
  kbuild  `kbuild.nn.patch(model)` after the model is on the GPU in bf16; `str(report)` recorded

Same weights: every matrix is drawn from N(0, initializer_range) by a generator seeded by the
parameter's name, on the device, after the model is built; norm weights are set to 1 (0 for
Gemma's 1 + weight), biases to 0. Liger's modules keep the stock parameter names, so the three
variants start from the same weights whatever classes built them (`init_sum` in each record,
the sum of all parameters, shows it). Batches: one seeded generator on the device.

Per (model, mode, variant), modes eager and torch.compile (default mode), a fresh model each:
WARMUP steps (compile time included; `warmup_s`), then STEPS timed steps: `ms_per_step` the
median of CUDA-event times per step, `peak_gib` torch.cuda.max_memory_allocated over the timed
steps (reset after warm-up; parameters, gradients and AdamW state included, `resident_gib` at
the reset), `losses` every step's loss (warm-up included: same weights and batches, so the
curves compare), `graph_breaks` under compile (torch._dynamo's counter). A failure (Liger
lacking a family, a compile error, OOM) is recorded as `error`, never fatal.

Longest sequence at batch 1 (llama3-8b-l2, eager, each variant): T = 2048, 4096, ... up to
131072 until a step fails with OOM (torch.cuda.OutOfMemoryError, or an allocation failure of
cuBLAS, caught and memory freed; any other failure ends the search too, recorded as that
length's `error`); each length's ms and peak, and `longest` the last that trained a step.
`--no-longest` skips it.

The parent merges each worker's fragment (OUT_DIR/patch_models/<model>.<variant>.json, its log
beside it) into OUT_DIR/patch_models.json, keeping the models, variants and modes of earlier
runs (so the work may be split by --models, --variants or --modes over several calls), and
`--rounds N` runs each model's variants N times, alternating (stock, liger, kbuild, stock, ...),
and keeps each mode's median round (`ms_per_step_rounds` lists them all). It
prints ms/step and peak GiB per variant with kbuild / stock and kbuild / liger ratios (below 1:
kbuild faster / smaller) and how far each variant's loss curve is from stock's. The environment
passes through (KBUILD_CACHE_DIR, KBUILD_OFFLINE, PYTORCH_CUDA_ALLOC_CONF). Time, estimated
(not yet measured): a worker's start, imports and eager steps well under a minute (all models,
3 variants, eager and the longest-sequence search: about 10 minutes); compile adds a cold
Inductor compile of about 1-2 minutes per worker (20-40 minutes for all). Within a 10-minute
device call, e.g. `--modes eager` first, then `--modes compile --no-longest --models ...` a
few models at a time; `--timeout` bounds each worker.

Warming kbuild's kernels offline (CPU machine, no GPU; bench/gpu_prepare.sh does it):
    python bench/patch_models.py --write-configs .patch-configs
    kbuild warmup --arch sm_90 $(for f in .patch-configs/*.json; do echo --model $f; done) \
        --cache-dir .kbuild-aot

CPU check (`--device cpu --tiny`, tests/test_patch_models_cpu.py): each family at 2 layers,
hidden 64, vocabulary 1000, fp32, foreach AdamW, perf_counter timing, peak memory not taken;
the longest-sequence search goes 16, 32, ... up to `--longest-cap` (default 64 there).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VARIANTS = ("stock", "liger", "kbuild")
MODES = ("eager", "compile")
LONGEST_MODEL = "llama3-8b-l2"
LR = 3e-4
TINY_LR = 1e-2  # the tiny models' curves move further from step to step

# name: family, batch, sequence length, the Hugging Face config's fields
MODELS = {
    "llama3-8b-l2": ("llama", 2, 4096, dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope_parameters={"rope_type": "default",
                                                         "rope_theta": 500000.0},
        tie_word_embeddings=False)),
    "mistral-7b-l2": ("mistral", 2, 4096, dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=32768, rms_norm_eps=1e-5,
        max_position_embeddings=32768, rope_parameters={"rope_type": "default",
                                                        "rope_theta": 1000000.0},
        sliding_window=None, tie_word_embeddings=False)),
    "qwen3-1.7b-l4": ("qwen3", 2, 4096, dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_parameters={"rope_type": "default",
                                                        "rope_theta": 1000000.0},
        tie_word_embeddings=True)),
    "gemma2-2b-l4": ("gemma2", 2, 4096, dict(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, rms_norm_eps=1e-6,
        max_position_embeddings=8192, query_pre_attn_scalar=256, sliding_window=4096,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "gemma3-1b-l4": ("gemma3", 2, 4096, dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, rms_norm_eps=1e-6,
        max_position_embeddings=32768, query_pre_attn_scalar=256, sliding_window=512,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        final_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True)),
    "gpt2-124m": ("gpt2", 8, 1024, dict(
        n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
}  # fmt: skip

CONFIG_CLASS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen3": "Qwen3Config",
                "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig",
                "gpt2": "GPT2Config"}  # fmt: skip
LIGER = {"llama": ("apply_liger_kernel_to_llama",), "mistral": ("apply_liger_kernel_to_mistral",),
         "qwen3": ("apply_liger_kernel_to_qwen3",), "gemma2": ("apply_liger_kernel_to_gemma2",),
         "gemma3": ("apply_liger_kernel_to_gemma3_text", "apply_liger_kernel_to_gemma3"),
         "gpt2": ()}  # fmt: skip
LIGER_KWARGS = dict(rope=True, cross_entropy=False, fused_linear_cross_entropy=True,
                    rms_norm=True, swiglu=True, geglu=True)  # fmt: skip
GEMMA = ("gemma2", "gemma3")


def _tiny_fields(family: str, fields: dict) -> dict:
    """The family's config at 2 layers, hidden 64, vocabulary 1000 (its switches kept)."""
    if family == "gpt2":
        return {**fields, "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1000,
                "n_positions": 256, "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip
    tiny = {**fields, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 1000, "max_position_embeddings": 256}  # fmt: skip
    if family == "gemma2":
        tiny.update(sliding_window=16, query_pre_attn_scalar=16)
    if family == "gemma3":
        tiny.update(sliding_window=8, query_pre_attn_scalar=16,
                    layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    return tiny


def _shape(name: str, tiny: bool) -> tuple[int, int]:
    family, batch, seq, _ = MODELS[name]
    return (2, 32) if tiny else (batch, seq)


def _config(name: str, tiny: bool):
    import transformers

    family, _, _, fields = MODELS[name]
    fields = _tiny_fields(family, fields) if tiny else dict(fields)
    config = getattr(transformers, CONFIG_CLASS[family])(**fields)
    config.use_cache = False
    return config


# --------------------------------------------------------------------------- worker


class _Clock:
    """Per-step times: CUDA events on the GPU (read once at the end), perf_counter on the CPU."""

    def __init__(self, device: str):
        import torch

        self.cuda = device != "cpu"
        self.torch = torch
        self.marks: list = []

    def start(self):
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, begun) -> None:
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((begun, event))
        else:
            self.marks.append(1e3 * (time.perf_counter() - begun))

    def ms(self) -> list[float]:
        if self.cuda:
            self.torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in self.marks]
        return list(self.marks)


def _gib(n: int) -> float:
    return round(n / 2**30, 3)


def _reinit(model, family: str, std: float) -> float:
    """The same weights whatever classes built the model (module docstring); returns the sum
    of all parameters."""
    import torch

    total = 0.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                g = torch.Generator(device=p.device).manual_seed(zlib.crc32(name.encode()))
                p.normal_(0.0, std, generator=g)
            elif name.endswith("bias") or family in GEMMA:
                p.zero_()
            else:
                p.fill_(1.0)
            total += float(p.float().sum())
    return total


def _apply_liger(family: str) -> dict:
    """Liger's patch of the family (before the model is built): what was called, or raises."""
    names = LIGER[family]
    if not names:
        raise NotImplementedError(f"not supported: Liger-Kernel has no patch for {family}")
    import liger_kernel.transformers as liger

    for fn_name in names:
        fn = getattr(liger, fn_name, None)
        if fn is None:
            continue
        params = inspect.signature(fn).parameters
        kwargs = {k: v for k, v in LIGER_KWARGS.items() if k in params}
        fn(**kwargs)
        version = getattr(liger, "__version__", None)
        if version is None:
            from importlib.metadata import version as _version

            version = _version("liger_kernel")
        return {"called": fn_name, "kwargs": kwargs, "liger_kernel": version}
    raise NotImplementedError(f"not supported: liger_kernel.transformers has none of {names}")


class _Worker:
    def __init__(self, args):
        import torch

        self.torch = torch
        self.args = args
        self.name = args.model
        self.family = MODELS[self.name][0]
        self.device = args.device
        self.dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        self.config = _config(self.name, args.tiny)
        self.report: str | None = None

    def build(self):
        import transformers

        torch = self.torch
        with torch.device(self.device):
            model = transformers.AutoModelForCausalLM.from_config(
                self.config, dtype=self.dtype, attn_implementation="sdpa"
            )
        model = model.to(device=self.device, dtype=self.dtype).train()
        init_sum = _reinit(model, self.family, self.config.initializer_range)
        if self.args.variant == "kbuild":
            import kbuild.nn

            report = kbuild.nn.patch(model)
            self.report = str(report)
        return model, init_sum

    def optimizer(self, model):
        fused = self.device != "cpu"
        return self.torch.optim.AdamW(
            model.parameters(),
            lr=TINY_LR if self.args.tiny else LR,
            fused=fused,
            foreach=None if fused else True,
        )

    def batches(self, batch: int, seq: int, count: int, seed: int = 1):
        torch = self.torch
        g = torch.Generator(device=self.device).manual_seed(seed)
        vocab = self.config.vocab_size
        return [
            torch.randint(0, vocab, (batch, seq), device=self.device, generator=g)
            for _ in range(count)
        ]

    def train(self, mode: str) -> dict:
        torch, args = self.torch, self.args
        cuda = self.device != "cpu"
        model, init_sum = self.build()
        opt = self.optimizer(model)
        forward = model
        if mode == "compile":
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            forward = torch.compile(model, **({"backend": args.backend} if args.backend else {}))
        batch, seq = _shape(self.name, args.tiny)
        batches = self.batches(batch, seq, args.warmup + args.steps)
        losses = []

        def step(ids):
            loss = forward(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())

        w0 = time.perf_counter()
        for ids in batches[: args.warmup]:
            step(ids)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        warmup_s = time.perf_counter() - w0
        resident = torch.cuda.memory_allocated() if cuda else None
        clock = _Clock(self.device)
        for ids in batches[args.warmup :]:
            begun = clock.start()
            step(ids)
            clock.stop(begun)
        ms = clock.ms()
        row = {
            "ms_per_step": round(statistics.median(ms), 3),
            "ms_steps": [round(v, 3) for v in ms],
            "warmup_s": round(warmup_s, 2),
            "peak_gib": _gib(torch.cuda.max_memory_allocated()) if cuda else None,
            "resident_gib": _gib(resident) if cuda else None,
            "losses": [float(v) for v in losses],
            "init_sum": init_sum,
        }
        if mode == "compile":
            row["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
        return row

    def free(self) -> None:
        gc.collect()
        if self.device != "cpu":
            self.torch._dynamo.reset()
            self.torch.cuda.empty_cache()

    def longest(self) -> dict:
        """Batch 1, T doubling from `--longest-start` until a step runs out of memory (or fails
        otherwise: recorded as the length's "error") or T passes `--longest-cap`; one model and
        optimizer throughout (AdamW's state stays)."""
        torch, args = self.torch, self.args
        cuda = self.device != "cpu"
        model, _ = self.build()
        opt = self.optimizer(model)
        out: dict = {"lengths": {}, "longest": None}
        seq = args.longest_start
        while seq <= args.longest_cap:
            (ids,) = self.batches(1, seq, 1, seed=2)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            clock = _Clock(self.device)
            failed = None
            try:
                begun = clock.start()
                loss = _one_step(model, opt, ids)
                clock.stop(begun)
                (ms,) = clock.ms()
            except Exception as err:  # OOM ends the search; so does any other error, recorded
                text = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
                failed = ("oom", text) if _out_of_memory(err) else ("error", text)
            if failed:
                opt.zero_grad(set_to_none=True)
                del ids
                self.free()
                out["lengths"][str(seq)] = {failed[0]: failed[1]}
                print(f"  longest: T={seq} {failed[1]}", flush=True)
                break
            peak = _gib(torch.cuda.max_memory_allocated()) if cuda else None
            out["lengths"][str(seq)] = {"ms": round(ms, 3), "peak_gib": peak, "loss": loss}
            out["longest"] = seq
            print(f"  longest: T={seq} {ms:.1f} ms, peak {peak} GiB", flush=True)
            seq *= 2
        del model, opt
        self.free()
        return out


def _out_of_memory(err: Exception) -> bool:
    """torch's OOM, or an allocation failure of cuBLAS or a Triton kernel's launcher."""
    import torch

    text = str(err).lower()
    return isinstance(err, torch.cuda.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and ("out of memory" in text or "alloc_failed" in text)
    )


def _one_step(model, opt, ids) -> float:
    """One training step; its tensors are gone when it returns or raises."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:500]


def worker(args) -> None:
    def save():
        with open(args.fragment, "w") as f:
            json.dump(record, f, indent=1)

    family = MODELS[args.model][0]
    batch, seq = _shape(args.model, args.tiny)
    record: dict = {"model": args.model, "family": family, "variant": args.variant,
                    "tiny": args.tiny, "batch": [batch, seq], "modes": {}}  # fmt: skip
    save()
    try:
        if args.variant == "liger":  # before the model is built: it replaces module classes
            record["liger"] = _apply_liger(family)
        import torch
        import transformers

        record.update(
            device=torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
            torch=torch.__version__,
            transformers=transformers.__version__,
        )
        w = _Worker(args)
    except Exception as err:
        record["error"] = _error(err)
        print(f"{args.model} {args.variant}: {record['error']}", flush=True)
        save()
        return
    for mode in args.modes.split(","):
        try:
            row = w.train(mode)
        except Exception as err:
            row = {"error": _error(err)}
        w.free()
        record["modes"][mode] = row
        if w.report is not None:
            record["report"] = w.report
        text = row.get("error") or (
            f"{row['ms_per_step']:.2f} ms/step, peak {row['peak_gib']} GiB, warm-up "
            f"{row['warmup_s']:.1f} s, last loss {row['losses'][-1]:.4f}"
        )
        print(f"{args.model} {args.variant} {mode}: {text}", flush=True)
        save()
    if w.report is not None:
        print(w.report, flush=True)
    if args.longest:
        try:
            record["longest"] = w.longest()
        except Exception as err:
            record["longest"] = {"error": _error(err)}
        save()


# --------------------------------------------------------------------------- parent


def _run_worker(args, name: str, variant: str, frag_dir: str) -> dict:
    fragment = os.path.join(frag_dir, f"{name}.{variant}.json")
    log = os.path.join(frag_dir, f"{name}.{variant}.log")
    if os.path.exists(fragment):
        os.remove(fragment)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", name,
           "--variant", variant, "--modes", args.modes, "--fragment", fragment,
           "--device", args.device, "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--longest-start", str(args.longest_start),
           "--longest-cap", str(args.longest_cap)]  # fmt: skip
    if args.tiny:
        cmd.append("--tiny")
    if args.backend:
        cmd += ["--backend", args.backend]
    if name == LONGEST_MODEL and not args.no_longest and "eager" in args.modes.split(","):
        cmd.append("--longest")
    t0 = time.perf_counter()
    print(f"== {name} {variant}", flush=True)
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout)
            rc, why = proc.returncode, None
        except subprocess.TimeoutExpired:
            rc, why = None, f"timed out after {args.timeout} s"
    with open(log) as f:
        lines = f.read().splitlines()
    print("\n".join(f"   {line}" for line in lines[-40:]), flush=True)
    try:
        with open(fragment) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError):
        record = {"model": name, "variant": variant, "modes": {}}
    record["worker_s"] = round(time.perf_counter() - t0, 1)
    if rc != 0:
        tail = " | ".join(lines[-5:])[-600:]
        record.setdefault("error", why or f"worker exit {rc}: {tail}")
    return record


def _merge(entry: dict, variant: str, record: dict) -> None:
    """The new record of a variant in place of the old, but modes (and the longest-sequence
    search) the new run did not make are kept from the old: a run of `--modes compile` after
    one of eager leaves both."""
    old = entry["variants"].get(variant, {})
    record["modes"] = {**old.get("modes", {}), **record.get("modes", {})}
    if "longest" in old and "longest" not in record:
        record["longest"] = old["longest"]
    entry["variants"][variant] = record


def _rounds(records: list[dict]) -> dict:
    """One variant's record from its rounds (`--rounds`): per mode, the round of the median
    ms/step, with every round's ms/step (`ms_per_step_rounds`) beside it; the first round's
    longest-sequence search."""
    record = dict(records[0])
    record["modes"] = {}
    for mode in {m for r in records for m in r.get("modes", {})}:
        rows = [r["modes"][mode] for r in records if mode in r.get("modes", {})]
        timed = sorted((row for row in rows if "ms_per_step" in row), key=_ms)
        row = dict(timed[(len(timed) - 1) // 2] if timed else rows[0])
        row["ms_per_step_rounds"] = [r.get("ms_per_step") for r in rows]
        record["modes"][mode] = row
    return record


def _ms(row: dict) -> float:
    return row["ms_per_step"]


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def _summarise(entry: dict) -> None:
    """Ratios (kbuild / stock, kbuild / liger, liger / stock: ms and peak) and each variant's
    largest relative distance from stock's loss curve, per mode."""
    variants = entry["variants"]
    entry["ratios"], entry["loss_rel_diff"] = {}, {}
    modes = {m for v in variants.values() for m in v.get("modes", {})}
    for mode in sorted(modes, key=lambda m: (MODES + (m,)).index(m)):
        rows = {k: v.get("modes", {}).get(mode, {}) for k, v in variants.items()}
        ratios = {}
        for a, b in (("kbuild", "stock"), ("kbuild", "liger"), ("liger", "stock")):
            ra, rb = rows.get(a, {}), rows.get(b, {})
            ratios[f"{a}/{b}"] = {
                "ms": _ratio(ra.get("ms_per_step"), rb.get("ms_per_step")),
                "peak": _ratio(ra.get("peak_gib"), rb.get("peak_gib")),
            }
        entry["ratios"][mode] = ratios
        ref = rows.get("stock", {}).get("losses")
        diffs = {}
        for k, row in rows.items():
            if k == "stock" or not ref or not row.get("losses"):
                continue
            if len(row["losses"]) != len(ref):
                diffs[k] = None
                continue
            diffs[k] = max(
                abs(a - b) / max(abs(b), 1e-12) for a, b in zip(row["losses"], ref, strict=True)
            )
        entry["loss_rel_diff"][mode] = diffs


def _cell(row: dict | None) -> str:
    if not row:
        return f"{'-':>18}"
    if "error" in row:
        return f"{'error':>18}"
    peak = row.get("peak_gib")
    return f"{row['ms_per_step']:10.2f} {peak if peak is not None else '-':>7}"


def _num(v) -> str:
    return f"{v:.3f}" if v is not None else "-"


def _table(result: dict) -> str:
    head = (f"{'model':<15}{'mode':<8}" + "".join(f"{v + ' ms  GiB':>18}" for v in VARIANTS)
            + "  kbuild/stock ms GiB  kbuild/liger ms GiB")  # fmt: skip
    lines = [head]
    for name, entry in result["models"].items():
        for mode, ratios in entry.get("ratios", {}).items():
            cells = [_cell(entry["variants"].get(v, {}).get("modes", {}).get(mode))
                     for v in VARIANTS]  # fmt: skip
            ks, kl = ratios["kbuild/stock"], ratios["kbuild/liger"]
            lines.append(f"{name:<15}{mode:<8}" + "".join(cells)
                         + f"{_num(ks['ms']):>15} {_num(ks['peak']):>5}"
                         + f"{_num(kl['ms']):>15} {_num(kl['peak']):>5}")  # fmt: skip
        for variant, record in entry["variants"].items():
            if "error" in record:
                lines.append(f"  {name} {variant}: {record['error'][:160]}")
            for mode, row in record.get("modes", {}).items():
                if "error" in row:
                    lines.append(f"  {name} {variant} {mode}: {row['error'][:160]}")
        for variant, record in entry["variants"].items():
            longest = record.get("longest")
            if longest:
                lines.append(f"  {name} {variant}: longest T at batch 1 (eager): "
                             f"{longest.get('longest', longest.get('error'))}")  # fmt: skip
    return "\n".join(lines)


def parent(args) -> None:
    names = args.models.split(",") if args.models else list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        sys.exit(f"variants are {', '.join(VARIANTS)}")
    os.makedirs(args.out_dir, exist_ok=True)
    frag_dir = os.path.join(args.out_dir, "patch_models")
    os.makedirs(frag_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "patch_models.json")
    result: dict = {"models": {}}
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    result["env"] = {k: os.environ.get(k) for k in
                     ("KBUILD_CACHE_DIR", "KBUILD_OFFLINE", "PYTORCH_CUDA_ALLOC_CONF")}  # fmt: skip
    result["date"] = time.strftime("%Y-%m-%d")
    for name in names:
        batch, seq = _shape(name, args.tiny)
        entry = result["models"].setdefault(name, {})
        entry.update(family=MODELS[name][0], batch=[batch, seq], tiny=args.tiny)
        entry.setdefault("variants", {})
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(args.rounds):  # the variants alternate: drift hits each alike
            for variant in variants:
                runs[variant].append(_run_worker(args, name, variant, frag_dir))
                if len(runs[variant]) > 1:  # the longest-sequence search: the first round's
                    runs[variant][-1].pop("longest", None)
        for variant, records in runs.items():
            record = _rounds(records)
            for key in ("device", "torch", "transformers"):
                if key in record:
                    result[key] = record[key]
            _merge(entry, variant, record)
        _summarise(entry)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print(_table(result))
    print(f"wrote {path}")


def write_configs(directory: str, names: list[str], tiny: bool) -> None:
    os.makedirs(directory, exist_ok=True)
    for name in names:
        path = os.path.join(directory, f"{name}.json")
        _config(name, tiny).to_json_file(path, use_diff=False)
        print(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir", nargs="?")
    p.add_argument("--models", default="", help=f"comma-separated of {', '.join(MODELS)}")
    p.add_argument("--modes", default=",".join(MODES), help="eager,compile")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--no-longest", action="store_true", help="skip the longest-sequence search")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--rounds", type=int, default=1, help="alternating runs; the median is kept")
    p.add_argument("--timeout", type=int, default=900, help="seconds for each worker")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny configs (the CPU check)")
    p.add_argument("--backend", default="", help="torch.compile backend (default inductor)")
    p.add_argument("--longest-start", type=int, default=None)
    p.add_argument("--longest-cap", type=int, default=None)
    p.add_argument("--write-configs", metavar="DIR", help="write each model's config JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--fragment", help=argparse.SUPPRESS)
    p.add_argument("--longest", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.longest_start is None:
        args.longest_start = 16 if args.tiny else 2048
    if args.longest_cap is None:
        args.longest_cap = 64 if args.tiny else 131072
    if args.write_configs:
        names = args.models.split(",") if args.models else list(MODELS)
        write_configs(args.write_configs, names, args.tiny)
        return
    if args.worker:
        worker(args)
        return
    if not args.out_dir:
        p.error("OUT_DIR is required (or --write-configs DIR)")
    parent(args)


if __name__ == "__main__":
    main()
