"""Print the README's speed table (% of copy bandwidth per op and N) from bench/results.

python bench/table.py [results_dir]
"""

from __future__ import annotations

import json
import os
import sys

FILES = ("h200_rmsnorm_fwd.json", "h200_rmsnorm_bwd_fused.json", "h200_layernorm.json")
COLUMNS = (
    ("rmsnorm fwd", "rmsnorm_fwd"),
    ("rmsnorm bwd", "rmsnorm_bwd"),
    ("fused add fwd", "fused_add_rmsnorm_fwd"),
    ("fused add bwd", "fused_add_rmsnorm_bwd"),
    ("layernorm fwd", "layernorm_fwd"),
    ("layernorm bwd", "layernorm_bwd"),
)


def main() -> None:
    folder = (
        sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results")
    )
    of_copy: dict[tuple[str, int], float] = {}
    for name in FILES:
        with open(os.path.join(folder, name)) as f:
            for case in json.load(f)["cases"]:
                of_copy[case["op"], case["shape"][1]] = case["results"]["kbuild"]["of_copy"]
    sizes = sorted({n for _, n in of_copy})
    print("| N | " + " | ".join(title for title, _ in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for n in sizes:
        cells = [f"{100 * of_copy[op, n]:.1f}%" if (op, n) in of_copy else "-" for _, op in COLUMNS]
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
