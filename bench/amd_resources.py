"""VGPRs / SGPRs / LDS / scratch of every bench-manifest kernel for AMD arches, from the code
objects' metadata (compiled here on CPU; no AMD GPU involved).

    python bench/amd_resources.py [OUT.json] [--arch gfx942 --arch gfx950]

Prints one line per kernel and writes {arch: {spec: {...}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kbuild import cli  # noqa: E402
from kbuild.cli.manifest import manifest  # noqa: E402

FIELDS = ("vgprs", "sgprs", "agprs", "lds_bytes", "scratch_bytes", "block")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="bench/results/amd_resources.json")
    parser.add_argument("--arch", action="append", default=[])
    args = parser.parse_args()
    result = {}
    with tempfile.TemporaryDirectory() as root:
        for arch in args.arch or ["gfx942", "gfx950"]:
            specs = list(manifest("bench"))
            rows = cli.warmup(specs, arch, root, jobs=os.cpu_count() or 1)
            result[arch] = {label: {k: meta.get(k) for k in FIELDS} for label, meta, _, _ in rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
