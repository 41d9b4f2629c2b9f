"""Hash the PTX of every kernel in named manifests: the check that a refactor changed no code.

    python bench/ptx_hashes.py bench/results/ptx_hashes.json            # write the list
    python bench/ptx_hashes.py --check bench/results/ptx_hashes.json    # compare against it

Each kernel is built and lowered to PTX (no ptxas, no GPU); the list maps a spec's canonical
JSON to the sha256 of its PTX for sm_90. A spec that changed its parameters shows as one
missing and one new entry.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kbuild.cli.manifest import manifest  # noqa: E402
from kbuild.spec import KernelSpec  # noqa: E402
from kbuild.targets import target_for_arch  # noqa: E402

MANIFESTS = ("tests", "bench", "tune", "trace")


def _ptx_hash(spec_json: str, arch: str) -> tuple[str, str]:
    from kbuild.compiler import build
    from kbuild.targets.nvidia import module_to_ptx

    spec = KernelSpec.from_json(json.loads(spec_json))
    target = target_for_arch(arch)
    ptx = module_to_ptx(build(spec, target).module, target)
    return spec_json, hashlib.sha256(ptx).hexdigest()


def hashes(names: tuple[str, ...], arch: str, jobs: int) -> dict[str, str]:
    specs = list(dict.fromkeys(s.canonical_json() for n in names for s in manifest(n)))
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return dict(pool.map(_ptx_hash, specs, [arch] * len(specs), chunksize=16))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--check", action="store_true", help="compare with the list at path")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    now = hashes(MANIFESTS, args.arch, args.jobs)
    if not args.check:
        Path(args.path).write_text(json.dumps(dict(sorted(now.items())), indent=0) + "\n")
        print(f"{len(now)} kernels hashed into {args.path}")
        return 0
    before = json.loads(Path(args.path).read_text())
    missing = sorted(set(before) - set(now))
    new = sorted(set(now) - set(before))
    changed = sorted(k for k in set(before) & set(now) if before[k] != now[k])
    for label, specs in (("missing", missing), ("new", new), ("changed PTX", changed)):
        for spec in specs:
            print(f"{label}: {spec}")
    same = len(set(before) & set(now)) - len(changed)
    print(f"{same} identical, {len(changed)} changed, {len(missing)} missing, {len(new)} new")
    return 0 if not (missing or new or changed) else 1


if __name__ == "__main__":
    sys.exit(main())
