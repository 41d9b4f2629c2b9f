"""KBUILD_RECORD=FILE: every kernel spec a process asks for, appended to FILE as JSON lines.

A spec is recorded when the memory tier first misses on it in a process (kbuild/jit.py), before
the disk cache is asked, so an offline miss is recorded too before it raises: one failed run
on a GPU machine yields the list to warm (`kbuild warmup --from FILE --arch ...`). The file
stays deduplicated across processes: each append happens under an exclusive lock on the file,
after reading what is already there (DDP ranks recording into one file write each spec once).
No torch, no MLIR.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading

from .spec import KernelSpec

RECORD_ENV = "KBUILD_RECORD"
_seen: set[tuple[str, str]] = set()  # (file, spec) already in the file
_lock = threading.Lock()


def record(spec: KernelSpec) -> None:
    """Append `spec` to $KBUILD_RECORD unless the file already holds it (no-op when unset)."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    line = spec.canonical_json()
    with _lock:
        if (path, line) in _seen:
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with os.fdopen(os.dup(fd), "r+", encoding="utf-8") as f:
                present = {text.strip() for text in f}
                if line not in present:
                    f.write(line + "\n")
                    f.flush()
        finally:
            os.close(fd)  # releases the lock
        _seen.add((path, line))


def read_specs(path: str) -> list[KernelSpec]:
    """The specs of a record file, in first-seen order, duplicates dropped; a line that is
    not a spec raises ValueError naming the file and line."""
    specs: dict[str, KernelSpec] = {}
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            text = text.strip()
            if not text:
                continue
            try:
                spec = KernelSpec.from_json(json.loads(text))
            except (ValueError, TypeError, KeyError) as err:
                raise ValueError(f"{path}:{number}: not a kernel spec ({err})") from None
            specs.setdefault(spec.canonical_json(), spec)
    return list(specs.values())
