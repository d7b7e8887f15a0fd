"""runner/exec/stream.py with real commands: lines as they come, the failure tail, merge_stderr."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runner.errors import RunnerError
from runner.exec.stream import TAIL_LINES, stream

PY = sys.executable


def test_lines_arrive_without_newlines_and_stdin_is_fed(tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("a\nb\n")
    lines: list[str] = []
    stream(
        [PY, "-c", "import sys; [print(l.upper(), end='') for l in sys.stdin]"],
        on_line=lines.append,
        stdin_path=src,
    )
    assert lines == ["A", "B"]


def test_failure_names_the_command_and_quotes_the_last_lines() -> None:
    code = f"import sys\nfor i in range({TAIL_LINES + 10}): print('line', i)\nsys.exit(3)"
    with pytest.raises(RunnerError) as e:
        stream([PY, "-c", code], on_line=lambda _l: None, what="the warm run")
    msg = str(e.value)
    assert msg.startswith("the warm run failed with exit code 3; last lines:")
    assert f"line {TAIL_LINES + 9}" in msg and "line 9\n" not in msg, "only the tail"
    assert len(msg.splitlines()) == TAIL_LINES + 1


def test_merge_stderr_false_keeps_stderr_out_of_the_lines_but_in_the_error() -> None:
    code = "import sys; print('{\"ok\": 1}'); print('boom: bad config', file=sys.stderr); sys.exit(2)"
    lines: list[str] = []
    with pytest.raises(RunnerError) as e:
        stream([PY, "-c", code], on_line=lines.append, merge_stderr=False)
    assert lines == ['{"ok": 1}'], "stdout only: a JSON-lines protocol stays parseable"
    assert "boom: bad config" in str(e.value) and "exit code 2" in str(e.value)

    merged: list[str] = []
    with pytest.raises(RunnerError):
        stream([PY, "-c", code], on_line=merged.append)
    assert "boom: bad config" in merged


def test_a_missing_program_is_a_clear_error() -> None:
    with pytest.raises(RunnerError, match="cannot run 'no-such-tool-xyz'.*on PATH"):
        stream(["no-such-tool-xyz"], on_line=lambda _l: None)
