"""The run directory's file names are spelled once on the runner side (runner/rundir/layout.py), and
they are the names the job writes (dflash.rundir.RunDir) and docs/run-directory.md documents."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from dflash.pipeline.target_worker import data_state_path
from dflash.rundir import RunDir
from runner.rundir import layout

ROOT = Path(__file__).resolve().parents[2]
FILE_NAMES = {
    layout.RUN_JSON,
    layout.JOB_LOCK,
    layout.METRICS,
    layout.EVENTS,
    layout.SAMPLES,
    layout.WATCH_LOCK,
}
SUBDIR = re.compile(rf"(?<![\w.-])({layout.LOGS}|{layout.WORKERS}|{layout.WATCH})/(?:[\w*-]|$)")


def spells_a_path(text: str) -> bool:
    """A file of the run directory named as a path: the whole string, or its tail after a `/` (an
    f-string's `{run_dir}/run.json`); prose that mentions a file name is not a path."""
    return text in FILE_NAMES or text.startswith("/") and text[1:] in FILE_NAMES or bool(SUBDIR.search(text))


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string constant in code, docstrings left out (they may name the files in prose)."""
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:  # a module's, class's or function's docstring, and attribute docstrings
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    docstrings.add(id(stmt.value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_no_runner_module_but_layout_spells_a_run_directory_path() -> None:
    spelled = []
    for path in sorted((ROOT / "runner").rglob("*.py")):
        if path.name == "layout.py" or path.parts[-2] == "cache":  # cache/: the artifact store's own files
            continue
        for line, text in _strings(ast.parse(path.read_text())):
            if spells_a_path(text):
                spelled.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
    assert not spelled, "take these from runner.rundir.layout:\n" + "\n".join(spelled)


def test_the_checker_finds_a_spelled_path() -> None:
    tree = ast.parse('"""Reads run.json."""\nx = "metrics.jsonl"\ny = f"read logs/{name}.log"\n')
    found = [t for _, t in _strings(tree) if spells_a_path(t)]
    assert found == ["metrics.jsonl", "read logs/"]
    joined = ast.parse('p = f"{run_dir}/run.json"\nq = "no run.json there"\n')
    assert [t for _, t in _strings(joined) if spells_a_path(t)] == ["/run.json"], (
        "a path joined in an f-string"
    )


def test_layout_names_the_files_the_job_writes(tmp_path: Path) -> None:
    run = RunDir(tmp_path).create()
    assert run.manifest == tmp_path / layout.RUN_JSON
    assert run.metrics == tmp_path / layout.METRICS
    assert run.events == tmp_path / layout.EVENTS
    assert run.workers == tmp_path / layout.WORKERS
    assert run.logs == tmp_path / layout.LOGS
    assert run.lock_path == tmp_path / layout.JOB_LOCK
    position = data_state_path(run, 3)
    assert position.parent == run.workers
    assert not layout.is_heartbeat(position.name)
    assert layout.is_heartbeat("target-3.json") and layout.is_heartbeat("drafter-0.json")
    assert not layout.is_heartbeat(".drafter-0.json.tmp") and not layout.is_heartbeat(".x.json")
    assert tmp_path / layout.SUPERVISOR_LOG == run.logs / "supervisor.log"


def test_layout_is_what_the_docs_show() -> None:
    tree = (ROOT / "docs" / "run-directory.md").read_text().split("```")[1]
    for name in (
        *FILE_NAMES,
        f"{layout.WORKERS}/",
        f"{layout.LOGS}/",
        layout.group_log(0).replace("0", "<N>"),
    ):
        assert name in tree, name
