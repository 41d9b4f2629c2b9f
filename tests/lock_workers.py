"""Child processes for the cross-process cache tests (test_cache_locking.py and the end-to-end
test in test_offline_and_cli.py), and the spy through which they report what they do with
an entry's lock.

The tests order processes by messages, never by sleeping: each child sends what happens to
it ("start", "refused", "locked", "building", "unlocked", "returned", ...) through a pipe,
and the parent reads them one at a time, checking each against the one it expects. The
lock events come from `spy_on_flock`, which wraps `fcntl.flock` (what filelock locks with on
Unix) in the child, so "refused" is the positive, immediate evidence that the child asked for
the very lock file another process holds and did not get it. A test that instead waited a
while to see that a child had not built yet would pass whenever the machine was slow.

It lives in its own importable module because the "spawn" start method pickles the worker by
name, and imports only kbuild.cache at the top: a child costs a fresh interpreter, not torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import multiprocessing
import os
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from kbuild.artifact import Artifact
from kbuild.cache import DiskCache

# A hang guard only: every message here comes within milliseconds of its cause, so this
# timeout never decides a passing run; it turns a lost message into a failure.
WAIT_S = 30.0
ENTRY = "0123456789abcdef" * 2
TOOL = "fedcba9876543210"
TOOLCHAIN = {"mlir": "22.1.8.4", "llvm": "22.1.8.2", "ptxas": "13.0.88"}


def make_artifact(tag: bytes) -> Artifact:
    """An artifact that says who built it, so a test can tell whose entry a process got."""
    return Artifact(b"\x7fELF" + tag + bytes(range(64)), "cubin", "k", {"by": tag.decode()})


def _same_file(fd: Any, path: str) -> bool:
    try:
        fd = fd if isinstance(fd, int) else fd.fileno()
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def spy_on_flock(
    report: Callable[[tuple], None], lock_path: str, committed: Callable[[], bool]
) -> None:
    """From now on, report this process's flock calls on `lock_path`'s file.

    ("refused",) once, the first time an exclusive lock on it is refused because another
    process holds it; ("locked",) each time one is granted; ("unlocked", committed()) just
    before each release, so a test sees whether the entry was already written at the moment
    the lock stopped protecting it. Calls on other files pass through unreported.
    """
    real_flock = fcntl.flock
    refused = False

    def flock(fd: Any, operation: int) -> None:
        nonlocal refused
        ours = _same_file(fd, lock_path)
        if ours and operation & fcntl.LOCK_UN:
            report(("unlocked", committed()))
        try:
            real_flock(fd, operation)
        except BlockingIOError:
            if ours and not refused:
                refused = True
                report(("refused",))
            raise
        if ours and operation & fcntl.LOCK_EX:
            report(("locked",))

    fcntl.flock = flock


def _wait_for(conn: Connection, message: tuple) -> None:
    """The parent's next message, which must be `message`; a child whose parent is gone or
    silent exits instead of hanging."""
    if not conn.poll(WAIT_S):
        raise SystemExit(f"no {message} from the parent in {WAIT_S} s")
    got = conn.recv()
    if got != message:
        raise SystemExit(f"expected {message} from the parent, got {got}")


def get_or_build_worker(
    conn: Connection,
    root: str,
    lock_path: str,
    tag: bytes,
    gated: bool = False,
    fail: bool = False,
    read_only: bool = False,
) -> None:
    """`DiskCache(root).get_or_build(ENTRY, TOOL, ...)` with a build that reports ("building",)
    and, if `gated`, runs on only when the parent sends ("go",); it then raises if `fail`,
    else returns make_artifact(tag). Ends with ("returned", binary, built) or ("raised", text),
    then stays alive until ("exit",): a process's exit releases every lock it holds, which
    would hide a lock that get_or_build failed to release."""
    cache = DiskCache(root, read_only=read_only)
    spy_on_flock(conn.send, lock_path, lambda: cache.get(ENTRY, TOOL) is not None)

    def build() -> Artifact:
        conn.send(("building",))
        if gated:
            _wait_for(conn, ("go",))
        if fail:
            raise RuntimeError("ptxas crashed")
        return make_artifact(tag)

    conn.send(("start",))
    try:
        artifact, built = cache.get_or_build(ENTRY, TOOL, TOOLCHAIN, build)
    except RuntimeError as err:
        conn.send(("raised", str(err)))
    else:
        conn.send(("returned", artifact.binary, built))
    _wait_for(conn, ("exit",))


def hold_lock_worker(conn: Connection, root: str, entry_key: str, toolchain_key: str) -> None:
    """Hold `DiskCache(root).lock(entry_key, toolchain_key)`, as a process compiling into that
    entry does: ("locked",) once it has it, ("released",) after the parent's ("release",);
    then stays alive until ("exit",)."""
    with DiskCache(root).lock(entry_key, toolchain_key):
        conn.send(("locked",))
        _wait_for(conn, ("release",))
    conn.send(("released",))
    _wait_for(conn, ("exit",))


def artifact_for_worker(conn: Connection, spec_json: str, lock_path: str) -> None:
    """`kbuild.jit.artifact_for(spec, sm_90)` on the default (KBUILD_CACHE_DIR) cache, online;
    ends with ("returned", sha256 of the binary). The spec comes as JSON so this child imports
    neither torch nor the ops."""
    import json

    from kbuild.cache import default_cache_dir, entry_key
    from kbuild.jit import artifact_for
    from kbuild.spec import KernelSpec
    from kbuild.targets import target_for_arch

    spec, target = KernelSpec.from_json(json.loads(spec_json)), target_for_arch("sm_90")
    key = entry_key(spec, target)
    cache = DiskCache(default_cache_dir())
    spy_on_flock(conn.send, lock_path, lambda: cache.get(key, None) is not None)
    conn.send(("start",))
    binary = artifact_for(spec, target).binary
    conn.send(("returned", hashlib.sha256(binary).hexdigest()))
    _wait_for(conn, ("exit",))


class Child:
    """A spawned worker and the parent's end of its pipe. Every wait is bounded by WAIT_S."""

    def __init__(self, target: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.process = ctx.Process(
            target=target, args=(child_end, *args), kwargs=kwargs, daemon=True
        )
        self.process.start()
        child_end.close()  # the child's end closes with the child, so recv sees EOF, not a hang
        self.seen: list[tuple] = []

    def expect(self, *messages: tuple) -> None:
        """The child's next messages are exactly `messages`, in order; fails at the first one
        that differs, naming everything the child said so far."""
        for wanted in messages:
            if not self.conn.poll(WAIT_S):
                raise AssertionError(f"waited {WAIT_S} s for {wanted}; child said {self.seen}")
            try:
                got = self.conn.recv()
            except EOFError:
                code = self.process.exitcode
                raise AssertionError(
                    f"child exited ({code}) before {wanted}; it said {self.seen}"
                ) from None
            self.seen.append(got)
            assert got == wanted, f"expected {wanted}, got {got}; child said {self.seen}"

    def send(self, message: tuple) -> None:
        self.conn.send(message)

    def stop(self) -> None:
        """Let the child exit, or kill it: never leaves a process behind."""
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(("exit",))
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()


@contextlib.contextmanager
def children() -> Iterator[Callable[..., Child]]:
    """`with children() as spawn: a = spawn(worker, *args)`; every child stops on the way out,
    whether the test passed or failed."""
    started: list[Child] = []

    def spawn(target: Callable[..., None], *args: Any, **kwargs: Any) -> Child:
        started.append(Child(target, *args, **kwargs))
        return started[-1]

    try:
        yield spawn
    finally:
        for child in started:
            child.stop()
