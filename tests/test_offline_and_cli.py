"""CPU tests of the offline mode and the `kbuild` command line, end to end through the real
compiler, and of the jit path's build-once lock across processes (key sensitivity is
test_cache.py's job, the lock's own protocol test_cache_locking.py's)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kbuild import cli
from kbuild.artifact import Artifact
from kbuild.cache import DiskCache, entry_key, toolchain_key
from kbuild.cli.manifest import manifest
from kbuild.compiler import toolchain
from kbuild.jit import KernelNotCached, artifact_for
from kbuild.kernels.norms.rmsnorm import rmsnorm_fwd_spec
from kbuild.spec import KernelSpec
from kbuild.targets import target_for_arch

from .lock_workers import artifact_for_worker, children
from .no_mlir import HIDE_MLIR

SM90 = target_for_arch("sm_90")
SPEC = rmsnorm_fwd_spec(4096, "bf16", "bf16", False, 1e-6)


def _kbuild(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "kbuild", *args], capture_output=True, text=True, env=env, cwd=cwd
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _progress(text: str) -> list[str]:
    """warmup's per-kernel lines, `[ i/n] arch  compiled|cached ...  label`."""
    return [line for line in text.splitlines() if re.match(r"\[\s*\d+/\d+\] ", line)]


# --- offline ------------------------------------------------------------------------------


def test_offline_miss_names_kernel_cache_and_warmup_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KBUILD_OFFLINE", "1")
    with pytest.raises(KernelNotCached) as info:
        artifact_for(SPEC, SM90, DiskCache(tmp_path))
    message = str(info.value)
    for part in ("rmsnorm_fwd", "N=4096", str(tmp_path), "kbuild warmup --arch sm_90"):
        assert part in message
    # The suggested command warms exactly this spec.
    quoted = re.search(r"--spec '([^']*)'", message)
    assert quoted, message
    assert KernelSpec.from_json(json.loads(quoted.group(1))) == SPEC
    assert not any(tmp_path.iterdir()), "an offline miss must not write to the cache"


def test_offline_miss_uses_kbuild_cache_dir(tmp_cache, monkeypatch):
    monkeypatch.setenv("KBUILD_OFFLINE", "1")
    with pytest.raises(KernelNotCached, match=re.escape(str(tmp_cache))):
        artifact_for(SPEC, SM90)


def test_offline_hit_returns_what_online_compiled(tmp_cache, monkeypatch):
    monkeypatch.setenv("KBUILD_OFFLINE", "0")  # "0" means online
    online = artifact_for(SPEC, SM90, DiskCache(tmp_cache))
    assert online.format == "cubin"
    monkeypatch.setenv("KBUILD_OFFLINE", "1")  # read on every call, not at import
    offline = artifact_for(SPEC, SM90, DiskCache(tmp_cache))
    assert offline.binary == online.binary
    assert (offline.format, offline.entry) == (online.format, online.entry)
    assert offline.meta["registers"] == online.meta["registers"]
    # Still a miss for a kernel nobody warmed.
    with pytest.raises(KernelNotCached):
        artifact_for(rmsnorm_fwd_spec(4096, "bf16", None, False, 1e-6), SM90, DiskCache(tmp_cache))


# --- kbuild warmup / cache ----------------------------------------------------------------


@pytest.fixture(scope="module")
def warmed(tmp_path_factory, subprocess_env) -> tuple[Path, str, str]:
    """The standard manifest warmed twice into one cache: (root, first output, second output)."""
    env = subprocess_env
    root = tmp_path_factory.mktemp("warmup") / "cache"
    args = ("warmup", "--arch", "sm_90", "--manifest", "standard", "--cache-dir", str(root))
    first = _kbuild(env, *args, "-j", "2", cwd=root.parent).stdout
    second = _kbuild(env, *args, "-j", "2", cwd=root.parent).stdout
    return root, first, second


STANDARD_LABELS = {spec.short() for spec in manifest("standard")}
N_STANDARD = len(STANDARD_LABELS)  # 24 at the time of writing, 6 of them rmsnorm_fwd


def test_warmup_prints_one_compiled_line_per_spec(warmed):
    root, first, _ = warmed
    lines = _progress(first)
    assert len(lines) == N_STANDARD, first
    assert sum(line.split("  ")[-1].startswith("rmsnorm_fwd(") for line in lines) == 6
    assert all(re.match(rf"\[\s*\d+/{N_STANDARD}\] sm_90\s+compiled ", x) for x in lines), first
    assert {line.split("  ")[-1] for line in lines} == STANDARD_LABELS
    assert all(re.search(r"spills\s+0\b", line) for line in lines), first
    assert f"{N_STANDARD} kernels for sm_90 in {root}" in first


def test_second_warmup_is_all_cached(warmed):
    _, _, second = warmed
    lines = _progress(second)
    assert len(lines) == N_STANDARD, second
    assert all(re.match(r"\[\s*\d+/\d+\] sm_90\s+cached ", line) for line in lines), second
    assert "compiled" not in second


def test_cache_list_shows_the_warmed_entries(warmed, subprocess_env):
    root, _, _ = warmed
    out = _kbuild(subprocess_env, "cache", "list", "--cache-dir", str(root), cwd=root.parent)
    lines = out.stdout.splitlines()
    assert len(lines) == N_STANDARD, out.stdout
    assert all(re.match(r"sm_90\s+cubin ", line) for line in lines), out.stdout
    assert {re.search(r"cubin (\w+\(.*\))  ", line).group(1) for line in lines} == STANDARD_LABELS
    assert len(list(DiskCache(root).entries())) == N_STANDARD


@pytest.mark.parametrize("form", ["json", "label"])
def test_warmup_one_spec_serves_offline(form, tmp_path, subprocess_env, monkeypatch):
    """A --spec as JSON or as the label warmup prints (pasted from a line of its output, as
    `kbuild show` takes it) warms that kernel and no other."""
    spec = rmsnorm_fwd_spec(4096, "f32", "f32", False, 1e-6)
    text = spec.canonical_json() if form == "json" else spec.short()
    root = tmp_path / "cache"
    out = _kbuild(
        subprocess_env,
        *("warmup", "--arch", "sm_90", "--spec", text, "--cache-dir", str(root)),
        *("-j", "1"),
        cwd=tmp_path,
    ).stdout
    lines = _progress(out)
    assert len(lines) == 1 and lines[0].startswith("[1/1] sm_90"), out
    assert spec.short() in lines[0]
    monkeypatch.setenv("KBUILD_OFFLINE", "1")
    artifact = artifact_for(spec, SM90, DiskCache(root))
    assert artifact.format == "cubin"
    assert [e[1]["meta"]["spec"] for e in DiskCache(root).entries()] == [spec.to_json()]


def test_warmup_without_specs_exits_2(tmp_path, capsys):
    assert cli.main(["warmup", "--arch", "sm_90", "--cache-dir", str(tmp_path)]) == 2
    assert "--manifest" in capsys.readouterr().err


def test_cache_path_and_clear(tmp_path, capsys):
    cache = DiskCache(tmp_path)
    artifact_for(SPEC, SM90, cache)
    (tmp_path / "unrelated.txt").write_text("kept")
    assert cli.main(["cache", "path", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path)
    assert cli.main(["cache", "clear", "--cache-dir", str(tmp_path)]) == 0
    assert list(cache.entries()) == []
    assert (tmp_path / "unrelated.txt").read_text() == "kept"


# --- two processes, one entry -------------------------------------------------------------


def test_two_processes_wait_on_the_lock_and_share_one_entry(tmp_cache):
    """kbuild.jit's online path goes through the entry's lock: two processes calling
    artifact_for while this one holds that lock both wait (each is refused the lock file),
    then both take the entry the holder wrote, and neither compiles.

    Catches: the jit path (artifact_for -> build_into) compiling without get_or_build's lock
    or its second get, or locking a different key than it stores under. The holder's entry is
    a sentinel, not a real cubin, so a child that compiled would return other bytes."""
    spec = rmsnorm_fwd_spec(2048, "bf16", "bf16", True, 1e-6)
    key, tools = entry_key(spec, SM90), toolchain(SM90.vendor)
    cache = DiskCache(tmp_cache)
    lock = cache.lock(key, toolchain_key(tools))
    sentinel = Artifact(b"sentinel, not a cubin", "cubin", "rmsnorm_fwd_kernel", {})
    with children() as spawn:
        with lock:
            pair = [spawn(artifact_for_worker, spec.canonical_json(), lock.lock_file) for _ in "ab"]
            for child in pair:
                child.expect(("start",), ("refused",))
            cache.put(key, toolchain_key(tools), sentinel, tools)
        digest = hashlib.sha256(sentinel.binary).hexdigest()
        for child in pair:
            child.expect(("locked",), ("unlocked", True), ("returned", digest))
    entries = list(DiskCache(tmp_cache).entries())
    assert [(d.parent.name, meta["sha256"]) for d, meta in entries] == [(key, digest)]
    assert not list(tmp_cache.rglob(".tmp-*")), "temp files left behind"


def test_gpu_tests_collect_without_mlir():
    """The GPU machine has no MLIR (kernels are compiled here and carried): every test module
    the GPU run collects must import without it, or the whole `-m gpu` run stops at collection
    (a CPU test module importing kbuild.kernels.llmc.encoder at the top once did)."""
    code = HIDE_MLIR + (
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '--collect-only', '-m', 'gpu', '-p', 'no:cacheprovider',"
        " 'tests']))\n"
    )
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
