"""The GPT-2 example's CPU quick start (README: `python3 examples/train_gpt2.py --model tiny
--device cpu`): a short run by default, and a run that trains, kbuild's model step for step
the same as torch's."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from .conftest import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "train_gpt2.py"


def _example():
    spec = importlib.util.spec_from_file_location("train_gpt2_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cpu_quick_start_is_short_by_default():
    """Catches the README's CPU command running the GPU's 300 steps (about 20 minutes on 2
    cores, each step of both models about 2.3 s): on a CPU the default is at most 25 steps
    (a minute); on a GPU, and where --steps is given, nothing changes."""
    example = _example()
    cpu = example.parse_args(["--model", "tiny", "--device", "cpu"])
    assert 10 <= cpu.steps <= 25 and cpu.steps == example.STEPS["cpu"]
    assert 1 < cpu.log_every < cpu.steps  # a handful of lines, the loss seen going down
    assert example.parse_args(["--device", "cuda"]).steps == 300
    assert example.parse_args(["--device", "cuda"]).log_every == 25
    assert example.parse_args(["--device", "cpu", "--steps", "7"]).steps == 7


def test_the_cpu_default_is_the_tiny_model():
    """Catches `--device cpu` alone picking the 124M model (minutes per step, nothing printed
    for the first of them): the tiny model there, 124M on a GPU."""
    example = _example()
    assert example.parse_args(["--device", "cpu"]).model == "tiny"
    assert example.parse_args(["--device", "cuda"]).model == "gpt2-124m"
    assert example.parse_args(["--device", "cpu", "--model", "gpt2-124m"]).model == "gpt2-124m"


def test_a_short_cpu_run_trains(subprocess_env, tmp_path):
    """Catches a quick start whose loss does not go down in its few steps (a warm-up longer
    than the run, a learning rate of zero), or where kbuild's model and torch's part ways."""
    out = tmp_path / "run.json"
    command = [sys.executable, str(EXAMPLE), "--model", "tiny", "--device", "cpu"]
    result = subprocess.run(
        [*command, "--steps", "6", "--batch", "2", "--json", str(out)],
        env=subprocess_env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "final loss" in result.stdout and "step    5" in result.stdout, result.stdout
    results = json.loads(out.read_text())["results"]
    ours, theirs = results["kbuild"]["losses"], results["torch"]["losses"]
    assert len(ours) == 6 and ours[-1] < ours[0] - 0.5, ours
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3
