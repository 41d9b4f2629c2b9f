"""The device's warm lists hold what the device ran. tests/launched/ keeps every kernel spec
that the GPU test suite and bench/gpu_checks.sh's steps asked for on an H100 (KBUILD_RECORD,
2026-12-07, the tree at 42d94c7; gpu_tests: 1334 passed from the carried cache with
KBUILD_OFFLINE=1; patch_models' compiled Qwen3 at 430f1fd added one). Each must be in what
bench/gpu_prepare.sh warms: `--manifest tests` and `bench`, its modules' warmup_specs() and
`warmup --model` of bench/patch_models.py's configs.
A kernel a GPU test or a step starts launching, that the warm lists lack, then fails here on a
CPU, not as KernelNotCached on the device. Records are re-taken by any device run of
gpu_checks.sh (its $OUT/launched/)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDS = {
    "gpu_tests": ROOT / "tests/launched/gpu_tests_h100_2026-12-07.jsonl",
    "gpu_checks": ROOT / "tests/launched/gpu_checks_h100_2026-12-07.jsonl",
}


def _prepared_modules() -> list[str]:
    """gpu_prepare.sh's `modules=(...)`, as the script lists them."""
    text = (ROOT / "bench/gpu_prepare.sh").read_text()
    found = re.search(r"^modules=\((.*?)\)", text, re.S | re.M)
    assert found, "bench/gpu_prepare.sh no longer lists its modules as modules=(...)"
    return found.group(1).split()


# In a child process: the modules register kernels of their own (examples, bench scripts).
WARMED = """
import json, os, sys, tempfile
sys.path.insert(0, ".")
from kbuild.cli import _module_specs
from kbuild.cli.manifest import manifest
from kbuild.cli.model_specs import config_plan
sys.path.insert(0, "bench")
import patch_models

specs = set(manifest("tests")) | set(manifest("bench"))
for name in json.loads(sys.argv[1]):
    specs |= set(_module_specs(name))
configs = tempfile.mkdtemp()
patch_models.write_configs(configs, list(patch_models.MODELS), False)
for name in sorted(os.listdir(configs)):
    specs |= set(config_plan(os.path.join(configs, name), "bf16")[0])
print(json.dumps(sorted(s.canonical_json() for s in specs)))
"""


@pytest.fixture(scope="module")
def warmed(subprocess_env) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", WARMED, json.dumps(_prepared_modules())],
        cwd=ROOT, env=subprocess_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("run", sorted(RECORDS))
def test_gpu_prepare_warms_what_the_device_launched(run, warmed):
    from kbuild.record import read_specs

    launched = {s.canonical_json() for s in read_specs(str(RECORDS[run]))}
    assert len(launched) > 40  # a record, not an empty file
    missing = sorted(launched - warmed)
    assert not missing, f"{len(missing)} launched by {run} but not warmed, e.g. {missing[:3]}"
