"""CPU tests of the offline mode, the `kbuild` command line and cross-process compiles, end to end
through the real compiler (key sensitivity is test_cache.py's job)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kbuild import cli
from kbuild.cache import DiskCache, entry_key
from kbuild.jit import KernelNotCached, artifact_for
from kbuild.manifest import manifest
from kbuild.ops.rmsnorm import rmsnorm_fwd_spec
from kbuild.spec import KernelSpec
from kbuild.targets import target_for_arch

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


def test_warmup_one_spec_serves_offline(tmp_path, subprocess_env, monkeypatch):
    spec = rmsnorm_fwd_spec(4096, "f32", "f32", False, 1e-6)
    root = tmp_path / "cache"
    out = _kbuild(
        subprocess_env,
        *("warmup", "--arch", "sm_90", "--spec", spec.canonical_json(), "--cache-dir", str(root)),
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


# --- two processes, one compile -----------------------------------------------------------

_CHILD = """
import hashlib, os, sys, time
from pathlib import Path
from kbuild.jit import artifact_for
from kbuild.ops.rmsnorm import rmsnorm_fwd_spec
from kbuild.targets import target_for_arch
spec, target = rmsnorm_fwd_spec(2048, "bf16", "bf16", True, 1e-6), target_for_arch("sm_90")
Path(sys.argv[1]).touch()
deadline = time.time() + 60
while not Path(sys.argv[2]).exists() and time.time() < deadline:
    time.sleep(0.005)
print(hashlib.sha256(artifact_for(spec, target).binary).hexdigest())
"""


def test_two_processes_share_one_entry(tmp_path, tmp_cache, subprocess_env):
    env = dict(subprocess_env, KBUILD_CACHE_DIR=str(tmp_cache))
    go = tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(r), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in ready
    ]
    deadline = time.time() + 60
    while not all(r.exists() for r in ready) and time.time() < deadline:
        time.sleep(0.005)
    go.touch()  # both have imported everything: release them together
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    digests = [out.strip() for out, _ in outputs]
    assert re.fullmatch(r"[0-9a-f]{64}", digests[0])
    assert digests[0] == digests[1]

    spec = rmsnorm_fwd_spec(2048, "bf16", "bf16", True, 1e-6)
    key = entry_key(spec, SM90)
    entries = list(DiskCache(tmp_cache).entries())
    assert len(entries) == 1
    directory, meta = entries[0]
    assert directory.parent.name == key
    assert meta["sha256"] == digests[0]
    assert [p.name for p in directory.parent.iterdir() if p.is_dir()] == [directory.name]
    assert not list(tmp_cache.rglob(".tmp-*")), "temp files left behind"
