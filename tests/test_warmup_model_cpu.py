"""`kbuild warmup --model` and `--vocab` list what the code will launch: the dtype asked for, the
rotary kernels of the cos / sin dtype a patched model really passes, the norms alone for a
family kbuild.nn.patch handles only in part (BERT, T5), and a one-line refusal for a config
patch would swap nothing in. The lists are read through the CLI's own argument parsing
(`_specs_from`), without compiling."""

from __future__ import annotations

import copy
import importlib
import json
import subprocess
import sys

import pytest
import torch

from kbuild.cli import _parser, _specs_from
from kbuild.cli.model_specs import model_plan, model_specs

from .test_patch_cpu import _ids, hf_model

rope_ops = importlib.import_module("kbuild.kernels.rope.op")

BERT = dict(model_type="bert", hidden_size=768, intermediate_size=3072, num_attention_heads=12,
            vocab_size=30522, layer_norm_eps=1e-12, hidden_act="gelu")  # fmt: skip
T5 = dict(model_type="t5", d_model=512, d_ff=2048, num_heads=8, d_kv=64, vocab_size=32128,
          layer_norm_epsilon=1e-6, feed_forward_proj="relu")  # fmt: skip


def _specs(*argv: str) -> list:
    return _specs_from(_parser().parse_args(["warmup", *argv]))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_vocab_follows_dtype(dtype):
    """Catches --vocab warming another dtype than --dtype asks (its logits' dtype)."""
    specs = _specs("--vocab", "50257", "--dtype", dtype)
    assert specs and all(s.kwargs.get("dtype", dtype) == dtype for s in specs)
    assert {s["N"] for s in specs if s.kernel.startswith("cross_entropy_fwd")} == {50257}


def test_bert_warms_its_layernorms_only(tmp_path, capsys):
    """Catches a BERT config warmed as a Llama (RMSNorm, RoPE, GeGLU: kernels a patched BERT
    never runs) and its LayerNorms left out: only LayerNorm kernels at its width and eps, and
    a line saying what patch leaves stock."""
    specs, left_out = model_plan(BERT, "bf16")
    assert specs and {s.kernel.split("_")[0] for s in specs} == {"layernorm", "column"}
    norms = [s for s in specs if s.kernel != "column_sum"]  # dw / db's column sum
    assert norms and all(s["N"] == 768 and s.kwargs.get("eps", 1e-12) == 1e-12 for s in norms)
    assert "LayerNorms only" in left_out
    path = tmp_path / "bert.json"
    path.write_text(json.dumps(BERT))
    assert len(_specs("--model", str(path))) == len(specs)
    assert "LayerNorms only" in capsys.readouterr().out


def test_t5_warms_its_rmsnorms():
    """Catches a T5 config failing on num_heads (T5's name for the head count): its
    T5LayerNorm is an RMSNorm, which patch swaps; nothing else of it is warmed."""
    specs, left_out = model_plan(T5, "bf16")
    assert {s.kernel.split("_")[0] for s in specs} == {"rmsnorm", "column"}
    norms = [s for s in specs if s.kernel != "column_sum"]
    assert norms and all(s["N"] == 512 and s.kwargs.get("eps", 1e-6) == 1e-6 for s in norms)
    assert "RMSNorms only" in left_out


def test_unknown_family_is_refused_in_one_line(tmp_path):
    """Catches a config patch would swap nothing in warmed anyway (as a Llama) and exiting 0:
    one line on stderr and exit 2."""
    path = tmp_path / "vit.json"
    path.write_text(json.dumps(dict(model_type="vit", hidden_size=768, num_attention_heads=12,
                                    intermediate_size=3072, layer_norm_eps=1e-12)))  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "kbuild", "warmup", "--model", str(path)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2, run
    assert len(run.stderr.strip().splitlines()) == 1 and "'vit'" in run.stderr


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_model_warms_the_rope_a_patched_model_launches(monkeypatch, autocast):
    """Catches --model warming RoPE with another cos / sin dtype than the model's rotary
    module gives (bf16 weights: bf16 cos / sin; fp32 weights under bf16 autocast: fp32 cos /
    sin with bf16 q and k): every rope kernel a patched Llama's training step asks for, by
    the tensors it really passes, is in model_specs of its config."""
    hf = pytest.importorskip("transformers")
    asked = []
    real = rope_ops.rope

    def spy(q, k, cos, sin, interleaved=False, unsqueeze_dim=1):
        asked.extend(rope_ops.specs_for(q, k, cos, sin, interleaved, unsqueeze_dim))
        asked.append(("cos", cos.dtype, q.dtype))
        return real(q, k, cos, sin, interleaved, unsqueeze_dim)

    monkeypatch.setattr(rope_ops, "rope", spy)
    stock = hf_model(hf, "llama")
    model = copy.deepcopy(stock if autocast else stock.to(torch.bfloat16))
    kbuild_patch = importlib.import_module("kbuild.nn.patching").patch
    assert kbuild_patch(model).paths("rope")
    asked.clear()
    ids = _ids()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        model(input_ids=ids, labels=ids).loss.backward()
    seen = {a for a in asked if isinstance(a, tuple)}
    want = torch.float32 if autocast else torch.bfloat16
    assert seen == {("cos", want, torch.bfloat16)}, seen
    specs = set(model_specs(model.config.to_dict(), "bf16"))
    launched = [s for s in asked if not isinstance(s, tuple)]
    assert launched and not [s.short() for s in launched if s not in specs]
