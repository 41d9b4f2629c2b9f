"""Print README.md's speed table (% of copy bandwidth per op and N) from the committed results.

    python bench/readme_table.py [--results DIR] [--check] [--peers]

The table reads kbuild's "of_copy" from the op benchmarks' files: h200_rmsnorm_fwd.json
(bench/bench_rmsnorm.py), h200_rmsnorm_bwd_fused.json (bench/bench_rmsnorm_bwd.py) and
h200_layernorm.json (bench/bench_layernorm.py), each that script's default name on an H200.
`--check` compares the printed table with the one in README.md and exits 1 where they
differ. `--peers` prints the sentence under the table: torch eager's range on the same shapes
(forward and backward columns; the low end rounded down, the high end up).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(os.path.dirname(BENCH), "README.md")
FILES = ("h200_rmsnorm_fwd.json", "h200_rmsnorm_bwd_fused.json", "h200_layernorm.json")
COLUMNS = (
    ("rmsnorm fwd", "rmsnorm_fwd"),
    ("rmsnorm bwd", "rmsnorm_bwd"),
    ("fused add fwd", "fused_add_rmsnorm_fwd"),
    ("fused add bwd", "fused_add_rmsnorm_bwd"),
    ("layernorm fwd", "layernorm_fwd"),
    ("layernorm bwd", "layernorm_bwd"),
)


def read(folder: str) -> dict[tuple[str, int], dict]:
    """(op, N) -> that case's results by implementation, from the three files."""
    cases = {}
    for name in FILES:
        with open(os.path.join(folder, name)) as f:
            for case in json.load(f)["cases"]:
                cases[case["op"], case["shape"][1]] = case["results"]
    return cases


def table(cases: dict[tuple[str, int], dict]) -> list[str]:
    sizes = sorted({n for _, n in cases})
    lines = [table_header()]
    lines.append("|---" * (len(COLUMNS) + 1) + "|")
    for n in sizes:
        cells = [
            f"{100 * cases[op, n]['kbuild']['of_copy']:.1f}%" if (op, n) in cases else "-"
            for _, op in COLUMNS
        ]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def peers(cases: dict[tuple[str, int], dict], impl: str = "eager") -> str:
    spans = {}
    for way in ("fwd", "bwd"):
        shares = [r[impl]["of_copy"] for (op, _), r in cases.items() if op.endswith(way)]
        spans[way] = f"{math.floor(100 * min(shares))}-{math.ceil(100 * max(shares))}%"
    return f"torch {impl}: {spans['fwd']} forward, {spans['bwd']} backward on the same shapes"


def readme_table() -> list[str]:
    """The speed table as README.md has it: the lines from its header row to the first line
    that is not a table row."""
    with open(README) as f:
        lines = f.read().splitlines()
    start = lines.index(table_header())
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[start:end]


def table_header() -> str:
    return "| N | " + " | ".join(title for title, _ in COLUMNS) + " |"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", default=os.path.join(BENCH, "results"), help="folder")
    parser.add_argument("--check", action="store_true", help="compare with README.md's table")
    parser.add_argument("--peers", action="store_true", help="torch eager's range too")
    args = parser.parse_args()
    cases = read(args.results)
    lines = table(cases)
    print("\n".join(lines))
    if args.peers:
        print(peers(cases))
    if args.check:
        committed = readme_table()
        if committed != lines:
            for ours, theirs in zip(lines, committed, strict=False):
                if ours != theirs:
                    print(f"README.md: {theirs}\nresults:   {ours}", file=sys.stderr)
            if len(lines) != len(committed):
                print(f"{len(committed)} rows in README.md, {len(lines)} here", file=sys.stderr)
            return 1
        print("README.md's table matches", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
