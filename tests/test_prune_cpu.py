"""Cache health: prune (least recently used first, by age, stale entries), lock files that do
not pile up, the modes a new cache and its entries get, and prune while another process
reads. What this catches: pruning the wrong end of the LRU order, a size bound missed by one
entry, a current entry taken for stale (or a stale one kept), lock files left behind, a
world-writable new cache, and a reader that crashes when an entry vanishes under it.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest
from filelock import FileLock, Timeout

from kbuild import cli
from kbuild.artifact import Artifact
from kbuild.cache import DiskCache, entry_key
from kbuild.cache.prune import parse_age, parse_size, prune, scan
from kbuild.kernels.norms.kernels import RMSNORM_FWD
from kbuild.targets import target_for_arch

from .lock_workers import children, hold_lock_worker

T = "c" * 16


def _fill(root, count=4, size=1000) -> list[str]:
    cache = DiskCache(root)
    keys = []
    for k in range(count):
        key = f"{k:x}" * 16
        art = Artifact(
            binary=bytes([k]) * size, format="cubin", entry="k", meta={"target": "sm_90"}
        )
        directory = cache.put(key, T, art, {"mlir": "22"})
        with cache.lock(key, T):
            pass  # leaves its .lock file, as a compile does
        used = 1_000_000 + 1000 * k  # entry k used k thousand seconds after the first
        os.utime(directory / "kernel.cubin", (used, used))
        os.utime(directory / "meta.json", (used, used))
        keys.append(key)
    return keys


def test_max_size_removes_least_recently_used_first(tmp_path):
    keys = _fill(tmp_path, count=4)
    cache = DiskCache(tmp_path)
    sizes = {e.entry_key: e.size for e in scan(cache)}  # meta.json lengths differ by a byte
    bound = sizes[keys[2]] + sizes[keys[3]]
    removed = prune(cache, max_size=bound)
    assert [e.entry_key for e in removed] == keys[:2]  # the two oldest
    assert sorted(e.entry_key for e in scan(cache)) == keys[2:]
    assert all(cache.get(k, T) is not None for k in keys[2:])
    assert not list(tmp_path.glob(f"*/{keys[0]}*")), "entry and lock file both gone"
    assert prune(cache, max_size=bound) == []  # at the bound: nothing more


def test_older_than(tmp_path):
    keys = _fill(tmp_path, count=3)
    removed = prune(DiskCache(tmp_path), older_than=1500, now=1_000_000 + 2000 + 1)
    assert [e.entry_key for e in removed] == keys[:1]  # used 2001 s ago; the others 1001, 1


def test_stale_entries_are_those_no_current_key_names(tmp_path):
    _fill(tmp_path, count=2)  # written "by another kbuild": their keys match no spec here
    spec = RMSNORM_FWD.spec(64, "bf16", "bf16", True, 1e-6)
    cli.warmup([spec], "sm_90", str(tmp_path), jobs=1)
    removed = prune(DiskCache(tmp_path), stale=True)
    assert len(removed) == 2
    (left,) = scan(DiskCache(tmp_path))
    assert left.entry_key == entry_key(spec, target_for_arch("sm_90"))


def test_a_new_cache_is_private_and_entries_follow_the_umask(tmp_path):
    root = tmp_path / "new" / "cache"
    _fill(root, count=1)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    old = os.umask(0o027)
    os.umask(old)
    binary = next(root.rglob("kernel.cubin"))
    assert stat.S_IMODE(binary.stat().st_mode) == 0o666 & ~old


def test_prune_leaves_a_lock_another_process_holds(tmp_path):
    """Catches prune unlinking an entry's lock file without taking the lock: the process
    compiling into that entry would hold a lock on a file no longer there, and the next one
    would lock a new file and compile beside it. The holder has the lock (its "locked"
    message) before prune runs; no sleep decides anything."""
    keys = _fill(tmp_path, count=2)
    held, free = (tmp_path / key[:2] / key / f"{T}.lock" for key in keys)
    assert held.exists() and free.exists()
    cache = DiskCache(tmp_path)
    with children() as spawn:
        holder = spawn(hold_lock_worker, str(tmp_path), keys[0], T)
        holder.expect(("locked",))
        removed = prune(cache, max_size=0)
        assert sorted(e.entry_key for e in removed) == keys  # both entries go
        assert not free.exists()  # a lock nobody holds goes with its entry
        assert held.exists(), "prune removed a lock file another process holds"
        with pytest.raises(Timeout):  # and it is still the file the holder locked
            with FileLock(held, timeout=0):
                pass
        holder.send(("release",))
        holder.expect(("released",))
    with FileLock(held, timeout=0):  # released: free for the next compile
        pass


READER = """
import sys, time
from kbuild.cache import DiskCache
cache, keys = DiskCache(sys.argv[1]), sys.argv[2:]
end = time.time() + 1.5
hits = 0
while time.time() < end:
    for k in keys:
        art = cache.get(k, "c" * 16)
        if art is not None:
            assert art.binary == bytes([int(k[0], 16)]) * 1000
            hits += 1
print(hits)
"""


def test_prune_while_another_process_reads(tmp_path, subprocess_env):
    keys = _fill(tmp_path, count=8)
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(tmp_path), *keys],
        env=subprocess_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.3)
    cache = DiskCache(tmp_path)
    prune(cache, max_size=3 * max(e.size for e in scan(cache)))  # sizes differ by a byte
    out, _ = reader.communicate(timeout=60)
    assert reader.returncode == 0 and int(out) > 0  # never a wrong binary, never a crash
    # The reader's loads move entries up the LRU order (reads set access times), so which
    # three stay depends on timing; that three stay, whole, does not.
    left = scan(cache)
    assert len(left) == 3 and all(cache.get(e.entry_key, T) is not None for e in left)


def test_parse_size_and_age():
    assert parse_size("2G") == 2 << 30 and parse_size("500m") == 500 << 20
    assert parse_size("1024") == 1024 and parse_size("1.5KiB") == 1536
    assert parse_age("30d") == 30 * 86400 and parse_age("12h") == 43200
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
    with pytest.raises(ValueError, match="not an age"):
        parse_age("30")


def test_cli_prune_and_info(tmp_path, capsys):
    _fill(tmp_path, count=3)
    assert cli.main(["cache", "info", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 entries" in out and "3 stale" in out
    assert cli.main(["cache", "prune", "--max-size", "1", "--cache-dir", str(tmp_path)]) == 0
    assert "removed 3 entries" in capsys.readouterr().out
    assert cli.main(["cache", "prune", "--cache-dir", str(tmp_path)]) == 2


# --- the CLI as a Unix tool ------------------------------------------------------------------


def test_cli_piped_into_head_ends_quietly(tmp_path, subprocess_env):
    _fill(tmp_path, count=40, size=10)
    command = f"{sys.executable} -m kbuild cache list --cache-dir {tmp_path} | head -1"
    result = subprocess.run(
        command, shell=True, env=subprocess_env, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.count("\n") == 1
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr


@pytest.mark.parametrize("command", ["warmup", "demo", "cache"])
def test_every_command_has_an_example_in_its_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    assert f"kbuild {command}" in capsys.readouterr().out.split("example")[1]


def test_errors_go_to_stderr_with_a_status(tmp_path, subprocess_env):
    result = subprocess.run(
        [sys.executable, "-m", "kbuild", "warmup", "--arch", "sm_91"],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "sm_91" in result.stderr and result.stdout == ""
