"""Keeping a disk cache healthy: which entries are stale, when each was last used, and
removing entries least recently used first, safely while other processes use the cache.

Last use is the binary's access time (on relatime mounts it advances at most once a day past
the last write, enough to rank entries by days), else meta.json's modification time.

An entry is removed the way the cache discards a damaged one: meta.json first (the entry
stops existing for every reader at once), then its binary, then its lock file if no process
holds it, then the empty directories. A process that read meta.json just before finds no
binary and takes it as a miss; one that has the binary open keeps reading it (Linux unlink).
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from .disk import DiskCache

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DAYS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """ "2G", "500M", "1024" -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if match is None:
        raise ValueError(f"not a size: {text!r} (e.g. 2G, 500M)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def parse_age(text: str) -> float:
    """ "30d", "12h", "2w" -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text.lower())
    if match is None:
        raise ValueError(f"not an age: {text!r} (e.g. 30d, 12h)")
    return float(match.group(1)) * _DAYS[match.group(2)]


@dataclass
class Entry:
    directory: Path
    meta: dict
    size: int
    last_used: float

    @property
    def entry_key(self) -> str:
        return self.directory.parent.name


def scan(cache: DiskCache) -> list[Entry]:
    out = []
    for directory, meta in cache.entries():
        try:
            files = [f for f in directory.iterdir() if f.is_file()]
            size = sum(f.stat().st_size for f in files)
            binary = directory / f"kernel.{meta['format']}"
            used = max(binary.stat().st_atime, (directory / "meta.json").stat().st_mtime)
        except OSError:
            continue
        out.append(Entry(directory, meta, size, used))
    return out


def is_stale(entry: Entry) -> bool:
    """Written by another kbuild source (or cache format): its key is not the one this kbuild
    computes for its spec and target, so nothing here will ever hit it. A kernel this
    process does not know (a user's, whose module is not imported) cannot be judged: kept."""
    from ..registry import KERNELS
    from ..spec import KernelSpec
    from ..targets import target_for_arch
    from .keys import entry_key

    try:
        spec = KernelSpec.from_json(entry.meta["meta"]["spec"])
        target = target_for_arch(entry.meta["meta"]["target"])
    except (KeyError, TypeError, ValueError):
        return True
    if spec.kernel not in KERNELS:
        return False
    return entry_key(spec, target) != entry.entry_key


def remove(entry: Entry) -> None:
    directory = entry.directory
    for path in [directory / "meta.json", *directory.glob("kernel.*")]:
        with contextlib.suppress(OSError):
            path.unlink()
    lock = directory.parent / f"{directory.name}.lock"
    if lock.exists():
        try:
            with FileLock(lock, timeout=0):  # nobody is compiling into it
                lock.unlink()
        except (Timeout, OSError):
            pass
    for path in (directory, directory.parent, directory.parent.parent):
        with contextlib.suppress(OSError):
            path.rmdir()  # only when empty (a writer's temp files keep it)


def prune(
    cache: DiskCache,
    max_size: int | None = None,
    older_than: float | None = None,
    stale: bool = False,
    now: float | None = None,
) -> list[Entry]:
    """Remove stale entries (if `stale`), entries not used for `older_than` seconds, then
    least recently used entries until the cache holds at most `max_size` bytes. Returns what
    was removed."""
    if cache.read_only:
        raise RuntimeError(f"{cache!r} is read-only; prune() is not allowed")
    now = time.time() if now is None else now
    entries = sorted(scan(cache), key=lambda e: e.last_used)
    doomed = {
        id(e)
        for e in entries
        if (stale and is_stale(e)) or (older_than is not None and now - e.last_used > older_than)
    }
    if max_size is not None:
        kept = sum(e.size for e in entries if id(e) not in doomed)
        for e in entries:  # oldest first
            if kept <= max_size:
                break
            if id(e) not in doomed:
                doomed.add(id(e))
                kept -= e.size
    removed = [e for e in entries if id(e) in doomed]
    for e in removed:
        remove(e)
    return removed
