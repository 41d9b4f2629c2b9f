"""DiskCache: compiled kernels on disk, safe to share between processes and to damage.

Layout, one directory per (entry_key, toolchain_key) pair (see keys.py for why two levels):

    root/<entry_key[:2]>/<entry_key>/<toolchain_key>/kernel.<format>   the binary
    root/<entry_key[:2]>/<entry_key>/<toolchain_key>/meta.json         the commit marker
    root/<entry_key[:2]>/<entry_key>/<toolchain_key>.lock              held while compiling

Writers put both files into temp files in the entry directory, then rename the binary first
and meta.json last, so a reader that finds meta.json finds a whole binary beside it. meta.json
records the binary's size and sha256, so a torn, truncated or edited binary is caught on read.
Every problem on read is a miss, never an exception: the caller compiles again and the damaged
entry is replaced. No pickle: the binary is bytes and everything else is JSON.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from filelock import FileLock

from kbuild.artifact import Artifact

_META = "meta.json"
_BINARY = "kernel"
# Keys become path components; accepting only what keys.py produces keeps `..` and `/` out.
_KEY = re.compile(r"[0-9a-f]{8,64}")
_FORMAT = re.compile(r"[a-z0-9]{1,16}")
# A compile takes seconds; a waiter gives up only when the holder is clearly stuck.
LOCK_TIMEOUT_S = 600.0
_META_FIELDS = {
    "format": str,
    "entry": str,
    "sha256": str,
    "size": int,
    "toolchain": dict,
    "written_at": (int, float),
    "meta": dict,
}


def default_cache_dir() -> Path:
    """`$KBUILD_CACHE_DIR`, else `$XDG_CACHE_HOME/kbuild`, else `~/.cache/kbuild`."""
    if os.environ.get("KBUILD_CACHE_DIR"):
        return Path(os.environ["KBUILD_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kbuild"
    return Path.home() / ".cache" / "kbuild"


def _check_key(name: str, key: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"{name} must be 8 to 64 lowercase hex characters, got {key!r}")
    return key


def _valid_meta(meta: Any) -> bool:
    """Whether meta.json holds every field with the right type (bool is not a valid size)."""
    if not isinstance(meta, dict):
        return False
    for name, kind in _META_FIELDS.items():
        value = meta.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            return False
    return bool(_FORMAT.fullmatch(meta["format"]))


def _read_meta(directory: Path) -> dict[str, Any] | None:
    """meta.json if valid, else None. An absent one raises FileNotFoundError instead: that
    entry is not written yet, or is being written right now, which is no damage."""
    try:
        meta = json.loads((directory / _META).read_bytes())
    except FileNotFoundError:
        raise
    except (OSError, ValueError):
        return None
    return meta if _valid_meta(meta) else None


class DiskCache:
    """The on-disk tier. `read_only=True` serves a cache this process must not change
    (a shared or baked-in directory): it never writes, locks or removes anything."""

    def __init__(self, root: str | Path, read_only: bool = False) -> None:
        self.root = Path(root).expanduser()
        self.read_only = read_only

    def __repr__(self) -> str:
        mode = ", read_only=True" if self.read_only else ""
        return f"DiskCache({str(self.root)!r}{mode})"

    def _entry_dir(self, entry_key: str) -> Path:
        _check_key("entry_key", entry_key)
        return self.root / entry_key[:2] / entry_key

    def _dir(self, entry_key: str, toolchain_key: str) -> Path:
        return self._entry_dir(entry_key) / _check_key("toolchain_key", toolchain_key)

    def get(self, entry_key: str, toolchain_key: str | None) -> Artifact | None:
        """The artifact for exactly (entry_key, toolchain_key), or with toolchain_key None
        (a machine without compilers) the newest valid entry any toolchain wrote. None on a
        miss, including every kind of damage; damaged entries are removed on the way."""
        if toolchain_key is not None:
            directory = self._dir(entry_key, toolchain_key)
            meta = self._meta(directory)
            return None if meta is None else self._load(directory, meta)
        candidates = []
        try:
            children = list(self._entry_dir(entry_key).iterdir())
        except OSError:
            return None
        for directory in children:
            if not (_KEY.fullmatch(directory.name) and directory.is_dir()):
                continue
            meta = self._meta(directory)
            if meta is None:
                continue
            try:
                mtime = (directory / _META).stat().st_mtime
            except OSError:
                continue
            candidates.append((meta["written_at"], mtime, directory, meta))
        for _, _, directory, meta in sorted(candidates, key=lambda c: c[:2], reverse=True):
            artifact = self._load(directory, meta)
            if artifact is not None:
                return artifact
        return None

    def _meta(self, directory: Path) -> dict[str, Any] | None:
        """The entry's valid meta.json, or None; a damaged one is discarded on the way."""
        try:
            meta = _read_meta(directory)
        except FileNotFoundError:
            return None
        return meta if meta is not None else self._discard(directory)

    def _load(self, directory: Path, meta: dict[str, Any]) -> Artifact | None:
        """The binary meta.json describes, if its size and sha256 still match."""
        try:
            binary = (directory / f"{_BINARY}.{meta['format']}").read_bytes()
        except OSError:
            return self._discard(directory)
        if len(binary) != meta["size"] or hashlib.sha256(binary).hexdigest() != meta["sha256"]:
            return self._discard(directory)
        return Artifact(
            binary=binary, format=meta["format"], entry=meta["entry"], meta=meta["meta"]
        )

    def _discard(self, directory: Path) -> None:
        """Best-effort removal of a damaged entry; returns None so callers can `return` it.

        Only the committed files go, meta.json first (the entry stops existing at once), and
        the directory stays: a concurrent writer may have temp files in it. A writer that
        overwrites a valid entry while a reader sees its new binary beside the old meta.json
        may lose its entry here; that costs one recompile, never a wrong binary.
        """
        if self.read_only:
            return None
        try:
            binaries = list(directory.glob(f"{_BINARY}.*"))
        except OSError:  # the whole entry went meanwhile (a prune in another process)
            binaries = []
        for path in [directory / _META, *binaries]:
            with contextlib.suppress(OSError):
                path.unlink()
        return None

    def put(
        self, entry_key: str, toolchain_key: str, artifact: Artifact, toolchain: dict[str, str]
    ) -> Path:
        """Store `artifact` atomically and return its directory.

        `artifact.meta` and `toolchain` must be JSON-able (TypeError otherwise, before anything
        is written); JSON turns tuples into lists, so a get returns them as lists.
        """
        if self.read_only:
            raise RuntimeError(f"{self!r} is read-only; put() is not allowed")
        if not _FORMAT.fullmatch(artifact.format):
            raise ValueError(f"artifact.format must be a short lowercase word: {artifact.format!r}")
        meta = {
            "format": artifact.format,
            "entry": artifact.entry,
            "sha256": hashlib.sha256(artifact.binary).hexdigest(),
            "size": len(artifact.binary),
            "toolchain": dict(toolchain),
            "written_at": time.time(),
            "meta": artifact.meta,
        }
        text = json.dumps(meta, sort_keys=True, indent=1).encode("utf-8")
        return self.put_files(
            entry_key, toolchain_key, f"{_BINARY}.{artifact.format}", artifact.binary, text
        )

    def put_files(
        self, entry_key: str, toolchain_key: str, binary_name: str, binary: bytes, meta: bytes
    ) -> Path:
        """Store an entry from its files as they are (put's, or a verified bundle's): each
        written to a temp file, then the binary renamed into place first and meta.json, the
        commit marker, last."""
        if self.read_only:
            raise RuntimeError(f"{self!r} is read-only; put_files() is not allowed")
        if not re.fullmatch(rf"{_BINARY}\.[a-z0-9]{{1,16}}", binary_name):
            raise ValueError(f"not a cache binary name: {binary_name!r}")
        directory = self._dir(entry_key, toolchain_key)
        _ensure_root(self.root)
        directory.mkdir(parents=True, exist_ok=True)
        temps = []
        try:
            temps.append(_write_temp(directory, binary))
            temps.append(_write_temp(directory, meta))
            os.replace(temps[0], directory / binary_name)
            os.replace(temps[1], directory / _META)
        finally:
            for temp in temps:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)
        return directory

    def lock(self, entry_key: str, toolchain_key: str) -> AbstractContextManager[Any]:
        """An inter-process lock so concurrent processes compile one entry once."""
        if self.read_only:
            return contextlib.nullcontext()
        entry_dir = self._entry_dir(entry_key)
        _ensure_root(self.root)
        entry_dir.mkdir(parents=True, exist_ok=True)
        lock_path = entry_dir / f"{_check_key('toolchain_key', toolchain_key)}.lock"
        return FileLock(lock_path, timeout=LOCK_TIMEOUT_S)

    def get_or_build(
        self,
        entry_key: str,
        toolchain_key: str,
        toolchain: dict[str, str],
        build: Callable[[], Artifact],
    ) -> tuple[Artifact, bool]:
        """(artifact, was_built): a hit, or `build()` run once across processes and stored.

        The second get under the lock is what makes it once: a process that waited finds what
        the holder wrote. If `build` raises, nothing is written and the lock is released. A
        read-only cache builds without storing.
        """
        artifact = self.get(entry_key, toolchain_key)
        if artifact is not None:
            return artifact, False
        with self.lock(entry_key, toolchain_key):
            artifact = self.get(entry_key, toolchain_key)
            if artifact is not None:
                return artifact, False
            artifact = build()
            if not self.read_only:
                self.put(entry_key, toolchain_key, artifact, toolchain)
        return artifact, True

    def entries(self) -> Iterator[tuple[Path, dict[str, Any]]]:
        """(entry directory, meta) for each entry with a valid meta.json, in key order.

        The directory's name is the toolchain key and its parent's the entry key. Binaries
        are not read here, so a listing stays quick on a large cache.
        """
        for meta_path in sorted(self.root.glob(f"*/*/*/{_META}")):
            directory = meta_path.parent
            if not (_KEY.fullmatch(directory.name) and _KEY.fullmatch(directory.parent.name)):
                continue
            try:
                meta = _read_meta(directory)
            except FileNotFoundError:
                continue
            if meta is not None:
                yield directory, meta

    def clear(self) -> None:
        """Remove every entry and lock the cache wrote, and nothing else under root (root may
        be a directory the user shares with other files)."""
        if self.read_only:
            raise RuntimeError(f"{self!r} is read-only; clear() is not allowed")
        for entry_dir in self.root.glob("*/*"):
            shard = entry_dir.parent
            if _KEY.fullmatch(entry_dir.name) and entry_dir.name[:2] == shard.name:
                shutil.rmtree(entry_dir, ignore_errors=True)
                with contextlib.suppress(OSError):
                    shard.rmdir()


@functools.cache
def _file_mode() -> int:
    """0666 less the process umask, read without changing it (os.umask would, for every
    thread at once): entries are written as the user's other files are."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    return 0o644


def _ensure_root(root: Path) -> None:
    """A new cache root is created readable and writable by its owner only (0700): other
    users must not be able to plant binaries this process would load."""
    if not root.is_dir():
        root.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, 0o700)


def _write_temp(directory: Path, data: bytes) -> str:
    """Write `data` to a new temp file in `directory` (same filesystem, so rename is atomic).

    No fsync: a file torn by a crash fails its checksum and reads as a miss, which costs a
    recompile, cheaper than an fsync on every put.
    """
    fd, temp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            # mkstemp creates 0600; entries take the umask's mode, as other files do.
            os.fchmod(f.fileno(), _file_mode())
            f.write(data)
    except BaseException:
        os.unlink(temp)
        raise
    return temp
