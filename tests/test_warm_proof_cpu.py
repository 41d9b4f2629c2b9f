"""The warm list of a model (`kbuild warmup --model CONFIG`, kbuild.cli.model_specs) holds every
kernel `kbuild.nn.patch` launches in that model, its swap checks included: proven by running
the patched model's training step and inference forward on the interpreter (KBUILD_INTERPRET)
with KBUILD_RECORD on. An offline user who warmed with `--model` then gets no KernelNotCached
(on an H100, 2026-12-07, the checks' fp32 probes and Llama-3's inference forward at eps 1e-5
were missing)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kbuild.cli.model_specs import model_specs
from kbuild.spec import KernelSpec

pytest.importorskip("mlir")
pytest.importorskip("transformers")

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "gpt2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_model_warm_list_holds_what_patch_launches(family, tmp_path, subprocess_env):
    record, config = tmp_path / "record.jsonl", tmp_path / "config.json"
    env = dict(subprocess_env, KBUILD_INTERPRET="1", KBUILD_RECORD=str(record))
    done = subprocess.run(
        [sys.executable, "-m", "tests.warm_proof", family, str(config)],
        cwd=subprocess_env["PYTHONPATH"].split(":")[0],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    launched = {
        KernelSpec.from_json(json.loads(line)) for line in record.read_text().splitlines() if line
    }
    assert launched, "the interpreted run launched no kernel"
    warmed = set(model_specs(json.loads(config.read_text()), "bf16"))
    missing = sorted(s.short() for s in launched - warmed)
    assert not missing, f"--model misses {len(missing)} of {len(launched)}: {missing}"
