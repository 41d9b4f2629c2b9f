"""Cross-process tests of DiskCache's build-once lock and atomic publication.

Each test fails on the first run, every run, if the property it names is broken: processes
are ordered by a message handshake (tests/lock_workers.py), never by sleeps, and a waiter is
shown to be waiting by its own refused flock on the holder's lock file, not by the absence of
a build after some delay. Children import kbuild.cache only, so each costs well under a
second.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from filelock import Timeout

from kbuild.cache import DiskCache

from .lock_workers import (
    ENTRY,
    TOOL,
    TOOLCHAIN,
    children,
    get_or_build_worker,
    make_artifact,
)

OTHER_TOOL = "0f1e2d3c4b5a6978"


def _binary(tag: bytes) -> bytes:
    return make_artifact(tag).binary


def _lock_path(cache: DiskCache) -> str:
    return cache.lock(ENTRY, TOOL).lock_file


def test_waiter_blocks_while_another_process_holds_the_lock_then_takes_its_entry(tmp_path):
    """Catches: no lock around the build (the child builds while the parent holds the lock),
    a lock file that is not the same for every process (the child gets its own at once), and
    no second get under the lock (the child builds after the parent wrote the entry)."""
    cache = DiskCache(tmp_path)
    with children() as spawn:
        with cache.lock(ENTRY, TOOL):
            child = spawn(get_or_build_worker, str(tmp_path), _lock_path(cache), b"child")
            child.expect(("start",), ("refused",))
            # The child missed and is waiting for this lock: the entry it must end up with is
            # written now, by the holder.
            cache.put(ENTRY, TOOL, make_artifact(b"holder"), TOOLCHAIN)
        child.expect(("locked",), ("unlocked", True), ("returned", _binary(b"holder"), False))


def test_two_processes_compile_once(tmp_path):
    """One process builds while a second one waits; the second gets the first one's binary.

    Catches: no lock (B builds at once), a per-process lock file (the parent's probe and B
    both get a lock of their own), no second get under the lock (B builds again after A), and
    a lock released before the entry is written (A reports its unlock with no entry: the
    window in which a waiter would miss and compile a second time)."""
    cache = DiskCache(tmp_path)
    lock_path = _lock_path(cache)
    with children() as spawn:
        a = spawn(get_or_build_worker, str(tmp_path), lock_path, b"A", gated=True)
        a.expect(("start",), ("locked",), ("building",))
        with pytest.raises(Timeout):  # A holds the lock while it builds
            cache.lock(ENTRY, TOOL).acquire(timeout=0)
        b = spawn(get_or_build_worker, str(tmp_path), lock_path, b"B")
        b.expect(("start",), ("refused",))
        a.send(("go",))
        a.expect(("unlocked", True), ("returned", _binary(b"A"), True))
        b.expect(("locked",), ("unlocked", True), ("returned", _binary(b"A"), False))
    assert cache.get(ENTRY, TOOL) == make_artifact(b"A")


def test_failed_build_in_another_process_releases_the_lock(tmp_path):
    """A's build raises while B waits: A must release the lock before the error reaches its
    caller, having written nothing, and B then builds its own.

    Catches: a lock left held when the build raises (A reports the error before any unlock;
    its process lives on, so only get_or_build itself can have released it), and a failed
    build that writes an entry (A's unlock would report one)."""
    cache = DiskCache(tmp_path)
    lock_path = _lock_path(cache)
    with children() as spawn:
        a = spawn(get_or_build_worker, str(tmp_path), lock_path, b"A", gated=True, fail=True)
        a.expect(("start",), ("locked",), ("building",))
        b = spawn(get_or_build_worker, str(tmp_path), lock_path, b"B")
        b.expect(("start",), ("refused",))
        a.send(("go",))
        a.expect(("unlocked", False), ("raised", "ptxas crashed"))
        b.expect(("locked",), ("building",), ("unlocked", True), ("returned", _binary(b"B"), True))
    assert cache.get(ENTRY, TOOL) == make_artifact(b"B")


def test_read_only_process_never_waits_for_a_writers_lock(tmp_path):
    """A read-only cache (KBUILD_OFFLINE, DDP ranks sharing one directory) takes no lock: it
    builds at once even while a writer holds the entry's lock, and stores nothing.

    Catches: read-only lock() returning a real file lock (the child is refused and waits)."""
    cache = DiskCache(tmp_path)
    with children() as spawn:
        with cache.lock(ENTRY, TOOL):
            lock_path = _lock_path(cache)
            child = spawn(get_or_build_worker, str(tmp_path), lock_path, b"ro", read_only=True)
            child.expect(("start",), ("building",), ("returned", _binary(b"ro"), True))
    assert cache.get(ENTRY, TOOL) is None


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root, with its bytes (None for a directory)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in root.rglob("*")
    }


def test_read_only_cache_creates_no_lock_files_or_directories(tmp_path):
    """Catches: read-only lock() or get_or_build creating the entry directory or a .lock file
    (a baked-in or shared cache must not change, and may not be writable at all)."""
    DiskCache(tmp_path).put(ENTRY, OTHER_TOOL, make_artifact(b"other"), TOOLCHAIN)
    before = _snapshot(tmp_path)
    cache = DiskCache(tmp_path, read_only=True)
    other_entry = "fedcba9876543210" * 2
    for entry, tool in [(ENTRY, TOOL), (other_entry, TOOL)]:  # entry dir present, absent
        artifact, built = cache.get_or_build(entry, tool, TOOLCHAIN, lambda: make_artifact(b"x"))
        assert built and artifact == make_artifact(b"x")
        with cache.lock(entry, tool):
            pass
    assert _snapshot(tmp_path) == before
    absent = DiskCache(tmp_path / "absent", read_only=True)
    absent.get_or_build(ENTRY, TOOL, TOOLCHAIN, lambda: make_artifact(b"x"))
    assert not (tmp_path / "absent").exists()


def test_offline_hit_changes_nothing_in_the_cache(tmp_path, monkeypatch):
    """KBUILD_OFFLINE=1 reads through a read-only cache: a hit leaves the directory byte for
    byte as it was. Catches: the offline path locking or writing (e.g. going through a
    writable get_or_build)."""
    from kbuild.cache import entry_key
    from kbuild.jit import artifact_for
    from kbuild.spec import KernelSpec
    from kbuild.targets import target_for_arch

    spec = KernelSpec.make("rmsnorm_fwd", N=4096, dtype="bf16", eps=1e-5, store_rstd=False)
    target = target_for_arch("sm_90")
    DiskCache(tmp_path).put(entry_key(spec, target), TOOL, make_artifact(b"warm"), TOOLCHAIN)
    before = _snapshot(tmp_path)
    monkeypatch.setenv("KBUILD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KBUILD_OFFLINE", "1")
    assert artifact_for(spec, target) == make_artifact(b"warm")
    assert _snapshot(tmp_path) == before


def test_put_replaces_files_and_never_rewrites_them_in_place(tmp_path):
    """A re-put must swap in new files (rename), leaving the old ones' bytes alone: a reader
    that opened the old binary reads it whole, and a crash mid-put cannot tear a published
    entry. Hard links to the old files show it deterministically.

    Catches: put writing kernel.* or meta.json in place (truncate + write), under which a
    concurrent reader can read half a binary, count it as damage and delete the entry."""
    cache = DiskCache(tmp_path / "cache")
    directory = cache.put(ENTRY, TOOL, make_artifact(b"old"), TOOLCHAIN)
    links = {}
    for name in ("kernel.cubin", "meta.json"):
        links[name] = tmp_path / f"old-{name}"
        os.link(directory / name, links[name])
    old = {name: link.read_bytes() for name, link in links.items()}
    cache.put(ENTRY, TOOL, make_artifact(b"new"), TOOLCHAIN)
    assert {name: link.read_bytes() for name, link in links.items()} == old
    assert cache.get(ENTRY, TOOL) == make_artifact(b"new")
    assert sorted(p.name for p in directory.iterdir()) == ["kernel.cubin", "meta.json"]
