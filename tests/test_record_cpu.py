"""KBUILD_RECORD and the warmup sources built on it (`--from FILE`, `--hidden N`), on CPU.

A CPU run of the API cannot ask for CUDA kernels, so recording is driven through the memory
tier (jit.get_launcher, where every request of the launch path arrives) and, for widths,
through a training step replayed with tensors posing as CUDA (launch_recorder). What this
catches: a miss not recorded (above all an offline one, which raises), a file with
duplicates or torn lines when processes record at once, a recorded spec that warms a
different kernel, and a width warmup that leaves out a kernel a training step launches.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

import kbuild
from kbuild import cli, jit, record
from kbuild.cli.widths import for_width
from kbuild.kernels.norms.kernels import LAYERNORM_FWD, RMSNORM_BWD, RMSNORM_FWD
from kbuild.targets import target_for_arch

from .launch_recorder import Tier, install, pretend_cuda

SPECS = [RMSNORM_FWD.spec(N, "bf16", "bf16", True, 1e-6) for N in (64, 128, 768)]


@pytest.fixture
def record_file(tmp_path, monkeypatch):
    path = tmp_path / "record.jsonl"
    monkeypatch.setenv(record.RECORD_ENV, str(path))
    monkeypatch.setattr(record, "_seen", set())
    return path


@pytest.mark.not_interpreted
def test_an_offline_miss_is_recorded_before_it_raises(record_file, monkeypatch):
    def missing(spec, target):
        raise jit.KernelNotCached(f"{spec.short()} is not cached")

    monkeypatch.setattr(jit, "artifact_for", missing)
    monkeypatch.setattr(jit, "device_target", lambda device: target_for_arch("sm_90"))
    monkeypatch.setattr(jit, "_loaded", jit.MemoryCache())
    monkeypatch.setattr(jit, "loaded", jit._loaded.get)
    for spec in (*SPECS, SPECS[0]):  # the repeat is written once
        with pytest.raises(jit.KernelNotCached):
            jit.get_launcher(("k", spec.canonical_json(), 0), 0, lambda spec=spec: spec)
    lines = record_file.read_text().splitlines()
    assert lines == [s.canonical_json() for s in SPECS]
    assert record.read_specs(str(record_file)) == SPECS


def test_switching_the_record_file_records_there_too(record_file, monkeypatch):
    """Catches a dedupe set global across files (or a path read once per process): a spec
    recorded to one KBUILD_RECORD file, then the variable pointed at a second file within
    the process, must be written to the second file too, and once to each."""
    second = record_file.with_name("second.jsonl")
    record.record(SPECS[0])
    monkeypatch.setenv(record.RECORD_ENV, str(second))
    for spec in (SPECS[0], SPECS[1], SPECS[0]):
        record.record(spec)
    monkeypatch.setenv(record.RECORD_ENV, str(record_file))
    record.record(SPECS[0])  # back to the first: already there
    assert record.read_specs(str(record_file)) == [SPECS[0]]
    assert len(record_file.read_text().splitlines()) == 1
    assert second.read_text().splitlines() == [s.canonical_json() for s in SPECS[:2]]


WRITER = """
import sys
from kbuild import record
from kbuild.kernels.norms.kernels import RMSNORM_FWD
mine = int(sys.argv[1])
for N in (64, 128, 768, 1000 + mine):
    for _ in range(3):
        record.record(RMSNORM_FWD.spec(N, "bf16", "bf16", True, 1e-6))
"""


def test_processes_recording_at_once_write_each_spec_once(record_file, subprocess_env):
    env = {**subprocess_env, record.RECORD_ENV: str(record_file)}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(k)], env=env) for k in range(6)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    lines = record_file.read_text().splitlines()
    assert len(lines) == len(set(lines)) == 3 + 6  # shared three, one of each process
    Ns = sorted(json.loads(line)["params"]["N"] for line in lines)
    assert Ns == [64, 128, 768, *range(1000, 1006)]


def test_a_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(SPECS[0].canonical_json() + "\n\n{not json\n")
    with pytest.raises(ValueError, match=r"r.jsonl:3: not a kernel spec"):
        record.read_specs(str(path))


def test_warmup_from_a_record_compiles_exactly_what_it_holds(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    wanted = [SPECS[0], RMSNORM_BWD.spec(64, "bf16", "bf16", True)]
    path.write_text("".join(s.canonical_json() + "\n" for s in (*wanted, wanted[0])))
    assert (
        cli.main(["warmup", "--from", str(path), "--cache-dir", str(tmp_path / "c"), "-j", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.count(" compiled ") == 2 and "2 kernels for sm_90" in out
    assert "rmsnorm_bwd(N=64" in out and "rmsnorm_fwd(N=64" in out


def test_warmup_from_a_missing_file_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["warmup", "--from", str(tmp_path / "nope.jsonl")]) == 1
    assert re.fullmatch(r"kbuild warmup: --from .*nope.jsonl: .*\n", capsys.readouterr().err)


# --- --hidden: every kernel of a training and an inference step at a width ------------------


def _steps(N, dtype, wdtype):
    """A training step and an inference call of every op at width N, as a model makes them."""
    t = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
    x = torch.randn(6, N, dtype=t[dtype], requires_grad=True)
    r = torch.randn(6, N, dtype=t[dtype], requires_grad=True)
    w = torch.randn(N, dtype=t[wdtype], requires_grad=True)
    b = torch.randn(N, dtype=t[wdtype], requires_grad=True)
    out, res = kbuild.fused_add_rmsnorm(x, r, w)
    loss = kbuild.rmsnorm(x, w).sum() + kbuild.layernorm(x, w, b).sum() + (out + res).sum()
    loss.backward()
    with torch.no_grad():
        kbuild.rmsnorm(x, w), kbuild.layernorm(x, w, b), kbuild.fused_add_rmsnorm(x, r, w)
    w.requires_grad_(False)  # a frozen weight (fine-tuning): the backward without dw
    kbuild.rmsnorm(x, w).sum().backward()


@pytest.mark.parametrize("N, dtype, wdtype", [(768, "bf16", None), (4096, "f16", "f32")])
def test_width_warmup_covers_a_training_step(monkeypatch, N, dtype, wdtype):
    tier = Tier()
    install(monkeypatch, tier.get_launcher, tier.loaded)
    pretend_cuda(monkeypatch)
    _steps(N, dtype, wdtype or dtype)
    asked = set(tier.specs)
    warmed = set(for_width(N, dtype, wdtype))
    assert asked <= warmed, sorted(s.short() for s in asked - warmed)
    assert {s.kernel for s in asked} == {s.kernel for s in warmed}  # nothing warmed in vain


def test_width_warmup_on_the_command_line(capsys, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "warmup", lambda specs, arch, root, jobs, **_: seen.extend(specs))
    argv = ["warmup", "--hidden", "2048", "--dtype", "bf16", "--weight-dtype", "f32"]
    assert cli.main([*argv, "--ops", "layernorm", "--cache-dir", str(tmp_path)]) == 0
    assert seen == for_width(2048, "bf16", "f32", ("layernorm",))
    assert {s.kernel for s in seen} == {"layernorm_fwd", "layernorm_bwd", "column_sum"}
    assert LAYERNORM_FWD.spec(2048, "bf16", "f32", "f32", True, 1e-5) in seen
    assert cli.main(["warmup", "--hidden", "64", "--ops", "softmax"]) == 2
    assert "ops must be among" in capsys.readouterr().err


def test_width_warmup_covers_a_gemma_step_with_an_fp32_stream(monkeypatch):
    """--rms-offset 1.0 --residual-fp32 warms what a Gemma-style stack with an fp32 residual
    stream launches: offset kernels, the stream's first layer (a bf16 residual made fp32) and
    its later layers (the fp32 stream as the residual, its gradient in fp32)."""
    tier = Tier()
    install(monkeypatch, tier.get_launcher, tier.loaded)
    pretend_cuda(monkeypatch)
    N = 2048
    x = torch.randn(6, N, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, dtype=torch.bfloat16, requires_grad=True)
    out, stream = kbuild.fused_add_rmsnorm(x, x, w, residual_in_fp32=True, offset=1.0)
    out, stream = kbuild.fused_add_rmsnorm(out, stream, w, offset=1.0)
    (kbuild.rmsnorm(out, w, offset=1.0).float().sum() + stream.sum()).backward()
    asked = set(tier.specs)
    warmed = set(for_width(N, "bf16", ops=("rmsnorm", "fused_add_rmsnorm"), residual_fp32=True,
                           rms_offset=1.0))  # fmt: skip
    assert asked <= warmed, sorted(s.short() for s in asked - warmed)
    assert any(s.kwargs.get("dresidual_dtype") == "f32" for s in asked)
    assert all(s.kwargs.get("offset") == 1.0 for s in asked if s.kernel != "column_sum")
    seen = []
    monkeypatch.setattr(cli, "warmup", lambda specs, arch, root, jobs, **_: seen.extend(specs))
    argv = ["warmup", "--hidden", "2048", "--ops", "rmsnorm,fused_add_rmsnorm"]
    assert cli.main([*argv, "--residual-fp32", "--rms-offset", "1.0"]) == 0
    assert set(seen) == warmed


def test_width_warmup_covers_a_qk_norm(monkeypatch, capsys):
    """--head-dim 128 warms a QK-norm's kernels as a Qwen3-style block launches them: the
    q and k views of a fused qkv projection (read in place, strided kernels) and separate
    projections (dense rows), training and inference. Without it, none of them is warmed."""
    tier = Tier()
    install(monkeypatch, tier.get_launcher, tier.loaded)
    pretend_cuda(monkeypatch)
    T, H, D = 6, 4, 128
    qkv = torch.randn(T, 3 * H * D, dtype=torch.bfloat16, requires_grad=True)
    heads = qkv.view(T, 3, H, D)
    w = torch.randn(D, dtype=torch.bfloat16, requires_grad=True)
    dense = torch.randn(T, H, D, dtype=torch.bfloat16, requires_grad=True)
    loss = sum(kbuild.rmsnorm(x, w).float().sum() for x in (heads[:, 0], heads[:, 1], dense))
    loss.backward()
    with torch.no_grad():
        kbuild.rmsnorm(heads[:, 0], w), kbuild.rmsnorm(dense, w)
    asked = set(tier.specs)
    assert any(s.kwargs.get("strided") for s in asked)
    warmed = set(for_width(2048, "bf16", ops=("rmsnorm",), head_dim=D))
    assert asked <= warmed, sorted(s.short() for s in asked - warmed)
    assert not asked & set(for_width(2048, "bf16", ops=("rmsnorm",)))
    seen = []
    monkeypatch.setattr(cli, "warmup", lambda specs, arch, root, jobs, **_: seen.extend(specs))
    assert cli.main(["warmup", "--hidden", "2048", "--ops", "rmsnorm", "--head-dim", "128"]) == 0
    assert set(seen) == warmed
    assert cli.main(["warmup", "--head-dim", "128"]) == 2
    assert "--head-dim goes with --hidden" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # argparse: the type check, exit 2
        cli.main(["warmup", "--hidden", "2048", "--head-dim", "0"])
    assert usage.value.code == 2
    assert "--head-dim: expected a positive integer, got '0'" in capsys.readouterr().err
