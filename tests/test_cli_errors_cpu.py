"""The command line as a user meets it, run as a subprocess: every error is one line on stderr
naming the argument and what was expected, with a non-zero status (2: the arguments are wrong,
1: they are right and the work failed), never a traceback; a command that could not do what
was asked does not exit 0; the help says what each option does and its true default."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kbuild

COLUMN_SUM = json.dumps({"kernel": "column_sum", "params": {"N": 1024, "out_dtype": "bf16"}})
RMS_LABEL = (
    "rmsnorm_fwd(N=64, dtype=bf16, eps=1e-06, store_rstd=True, vectorize=True, weight_dtype=bf16)"
)


def kbuild_cli(*args: str, env: dict | None = None, cwd: Path | None = None):
    return subprocess.run(
        [sys.executable, "-m", "kbuild", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_error(run, code: int, *words: str) -> str:
    """`run` failed with `code`, printing one line on stderr (and nothing on stdout) that
    starts with the command's name and holds each of `words`."""
    assert run.returncode == code, (run.returncode, run.stdout, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("kbuild"), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert run.stdout == "", run.stdout
    return lines[0]


@pytest.fixture
def env(subprocess_env, tmp_path):
    """The child's environment, with a cache of its own (an empty folder)."""
    (tmp_path / "cache").mkdir()
    return {**subprocess_env, "KBUILD_CACHE_DIR": str(tmp_path / "cache")}


@pytest.mark.parametrize("value", ["0", "-5", "x"])
def test_hidden_must_be_a_positive_width(env, value):
    # 0 once ended in ZeroDivisionError, -5 in IndexError, deep in the plan chooser
    run = kbuild_cli("warmup", "--hidden", value, env=env)
    line = assert_error(run, 2, "kbuild warmup:", "--hidden", "positive integer", repr(value))
    assert line.endswith("(see kbuild warmup --help)")


@pytest.mark.parametrize("option", ["-j", "--head-dim"])
def test_jobs_and_head_dim_must_be_positive(env, option):
    run = kbuild_cli("warmup", "--hidden", "64", option, "0", env=env)
    assert_error(run, 2, "kbuild warmup:", option, "expected a positive integer, got '0'")


def test_head_dim_alone_names_what_it_needs(env):
    run = kbuild_cli("warmup", "--head-dim", "128", env=env)
    assert_error(run, 2, "kbuild warmup: --head-dim goes with --hidden")


def test_warmup_with_nothing_to_do_fails(env):
    assert_error(kbuild_cli("warmup", env=env), 2, "nothing to warm", "--manifest", "--hidden")


def test_a_cache_dir_that_is_a_file(env, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    for args in (
        ("warmup", "--spec", COLUMN_SUM, "--cache-dir", str(afile)),
        ("cache", "info", "--cache-dir", str(afile)),
        ("cache", "list", "--cache-dir", str(afile)),
    ):
        run = kbuild_cli(*args, env=env)
        assert_error(run, 2, "--cache-dir", str(afile), "is not a folder")
    run = kbuild_cli("cache", "info", env={**env, "KBUILD_CACHE_DIR": str(afile)})
    assert_error(run, 2, "$KBUILD_CACHE_DIR", "is not a folder")


@pytest.mark.parametrize("action", ["info", "list", "prune --stale"])
def test_a_missing_cache_is_an_error_not_zero_entries(env, tmp_path, action):
    missing = tmp_path / "nowhere"
    run = kbuild_cli("cache", *action.split(), "--cache-dir", str(missing), env=env)
    assert_error(run, 1, f"kbuild cache {action.split()[0]}:", f"no cache at {missing}")
    assert not missing.exists()


def test_cache_list_takes_no_file(env):
    run = kbuild_cli("cache", "list", "FILE", env=env)
    assert_error(run, 2, "kbuild cache list: unrecognized arguments: FILE")


def test_export_into_a_missing_folder(env, tmp_path):
    target = tmp_path / "nonexistent" / "dir" / "x.tar.gz"
    run = kbuild_cli("cache", "export", str(target), env=env)
    assert_error(run, 2, "kbuild cache export: FILE", f"{target.parent} does not exist")


def test_export_checks_its_arch(env, tmp_path):
    run = kbuild_cli("cache", "export", str(tmp_path / "x.tar"), "--arch", "nope", env=env)
    assert_error(run, 2, "kbuild cache export: --arch", "'nope'", "sm_90", "gfx942")
    assert not (tmp_path / "x.tar").exists()


def test_export_of_nothing_fails_and_writes_nothing(env, tmp_path):
    run = kbuild_cli("cache", "export", str(tmp_path / "x.tar"), "--arch", "sm_80", env=env)
    assert_error(run, 1, "no entries for sm_80", "nothing exported")
    assert not (tmp_path / "x.tar").exists()


def test_import_of_a_missing_bundle(env, tmp_path):
    run = kbuild_cli("cache", "import", str(tmp_path / "none.tar.gz"), env=env)
    assert_error(run, 1, "kbuild cache import: refused", "none.tar.gz")


def test_a_ptxas_that_is_not_there(env):
    bad = {**env, "KBUILD_PTXAS": "/nonexistent/ptxas"}
    for jobs in ("1", "2"):  # in process, and from a worker process
        run = kbuild_cli("warmup", "--spec", COLUMN_SUM, "-j", jobs, env=bad)
        assert_error(run, 1, "kbuild warmup: KBUILD_PTXAS=/nonexistent/ptxas", "not an executable")


def test_sass_without_the_tools_fails(env, tmp_path):
    bare = {**env, "PATH": str(tmp_path), "CUDA_HOME": str(tmp_path)}  # no ptxas, no cuobjdump
    run = kbuild_cli("show", RMS_LABEL, "--sass", env=bare)
    assert_error(run, 1, "kbuild show: --sass needs ptxas and cuobjdump or nvdisasm")


@pytest.mark.parametrize("stage", ["--ptx", "--sass"])
def test_nvidia_stages_of_an_amd_arch_fail(env, stage):
    pytest.importorskip("llvmlite")
    run = kbuild_cli("show", RMS_LABEL, stage, "--arch", "gfx942", env=env)
    assert_error(run, 2, f"kbuild show: {stage} is NVIDIA's", "--asm")


def test_show_names_an_unknown_kernel(env):
    assert_error(kbuild_cli("show", "nope(N=1)", env=env), 2, "SPEC: unknown kernel 'nope'")


def test_version(env):
    run = kbuild_cli("--version", env=env)
    assert run.returncode == 0 and run.stdout == f"kbuild {kbuild.__version__}\n"


def test_each_cache_action_has_its_own_help(env):
    prune = kbuild_cli("cache", "prune", "--help", env=env)
    assert prune.returncode == 0 and "usage: kbuild cache prune" in prune.stdout
    assert "--max-size" in prune.stdout and "FILE" not in prune.stdout
    export = kbuild_cli("cache", "export", "--help", env=env)
    assert "FILE" in export.stdout and "--max-size" not in export.stdout


@pytest.mark.parametrize("command", ["warmup", "demo"])
def test_help_gives_the_true_default_cache_dir_and_explains_jobs(env, command):
    # the old help said "~/.cache"; the cache is ~/.cache/kbuild (kbuild.cache.default_cache_dir)
    out = " ".join(kbuild_cli(command, "--help", env=env).stdout.split())
    assert "$KBUILD_CACHE_DIR, else $XDG_CACHE_HOME/kbuild, else ~/.cache/kbuild" in out
    assert "-j JOBS, --jobs JOBS compile this many kernels at once" in out


def test_one_kernel_is_singular(env):
    run = kbuild_cli("warmup", "--spec", COLUMN_SUM, "-j", "1", env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1].startswith("1 kernel for sm_90 in ")


def test_the_readme_quick_start_runs_as_is_on_this_machine(subprocess_env, tmp_path):
    """The README's quick start block, copied as is, runs on a CPU machine (it once asserted
    `Torch not compiled with CUDA enabled`)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    run = subprocess.run(
        [sys.executable, "-c", block],
        env={**subprocess_env, "KBUILD_CACHE_DIR": str(tmp_path)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rmsnorm max error" in run.stdout and "dw (1024,)" in run.stdout


def test_a_users_module_that_fails_is_one_line(env, tmp_path):
    (tmp_path / "broken.py").write_text("def build(:\n")
    (tmp_path / "wrong_specs.py").write_text("def warmup_specs():\n    return ['rmsnorm']\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "same.py").write_text("")
    (tmp_path / "b" / "same.py").write_text("")
    run = kbuild_cli("warmup", "--module", str(tmp_path / "broken.py"), env=env)
    assert_error(run, 1, "--module", "broken.py: SyntaxError")
    run = kbuild_cli("warmup", "--module", str(tmp_path / "wrong_specs.py"), env=env)
    assert_error(run, 2, "warmup_specs() must give KernelSpecs, not 'rmsnorm'")
    both = [
        "--module",
        str(tmp_path / "a" / "same.py"),
        "--module",
        str(tmp_path / "b" / "same.py"),
    ]
    run = kbuild_cli("warmup", *both, env=env)
    assert_error(run, 2, "b/same.py: a module named same is imported already")


def test_a_spec_of_a_kernel_nobody_declared(env):
    spec = '{"kernel": "user_softmax_fwd", "params": {"N": 64, "dtype": "bf16"}}'
    for jobs in ("1", "2"):
        run = kbuild_cli("warmup", "--spec", spec, "-j", jobs, env=env)
        assert_error(run, 2, "unknown kernel 'user_softmax_fwd'", "module that defines it")


def test_ops_of_a_users_module(env):
    """`--ops namespace::name` warms a declared op's kernels (kbuild.Op) at the width; an op
    nobody declared, or one that launches from its own code, is a one-line error (once a
    KeyError / AttributeError from the op registry, or silently nothing warmed)."""
    example = str(Path(__file__).resolve().parents[1] / "examples" / "custom_softmax.py")
    width = ("--hidden", "512", "--dtype", "f32")
    run = kbuild_cli("warmup", "--module", example, "--ops", "user_softmax::softmax", env=env)
    assert_error(run, 2, "--ops goes with --hidden")  # once ignored without a word
    run = kbuild_cli("warmup", "--ops", "user_softmax::softmax", *width, env=env)
    assert_error(run, 2, "--ops user_softmax::softmax: no op of that name is declared", "--module")
    run = kbuild_cli("warmup", "--module", example, "--ops", "user_softmax::nope", *width, env=env)
    assert_error(run, 2, "user_softmax::nope", "declared: ", "user_softmax::softmax")
    run = kbuild_cli("warmup", "--module", example, "--ops", "kbuild::rmsnorm_fwd", *width, env=env)
    assert_error(run, 1, "--ops kbuild::rmsnorm_fwd", "own code (cuda=)")
    run = kbuild_cli(
        "warmup", "--module", example, "--ops", "user_softmax::softmax", *width, "-j", "1", env=env
    )
    assert run.returncode == 0, run.stderr
    assert "user_softmax_fwd(N=512, dtype=f32, vectorize=True)" in run.stdout
    assert "user_softmax_bwd(N=512, dtype=f32, vectorize=True)" in run.stdout
