"""docs/BENCHMARKS.md is readable as current results: under 600 lines, opening with one table that
gives every benchmark's metric, value, goal, date, commit, GPU and exact command; every bench/
program has a row; the dated history lives in its own file, which the table links."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "BENCHMARKS.md"
COLUMNS = ["metric", "value", "goal", "date", "commit", "GPU", "command"]
NOT_BENCHMARKS = {"common.py"}
"""bench/ files that measure nothing themselves: the shared report header and helpers."""


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table(text: str) -> tuple[str, list[list[str]]]:
    """The first table's heading (the `##` line above it) and its body rows. A cell's `|` inside
    backticks would split it: the commands here have none, which the row width check holds."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    heading = next(line for line in reversed(lines[:start]) if line.startswith("## "))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    assert rows[0] == COLUMNS, f"the first table's columns are {rows[0]}, not {COLUMNS}"
    assert set("".join(rows[1])) <= set("-| "), "the header is followed by its separator row"
    return heading, rows[2:]


def test_benchmarks_opens_with_the_current_results_table() -> None:
    text = DOC.read_text()
    assert len(text.splitlines()) < 600
    heading, rows = table(text)
    assert heading == "## Current results"
    first_section = next(line for line in text.splitlines() if line.startswith("## "))
    assert first_section == heading, "the table comes before any other section"
    assert len(rows) >= 10
    for row in rows:
        assert len(row) == len(COLUMNS), f"{row[0]}: {len(row)} cells"
        metric, value, goal, date, commit, gpu, command = row
        assert metric and value and goal and gpu and command, f"{metric}: an empty cell"
        assert date == "-" or re.fullmatch(r"20\d\d-\d\d-\d\d", date) or "run" in date, (
            f"{metric}: date {date!r}"
        )
        assert commit == "-" or re.search(r"\b[0-9a-f]{7}\b", commit), f"{metric}: commit {commit!r}"
        if value.startswith("**not measured"):
            assert date == "-" and commit == "-", f"{metric}: a figure not measured has no date or commit"


def test_every_bench_program_has_a_row() -> None:
    _, rows = table(DOC.read_text())
    named = " ".join(" ".join(row) for row in rows)
    programs = sorted(p.name for p in (REPO / "bench").iterdir() if p.suffix in (".py", ".sh"))
    missing = [p for p in programs if p not in NOT_BENCHMARKS and f"bench/{p}" not in named]
    assert not missing, f"bench programs without a current result in docs/BENCHMARKS.md: {missing}"


def test_the_history_is_its_own_file_and_both_are_linked() -> None:
    text = DOC.read_text()
    history = REPO / "docs" / "benchmarks-history.md"
    assert "(benchmarks-history.md)" in text
    assert history.read_text().startswith("# Benchmarks: the dated history")
    assert "(BENCHMARKS.md)" in history.read_text()
    assert "docs/BENCHMARKS.md#current-results" in (REPO / "README.md").read_text()


def test_the_checker_reads_a_table_and_refuses_a_short_row() -> None:
    good = (
        "# B\n\n## Current results\n\n| "
        + " | ".join(COLUMNS)
        + " |\n| --- |\n| m | v | g | 2026-01-01 | abcdef1 | H200 | `x` |\n"
    )
    heading, rows = table(good)
    assert heading == "## Current results" and rows == [
        ["m", "v", "g", "2026-01-01", "abcdef1", "H200", "`x`"]
    ]
    try:
        table(good.replace("| " + " | ".join(COLUMNS), "| metric | value"))
    except AssertionError as e:
        assert "columns" in str(e)
    else:
        raise AssertionError("a table without the seven columns was accepted")
