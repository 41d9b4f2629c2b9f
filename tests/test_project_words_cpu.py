"""The project speaks for itself: no numbered period of work ("session 13", "s12", "_s11_")
and no issue number ("issue 14", "#14") in the docs, the code, the notes or the names of the
result files. Dates and commits say when; a private calendar says nothing to a newcomer."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRIVATE = re.compile(
    r"sessions?[ _-]?[0-9]|\bs[0-9]{1,2}\b|_s[0-9]{1,2}[_.]|issues?[ _-]?#?[0-9]|#[0-9]+\b"
    r"|refactor[ _-]?[0-9]",
    re.IGNORECASE,
)
# Measured data may hold profiler names such as "lambda()#3"; its file names are checked.
DATA = {".json", ".jsonl", ".txt", ".csv", ".log"}


def _texts() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CLAUDE.md", ROOT / "pyproject.toml"]
    for folder in ("kbuild", "bench", "examples", "tests", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix not in DATA and "__pycache__" not in path.parts:
                files.append(path)
    return [f for f in files if f.exists() and f != Path(__file__).resolve()]


def test_no_numbered_periods_or_issue_numbers_in_the_text():
    hits = []
    for path in _texts():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if PRIVATE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def test_no_numbered_periods_in_result_file_names():
    names = [p.relative_to(ROOT).as_posix() for p in (ROOT / "bench" / "results").rglob("*")]
    assert not [n for n in names if PRIVATE.search(n) or "session" in n.lower()]


def test_the_pattern_finds_what_it_is_for():
    for text in ("session 13", "sessions 9-11", "(s12)", "x_s11_final.json", "issue 14", "#14"):
        assert PRIVATE.search(text), text
    for text in ("sm_90", "2026-12-04", "issued", "commit a0a9054", "s_1", "x_sx"):
        assert not PRIVATE.search(text), text
