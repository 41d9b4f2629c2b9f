"""Where the C++ extension cannot be had, kbuild still works, on its Python launch path, and
says so once; in CI the extension must build (else the native tests would skip unseen)."""

from __future__ import annotations

import os
import subprocess
import sys

from .conftest import REPO_ROOT

# A CPU process loads the extension only when asked (as the first CUDA call would).
PROBE = """
import warnings, torch
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    import kbuild
    from kbuild import native
    from kbuild.kernels.norms import api
    for _ in range(2):
        native.load(force=True)
    x = torch.randn(3, 8, requires_grad=True)
    for _ in range(3):
        kbuild.rmsnorm(x, None).sum().backward()
    torch.ops.kbuild.rmsnorm_fwd(x, None, 1e-6, True)[0].sum().backward()
print("native", native.load(force=True) is not None, api._native is not None)
print("warnings", [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)])
"""


def _probe(subprocess_env, **env):
    child = {**subprocess_env, **env}
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=child, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_no_compiler_falls_back_with_one_warning(subprocess_env, tmp_path):
    out = _probe(subprocess_env, CXX="no-such-compiler-kbuild", KBUILD_NATIVE_DIR=str(tmp_path))
    assert "native False False" in out
    line = next(line for line in out.splitlines() if line.startswith("warnings"))
    assert line.count("the C++ hot path is unavailable") == 1, line
    assert "no-such-compiler-kbuild" in line  # says why


def test_failed_build_is_remembered(subprocess_env, tmp_path):
    """A compiler that fails leaves a FAILED note; the next process reads it instead of
    compiling again (each attempt costs a minute), and says how to retry."""
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\necho 'fake compiler: refused' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = dict(CXX=str(fake), KBUILD_NATIVE_DIR=str(tmp_path / "native"))
    first = _probe(subprocess_env, **env)
    assert "fake compiler: refused" in first and "native False False" in first
    fake.write_text("#!/bin/sh\necho 'called again' >&2\nexit 1\n")
    second = _probe(subprocess_env, **env)
    assert "fake compiler: refused" in second and "called again" not in second
    assert "to try again" in second
    assert not list((tmp_path / "native").rglob("*.so"))


def test_disabled_by_environment(subprocess_env):
    out = _probe(subprocess_env, KBUILD_NATIVE="0")
    assert "native False False" in out and "warnings []" in out


def test_extension_builds_in_ci():
    """CI builds the extension from source: a build that broke must fail CI, not skip the
    native tests."""
    if os.environ.get("CI") != "true" or os.environ.get("KBUILD_NATIVE") == "0":
        return
    from kbuild import native

    assert native.load(force=True) is not None


def test_python_path_passes_the_value_tests(subprocess_env):
    """The operator and value tests, on the Python launch path (the extension disabled)."""
    tests = ["tests/test_custom_ops_cpu.py", "tests/test_autograd_cpu.py"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        env={**subprocess_env, "KBUILD_NATIVE": "0"},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:]


def test_an_installed_kbuild_carries_the_cpp_sources():
    """The extension is compiled on the user's machine: every source of it must be package
    data (a wheel without them falls back to the Python path everywhere, saying only that
    the build failed)."""
    import fnmatch
    import tomllib
    from pathlib import Path

    import kbuild.native as native

    root = Path(native.__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["kbuild.native"]
    sources = [p for p in native.SOURCE.parent.iterdir() if p.suffix in (".cpp", ".h")]
    assert set(sources) == set(native.SOURCES) and len(sources) >= 2
    for p in sources:
        assert any(fnmatch.fnmatch(p.name, pat) for pat in patterns), p.name
