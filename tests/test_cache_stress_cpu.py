"""A concurrency stress test of the disk cache: 8 processes warm the same 24 kernels into one
cache, 3 of them are killed (SIGKILL) at random points, and the cache must come out whole.

What this catches: an entry torn by a killed writer that later loads (or loads as a wrong
binary), a lock that a killed holder never releases (the survivors would hang), two
surviving processes compiling the same kernel (the lock or the second lookup under it
broken), and entries a survivor finished that a later warm compiles again.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys

from kbuild import cli
from kbuild.cache import DiskCache, entry_key
from kbuild.kernels.norms.kernels import LAYERNORM_BWD
from kbuild.targets import target_for_arch

SPECS = [  # backward kernels: a few hundred ms each, so kills land mid-work
    LAYERNORM_BWD.spec(N, dtype, dtype, True, bias)
    for N in (1024, 2048, 4096, 8192, 3072, 6144)
    for dtype in ("bf16", "f16")
    for bias in (False, True)
]
LINE = re.compile(r"sm_90\s+(compiled|cached)\s.*?\s(layernorm_bwd\(.*\))$")


def test_eight_warmers_three_killed(tmp_path, subprocess_env):
    assert len(SPECS) == 24
    record = tmp_path / "specs.jsonl"
    record.write_text("".join(s.canonical_json() + "\n" for s in SPECS))
    root = tmp_path / "cache"
    rng = random.Random(7)
    command = [sys.executable, "-m", "kbuild", "warmup", "--arch", "sm_90"]
    command += ["--from", str(record), "--cache-dir", str(root), "-j", "1"]
    procs = []
    for k in range(8):
        order = SPECS[:]  # each process walks the list in its own order
        rng.shuffle(order)
        mine = tmp_path / f"order{k}.jsonl"
        mine.write_text("".join(s.canonical_json() + "\n" for s in order))
        argv = [*command[:-6], "--from", str(mine), "--cache-dir", str(root), "-j", "1"]
        procs.append(
            subprocess.Popen(
                argv, env=subprocess_env, stdout=subprocess.PIPE, text=True, start_new_session=True
            )
        )
    doomed = rng.sample(range(8), 3)
    for k in doomed:  # at a random point: after 0 to 6 of its kernels, mid-compile of the next
        for _ in range(rng.randint(0, 6)):
            procs[k].stdout.readline()
        os.killpg(procs[k].pid, signal.SIGKILL)  # the process and anything it started
    compiles: dict[str, int] = {}
    for k, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=600)
        if k in doomed:
            assert proc.returncode == -signal.SIGKILL
            continue
        assert proc.returncode == 0, out
        seen = [m.groups() for m in map(LINE.search, out.splitlines()) if m]
        assert len(seen) == 24, out  # every kernel reported, compiled or found
        for state, label in seen:
            compiles[label] = compiles.get(label, 0) + (state == "compiled")
    assert all(n <= 1 for n in compiles.values()), compiles  # once among the survivors

    cache = DiskCache(root, read_only=True)
    target = target_for_arch("sm_90")
    for spec in SPECS:  # every entry loads and passes its checksum
        artifact = cache.get(entry_key(spec, target), None)
        assert artifact is not None and artifact.meta["spec"] == spec.to_json()
    again = cli.warmup(SPECS, "sm_90", str(root), jobs=1)
    assert [built for _, _, built, _ in again] == [False] * 24  # a clean warm compiles nothing
