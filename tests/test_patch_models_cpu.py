"""bench/patch_models.py without a GPU (`--device cpu --tiny`): one worker process per model and
variant, the fragments merged into patch_models.json (and kept across runs), stock's and
kbuild's loss curves from the same weights on the same batches, kbuild's report recorded,
Liger's absence recorded as an error, the longest-sequence search stopping at an out-of-memory
step, and the config files `kbuild warmup --model` reads."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from bench import patch_models as pm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "patch_models.py"
NAMES = ("llama3-8b-l2", "gpt2-124m")
TINY = ["--device", "cpu", "--tiny", "--modes", "eager", "--warmup", "1", "--steps", "3"]


def _run(out: Path, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), *TINY, *args],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kbuild/stock" in proc.stdout  # the table
    return json.loads((out / "patch_models.json").read_text())


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    out = tmp_path_factory.mktemp("patch_models")
    first = _run(out, "--models", ",".join(NAMES), "--variants", "stock,liger,kbuild",
                 "--longest-cap", "32")  # fmt: skip
    # a second run of one variant of one model: the rest of the first run's results stay
    second = _run(out, "--models", "gpt2-124m", "--variants", "liger,stock", "--rounds", "2")
    return out, first, second


def test_both_variants_same_steps_and_curves(merged):
    """Catches a variant missing from the merge, runs of different lengths, a variant started
    from other weights or batches, and kbuild's loss drifting from stock's (fp32)."""
    _, result, _ = merged
    assert set(result["models"]) == set(NAMES)
    for name in NAMES:
        entry = result["models"][name]
        stock = entry["variants"]["stock"]["modes"]["eager"]
        ours = entry["variants"]["kbuild"]["modes"]["eager"]
        assert "error" not in stock and "error" not in ours, (stock, ours)
        assert len(stock["losses"]) == len(ours["losses"]) == 4  # 1 warm-up + 3 timed
        assert len(stock["ms_steps"]) == 3 and stock["ms_per_step"] > 0
        assert stock["init_sum"] == ours["init_sum"]
        assert len(set(stock["losses"])) > 1  # the curve moves
        for a, b in zip(ours["losses"], stock["losses"], strict=True):
            assert abs(a - b) <= 1e-3 * abs(b), (ours["losses"], stock["losses"])
        assert entry["loss_rel_diff"]["eager"]["kbuild"] <= 1e-3
        assert entry["ratios"]["eager"]["kbuild/stock"]["ms"] > 0
        assert entry["batch"] == [2, 32]


def test_report_recorded(merged):
    _, result, _ = merged
    llama = result["models"]["llama3-8b-l2"]["variants"]["kbuild"]["report"]
    gpt2 = result["models"]["gpt2-124m"]["variants"]["kbuild"]["report"]
    assert llama.startswith("kbuild.nn.patch(LlamaForCausalLM)")
    for text in ("norm", "RMSNorm", "swiglu", "rope", "linear_cross_entropy"):
        assert text in llama, llama
    for text in ("LayerNorm", "gelu", "linear_cross_entropy"):
        assert text in gpt2, gpt2
    assert "report" not in result["models"]["llama3-8b-l2"]["variants"]["stock"]


def test_liger_recorded_as_error_or_skipped(merged):
    """Without a GPU Liger-Kernel does not run: its variant carries an error (the import's, or
    each mode's) and no timings; GPT-2 has no Liger patch at all."""
    _, result, _ = merged
    llama = result["models"]["llama3-8b-l2"]["variants"].get("liger")
    if llama is not None:
        modes = llama.get("modes", {})
        assert "error" in llama or all("error" in row for row in modes.values()), llama
    gpt2 = result["models"]["gpt2-124m"]["variants"]["liger"]
    assert gpt2["error"].startswith("NotImplementedError: not supported"), gpt2


def test_second_run_merges(merged):
    out, first, second = merged
    assert set(second["models"]) == set(NAMES)
    assert second["models"]["llama3-8b-l2"] == first["models"]["llama3-8b-l2"]
    assert set(second["models"]["gpt2-124m"]["variants"]) == {"stock", "liger", "kbuild"}
    rounds = second["models"]["gpt2-124m"]["variants"]["stock"]["modes"]["eager"]
    assert (
        len(rounds["ms_per_step_rounds"]) == 2
        and rounds["ms_per_step"] in rounds["ms_per_step_rounds"]
    )
    for name in NAMES:
        for variant in ("stock", "kbuild"):
            assert (out / "patch_models" / f"{name}.{variant}.json").exists()
            assert (out / "patch_models" / f"{name}.{variant}.log").exists()


def test_longest_search_in_the_run(merged):
    _, result, _ = merged
    for variant in ("stock", "kbuild"):
        longest = result["models"]["llama3-8b-l2"]["variants"][variant]["longest"]
        assert longest["longest"] == 32 and set(longest["lengths"]) == {"16", "32"}, longest
    assert "longest" not in result["models"]["gpt2-124m"]["variants"]["stock"]


def test_merge_keeps_modes_of_earlier_runs():
    """Catches a run of one mode wiping another mode's results, or the longest-sequence search,
    of an earlier run of the same model and variant."""
    entry = {"variants": {"kbuild": {"modes": {"eager": {"ms_per_step": 2.0}},
                                     "longest": {"longest": 65536}}}}  # fmt: skip
    pm._merge(entry, "kbuild", {"modes": {"compile": {"ms_per_step": 1.5}}, "report": "r"})
    merged = entry["variants"]["kbuild"]
    assert set(merged["modes"]) == {"eager", "compile"} and merged["report"] == "r"
    assert merged["longest"] == {"longest": 65536}
    pm._merge(entry, "kbuild", {"modes": {"eager": {"error": "x"}}, "longest": {"longest": 2}})
    assert merged is not entry["variants"]["kbuild"]
    assert entry["variants"]["kbuild"]["modes"]["eager"] == {"error": "x"}
    assert entry["variants"]["kbuild"]["modes"]["compile"] == {"ms_per_step": 1.5}
    assert entry["variants"]["kbuild"]["longest"] == {"longest": 2}
    pm._summarise(entry)
    assert entry["ratios"]["compile"]["kbuild/stock"] == {"ms": None, "peak": None}


def test_rounds_keep_the_median_round_per_mode():
    """Catches `--rounds` keeping the last or the first round instead of the median one, a
    round's other figures mixed with another round's time, or an errored round counted."""
    rounds = [
        {"modes": {"eager": {"ms_per_step": 5.0, "peak_gib": 1}}, "longest": {"longest": 8}},
        {"modes": {"eager": {"ms_per_step": 3.0, "peak_gib": 2}, "compile": {"error": "x"}}},
        {"modes": {"eager": {"ms_per_step": 4.0, "peak_gib": 3},
                   "compile": {"ms_per_step": 1.0}}},
    ]  # fmt: skip
    record = pm._rounds(rounds)
    assert record["modes"]["eager"] == {"ms_per_step": 4.0, "peak_gib": 3,
                                        "ms_per_step_rounds": [5.0, 3.0, 4.0]}  # fmt: skip
    assert record["modes"]["compile"] == {"ms_per_step": 1.0, "ms_per_step_rounds": [None, 1.0]}
    assert record["longest"] == {"longest": 8}


def _args(**kw) -> argparse.Namespace:
    base = dict(model="llama3-8b-l2", variant="stock", device="cpu", tiny=True, warmup=1,
                steps=1, backend="", longest_start=16, longest_cap=256)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_longest_stops_at_out_of_memory(monkeypatch):
    """Catches an out-of-memory step that ends the worker instead of the search, a search that
    goes on past it or records the failed length as trained, and another failure (a kernel
    missing from an offline cache) losing the lengths already trained."""
    step = pm._one_step

    def one_step(model, opt, ids):
        if ids.shape[1] >= 64:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")
        return step(model, opt, ids)

    monkeypatch.setattr(pm, "_one_step", one_step)
    out = pm._Worker(_args()).longest()
    assert out["longest"] == 32
    assert list(out["lengths"]) == ["16", "32", "64"]
    assert out["lengths"]["64"]["oom"].startswith("OutOfMemoryError")

    def other_failure(model, opt, ids):
        if ids.shape[1] >= 32:
            raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx")
        return step(model, opt, ids)

    monkeypatch.setattr(pm, "_one_step", other_failure)
    out = pm._Worker(_args()).longest()
    assert out["longest"] == 16
    assert out["lengths"]["32"] == {
        "error": "RuntimeError: CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"
    }


def test_written_configs_are_warmup_inputs(tmp_path):
    """Catches a config file `kbuild warmup --model` cannot read (fields left out as defaults,
    a family kbuild's model specs do not know)."""
    from kbuild.cli.model_specs import config_specs, read_config

    pm.write_configs(str(tmp_path), list(pm.MODELS), tiny=False)
    for name, (family, _, _, fields) in pm.MODELS.items():
        path = str(tmp_path / f"{name}.json")
        config = read_config(path)
        assert config["vocab_size"] == fields["vocab_size"]
        assert config["model_type"] == ("gemma3_text" if family == "gemma3" else family)
        assert config_specs(path, "bf16")
