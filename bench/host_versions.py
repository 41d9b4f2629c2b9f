"""Host cost per call of two versions of kbuild, interleaved: bench/host.py run from each
source tree in turn, round after round, so the machine's drift (20-40% between minutes)
falls on both.

    mkdir .kbuild-before && git archive <commit> | tar -x -C .kbuild-before   # git-ignored
    KBUILD_CACHE_DIR=.kbuild-aot KBUILD_OFFLINE=1 python bench/host_versions.py \
        .kbuild-before . OUT                   # carry .kbuild-before and .kbuild-aot

Each tree imports its own kbuild (PYTHONPATH) and builds its own C++ extension once
(KBUILD_NATIVE_DIR=<tree>/.kbuild-native). Both read the one warmed cache: the kernels' keys
cover their sources, which the trees share where the kernels did not change. Writes
OUT/host_versions.json: per tree, per shape, op and route, the median over rounds of
host.py's medians, and the ratio after / before.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

ROUNDS = 5


def run_host(tree: str, out_dir: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.abspath(tree)
    env["KBUILD_NATIVE_DIR"] = os.path.join(os.path.abspath(tree), ".kbuild-native")
    script = os.path.join(os.path.abspath(tree), "bench", "host.py")
    subprocess.run([sys.executable, script, out_dir], env=env, check=True, cwd=tree)
    with open(os.path.join(out_dir, "host.json")) as f:
        return json.load(f)


def main() -> None:
    before, after = sys.argv[1], sys.argv[2]
    out_dir = sys.argv[3] if len(sys.argv) > 3 else "."
    os.makedirs(out_dir, exist_ok=True)
    samples: dict[str, list[dict]] = {"before": [], "after": []}
    for round_ in range(ROUNDS):
        order = (("before", before), ("after", after))
        for label, tree in order if round_ % 2 == 0 else order[::-1]:
            with tempfile.TemporaryDirectory() as tmp:
                samples[label].append(run_host(tree, tmp))
    result = {
        "trees": {"before": before, "after": after},
        "commits": {k: v[0].get("commit") for k, v in samples.items()},
        "gpu": samples["after"][0].get("gpu"),
        "rounds": ROUNDS,
        "timing": "each tree's host.py once per round, order alternating; medians over rounds",
    }
    for shape in (k for k in samples["after"][0] if "x" in k and k[0].isdigit()):
        table = {}
        for op, row in samples["after"][0][shape].items():
            for key in row:
                if key.startswith("ratio"):
                    continue
                got = {
                    label: statistics.median(s[shape][op][key] for s in runs)
                    for label, runs in samples.items()
                    if op in runs[0].get(shape, {}) and key in runs[0][shape][op]
                }
                if len(got) == 2:
                    got["after/before"] = round(got["after"] / got["before"], 3)
                table.setdefault(op, {})[key] = got
        result[shape] = table
        for op, rows in table.items():
            for key, got in rows.items():
                print(f"{shape} {op} {key}: " + ", ".join(f"{k} {v}" for k, v in got.items()))
    with open(os.path.join(out_dir, "host_versions.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
