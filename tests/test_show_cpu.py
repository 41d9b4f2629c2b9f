"""`kbuild show` and KBUILD_DUMP_DIR: what a kernel became, stage by stage.

What this catches: a label that does not parse back to its spec (the round trip users make
when pasting a warmup line), a stage printed for the wrong target, and a dump directory that
misses a stage or holds a binary other than the cached one.
"""

from __future__ import annotations

import json

import pytest

from kbuild import cli, compiler
from kbuild.cli.manifest import manifest
from kbuild.cli.show import parse_spec
from kbuild.targets import target_for_arch

LABEL = (
    "rmsnorm_fwd(N=256, dtype=bf16, eps=1e-06, store_rstd=True, vectorize=True, weight_dtype=bf16)"
)


def test_every_manifest_label_parses_back_to_its_spec():
    for spec in manifest("tests"):
        assert parse_spec(spec.short()) == spec
        assert parse_spec(spec.canonical_json()) == spec


def test_bad_specs_say_why():
    with pytest.raises(ValueError, match="unknown kernel 'nope'"):
        parse_spec("nope(N=1)")
    with pytest.raises(ValueError, match="a spec is JSON or name"):
        parse_spec("rmsnorm_fwd")


@pytest.mark.parametrize(
    "arch, flag, marker",
    [
        ("sm_90", "--mlir", "gpu.module"),
        ("sm_90", "--llvm", "llvm.func"),
        ("sm_90", "--ptx", ".target sm_90"),
        ("gfx942", "--llvm", 'target triple = "amdgcn-amd-amdhsa"'),
        ("gfx942", "--asm", ".amdgcn_target"),
    ],
)
def test_show_prints_the_stage(capsys, arch, flag, marker):
    if arch.startswith("gfx"):
        pytest.importorskip("llvmlite")
    assert cli.main(["show", LABEL, "--arch", arch, flag]) == 0
    assert marker in capsys.readouterr().out


def test_every_kernel_kbuild_ships_is_known_without_module(subprocess_env):
    """In a fresh process (no op imported), kernels declared beside their builders are known
    by name: `kbuild show 'cross_entropy_fwd(...)'` answered "unknown kernel" without
    `--module kbuild.kernels.loss.cross_entropy`."""
    import subprocess
    import sys

    from kbuild.registry import OWN_MODULES

    assert "kbuild.kernels.softmax.kernels" in OWN_MODULES
    labels = (
        "cross_entropy_fwd(N=1000, dtype=bf16, index_dtype=i32)",
        "softmax_fwd(N=1000, dtype=f32)",
        "rope(D=64, rd=64, dtype=bf16, cs_dtype=bf16)",
    )
    for label in labels:
        command = [sys.executable, "-m", "kbuild", "show", label, "--mlir"]
        done = subprocess.run(
            command, env=subprocess_env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0 and "gpu.module" in done.stdout, (label, done.stderr[-500:])


def test_show_errors_go_to_stderr(capsys):
    assert cli.main(["show", "nope(N=1)"]) == 2
    captured = capsys.readouterr()
    assert "unknown kernel" in captured.err and captured.out == ""


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_dump_dir_holds_every_stage(tmp_path, monkeypatch, arch):
    if arch.startswith("gfx"):
        pytest.importorskip("llvmlite")
    monkeypatch.setenv("KBUILD_DUMP_DIR", str(tmp_path))
    spec = parse_spec(LABEL)
    artifact = compiler.compile_kernel(spec, target_for_arch(arch))
    (directory,) = tmp_path.iterdir()
    names = {p.name for p in directory.iterdir()}
    binary = f"kernel.{artifact.format}"
    stage = "kernel.ptx" if arch == "sm_90" else "kernel.ll"
    assert {"spec.json", "kernel.mlir", stage, binary, "meta.json"} <= names
    assert (directory / binary).read_bytes() == artifact.binary
    assert json.loads((directory / "spec.json").read_text()) == json.loads(spec.canonical_json())
