"""pytest imports each test file by its basename (tests/ has no packages), so two test files with
one basename break collection of the whole suite ("import file mismatch"). Caught here by name."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_module_basename_is_unique() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for f in sorted(TESTS.rglob("*.py")):
        seen[f.name].append(str(f.relative_to(TESTS)))
    assert len(seen) > 20, f"found only {len(seen)} modules under tests/"
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twice, f"rename one of each: modules share a basename: {twice}"
