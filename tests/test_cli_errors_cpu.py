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


def _quick_start_blocks() -> list[str]:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [part.split("```", 1)[0] for part in section.split("```python\n")[1:]]


def _run_block(block: str, subprocess_env, tmp_path) -> str:
    run = subprocess.run(
        [sys.executable, "-c", block],
        env={**subprocess_env, "KBUILD_CACHE_DIR": str(tmp_path)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_the_readme_quick_start_runs_as_is_on_this_machine(subprocess_env, tmp_path):
    """The README's quick start block for any machine, copied as is, runs on a CPU machine
    (it once asserted `Torch not compiled with CUDA enabled`)."""
    block = next(b for b in _quick_start_blocks() if "rmsnorm max error" in b)
    out = _run_block(block, subprocess_env, tmp_path)
    assert "rmsnorm max error" in out and "dw (1024,)" in out


def test_the_readme_hugging_face_patch_runs_as_is(subprocess_env, tmp_path):
    """The quick start's first block (kbuild.nn.patch on a Hugging Face Llama), as is, on a
    CPU machine with transformers (not a kbuild dependency: skipped without it)."""
    pytest.importorskip("transformers")
    block = _quick_start_blocks()[0]
    assert "kbuild.nn.patch(model)" in block
    out = _run_block(block, subprocess_env, tmp_path)
    assert "10 patched, 0 left stock" in out


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


def rms_spec(**params) -> str:
    """An rmsnorm_fwd spec as JSON, valid but for `params`."""
    values = dict(N=64, dtype="bf16", weight_dtype="bf16", store_rstd=True, eps=1e-6)
    return json.dumps({"kernel": "rmsnorm_fwd", "params": {**values, **params}})


@pytest.mark.parametrize(
    "params, words",
    [
        (dict(N=-8), "rmsnorm_fwd: N must be >= 1, got -8"),
        (dict(N=0), "rmsnorm_fwd: N must be >= 1, got 0"),
        (dict(eps=-1.0), "rmsnorm_fwd: eps must be >= 0.0, got -1.0"),
        (dict(N=1 << 63), f"rmsnorm_fwd: N must be a 64-bit int and >= 1, got {1 << 63}"),
    ],
    ids=["N=-8", "N=0", "eps=-1", "N=2^63"],
)
def test_a_spec_out_of_range_is_refused_before_compiling(env, tmp_path, params, words):
    """A --spec, a --from record or a `kbuild show` spec whose value its kernel does not take
    is one line naming the kernel, the parameter, the value and the range, exit 2; nothing is
    compiled. Catches the old ends: N=-8 an `IndexError: list index out of range` from the
    plan chooser (exit 1, nothing named), eps=-1.0 a kernel compiled and exit 0."""
    text = rms_spec(**params)
    run = kbuild_cli("warmup", "--spec", text, "-j", "1", env=env)
    assert_error(run, 2, f"kbuild warmup: --spec: {words}")
    record = tmp_path / "run.jsonl"
    record.write_text(COLUMN_SUM + "\n" + text + "\n")
    run = kbuild_cli("warmup", "--from", str(record), "-j", "1", env=env)
    assert_error(run, 2, f"kbuild warmup: --from {record}: {words}")
    assert_error(kbuild_cli("show", text, env=env), 2, f"kbuild show: SPEC: {words}")
    assert not any((tmp_path / "cache").iterdir())  # not even the valid column sum


def test_eps_zero_is_a_spec_the_kernels_take(env):
    """eps = 0 is what kbuild.rmsnorm accepts (op/tensors.py check_eps): its spec warms.
    Catches an eps bound of > 0, which would refuse at launch a call the API takes."""
    run = kbuild_cli("warmup", "--spec", rms_spec(eps=0.0), "-j", "1", env=env)
    assert run.returncode == 0, run.stderr
    assert "rmsnorm_fwd(N=64, dtype=bf16, eps=0.0," in run.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (("--head-dim", str(1 << 63)), f"argument --head-dim: expected an integer below 2^63, "
                                        f"got '{1 << 63}'"),
        (("--rms-offset", "nan"), "argument --rms-offset: expected a finite number, got 'nan'"),
        (("--rms-offset", "inf"), "argument --rms-offset: expected a finite number, got 'inf'"),
        (("--rms-offset", "x"), "argument --rms-offset: expected a finite number, got 'x'"),
    ],
    ids=["head-dim-2^63", "offset-nan", "offset-inf", "offset-x"],
)  # fmt: skip
def test_width_options_refuse_what_the_kernels_cannot_take(env, args, words):
    """Each option is named for its own value. Catches a head_dim past int64 and a NaN
    offset turned into specs (the offset's error was reported as --hidden's)."""
    run = kbuild_cli("warmup", "--hidden", "64", *args, env=env)
    assert_error(run, 2, f"kbuild warmup: {words}")


def test_hidden_whose_linear_widths_overflow(env):
    """--ops linear warms bias gradients of 4 x hidden: past int64 it is --hidden's error,
    naming the kernel and parameter."""
    run = kbuild_cli("warmup", "--hidden", str(1 << 62), "--ops", "linear", env=env)
    assert_error(run, 2, "kbuild warmup: --hidden: bias_grad: OC must be a 64-bit int and >= 1")


def test_listing_an_empty_cache_says_so(env, tmp_path):
    """An empty cache is listed as such: exit 0 (it listed what there is), stdout empty (one
    line per entry, for scripts), one line on stderr saying the folder holds no entries.
    Catches the silent empty output that looked like a wrong --cache-dir."""
    empty = tmp_path / "cache"
    for args in (("--cache-dir", str(empty)), ()):  # the option, and $KBUILD_CACHE_DIR
        run = kbuild_cli("cache", "list", *args, env=env)
        assert run.returncode == 0 and run.stdout == "", (run.returncode, run.stdout)
        assert run.stderr == f"kbuild cache list: no entries in {empty}\n"
    kbuild_cli("warmup", "--spec", COLUMN_SUM, "-j", "1", env=env)
    run = kbuild_cli("cache", "list", env=env)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert len(run.stdout.splitlines()) == 1 and "column_sum(N=1024" in run.stdout


@pytest.mark.parametrize("name", ["out.zip", "out.tar.bz2", "out", "out.gz"])
def test_export_refuses_a_name_it_cannot_write(env, tmp_path, name):
    """Export writes a tar, gzipped for .tar.gz / .tgz (cache/bundle.py). Catches a tar
    written under .zip (or any other name) that the tool the name suggests cannot open."""
    target = tmp_path / name
    run = kbuild_cli("cache", "export", str(target), env=env)
    assert_error(run, 2, f"kbuild cache export: FILE {target}:", ".tar, .tar.gz or .tgz")
    assert not target.exists()


@pytest.mark.parametrize("name", ["out.tar", "out.tar.gz", "out.tgz"])
def test_export_takes_the_bundle_names(env, tmp_path, name):
    """The three names pass the check (the empty cache then fails on its own terms)."""
    run = kbuild_cli("cache", "export", str(tmp_path / name), env=env)
    assert_error(run, 1, "kbuild cache export: no entries in", "nothing exported")


def test_a_module_that_is_not_a_python_file(env, tmp_path):
    """--module takes FILE.py or a module name. Catches `No module named '/.../afile'`, the
    path turned into a module name, and exit 1 for what is a wrong argument."""
    (tmp_path / "afile.txt").write_text("x = 1\n")
    run = kbuild_cli("warmup", "--module", "afile.txt", env=env, cwd=tmp_path)
    assert_error(run, 2, "kbuild warmup: --module afile.txt: not a Python file", "FILE.py")
    run = kbuild_cli("warmup", "--module", str(tmp_path / "afile.txt"), env=env)
    assert_error(run, 2, f"--module {tmp_path / 'afile.txt'}: not a Python file")
    missing = tmp_path / "nowhere" / "afile.txt"
    run = kbuild_cli("warmup", "--module", str(missing), env=env)
    assert_error(run, 2, f"kbuild warmup: --module {missing}: no such file")
    run = kbuild_cli("warmup", "--module", "no_such_module_here", env=env)
    assert_error(run, 2, "--module no_such_module_here: no module named 'no_such_module_here'")


def test_a_module_missing_a_dependency_is_its_own_failure(env, tmp_path):
    """A module that exists but imports a missing one: the work failed (exit 1), and the
    missing dependency is named, not the module given."""
    (tmp_path / "needs.py").write_text("import kbuild_absent_dependency\n")
    run = kbuild_cli("warmup", "--module", str(tmp_path / "needs.py"), env=env)
    assert_error(run, 1, "ModuleNotFoundError: No module named 'kbuild_absent_dependency'")


FAILING_MODULE = """
from kbuild import Arg, Param, kernel


@kernel("ranges_failing", params=(Param("N", "int", bounds=(1, None)),), args=(Arg("x"),))
def build_failing(N, target):
    raise RuntimeError(f"no kernel of width {N} today")


def warmup_specs():
    return [build_failing.spec(64), build_failing.spec(128)]
"""


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_builder_that_fails_fails_warmup(env, tmp_path, jobs):
    """A --module whose builder raises: each failing kernel is one line on stderr naming it,
    then a count; exit 1; the other kernels are still compiled (in this process and from
    worker processes). Catches a failure reported as skipped with exit 0, and a warmup that
    stops at its first failure (the column sum after it never compiled)."""
    (tmp_path / "failing.py").write_text(FAILING_MODULE)
    module = str(tmp_path / "failing.py")
    run = kbuild_cli("warmup", "--module", module, "--spec", COLUMN_SUM, "-j", jobs, env=env)
    assert run.returncode == 1, (run.stdout, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 3, run.stderr
    for line, width in zip(lines, (64, 128), strict=False):
        assert line.startswith(f"kbuild warmup: cannot build ranges_failing(N={width}) for sm_90")
        assert f"RuntimeError: no kernel of width {width} today" in line
    assert (
        lines[2] == "kbuild warmup: 2 of 3 kernels failed to compile for sm_90 (each named above)"
    )
    assert "column_sum(N=1024, out_dtype=bf16)" in run.stdout  # compiled all the same
    assert "kernels for sm_90 in" not in run.stdout  # no summary of success


@pytest.mark.parametrize("bad", ["garbage", '{"kernel": "column_sum"}', rms_spec(N=-8)])
def test_a_malformed_spec_among_valid_ones(env, tmp_path, bad):
    """One bad --spec among good ones refuses the command (exit 2) before anything is
    compiled. Catches a warning that let the others warm and exited 0."""
    run = kbuild_cli("warmup", "--spec", COLUMN_SUM, "--spec", bad, "--spec", rms_spec(),
                     "-j", "1", env=env)  # fmt: skip
    assert_error(run, 2, "kbuild warmup: --spec")
    assert not any((tmp_path / "cache").iterdir())
