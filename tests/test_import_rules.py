"""The one seam: runner/ never imports torch or dflash (it runs on laptops without torch), and
dflash/ never imports runner/. Checked statically over every module and by importing every CLI verb
in a fresh interpreter where importing torch or dflash fails."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
JOB_ONLY = {"torch", "dflash", "transformers", "safetensors", "accelerate", "numpy", "triton"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("half,forbidden", [("runner", JOB_ONLY), ("dflash", {"runner"})])
def test_static_imports(half: str, forbidden: set[str]) -> None:
    files = sorted((REPO / half).rglob("*.py"))
    assert len(files) > 10, f"found only {len(files)} modules under {half}/"
    bad = {str(f.relative_to(REPO)): sorted(_imports(f) & forbidden) for f in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"{half}/ must not import {sorted(forbidden)}: {bad}"


_BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ImportError(f'runner imported {{name}}')
sys.meta_path.insert(0, Block())
from typer.testing import CliRunner
from runner.cli import app
import runner.commands, pkgutil, importlib
for m in pkgutil.walk_packages(__import__('runner').__path__, 'runner.'):
    importlib.import_module(m.name)
verbs = [c.name for c in app.registered_commands] + [g.name for g in app.registered_groups]
for verb in verbs:
    r = CliRunner().invoke(app, [verb, '--help'])
    assert r.exit_code == 0, (verb, r.output)
print(len(verbs))
"""


def test_every_runner_module_and_verb_imports_without_torch() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKER.format(blocked=sorted(JOB_ONLY))],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) >= 5, "fewer CLI verbs than expected"


OUTPUT_ALLOWED = {
    "runner/cli.py": "the entry point",
    "runner/console.py": "the console the commands print through",
    "runner/watch/live.py": "the dashboard renderer: `dflashctl watch` draws its live view through it",
    "runner/exec/proc.py": (
        "a program of its own on the host (`python3 -` fed its source): its stdout is its JSON answer; "
        "the functions the runner imports from it print nothing"
    ),
    "runner/launch/foreground.py": (
        "streams the job's output to this terminal through the on_line function its caller passes "
        "(the `run` command); with none given it prints each line itself"
    ),
}
"""Modules outside runner/commands/ that may print or import the console, and why."""


def _output(path: Path) -> list[str]:
    """Each use of print (a call, or print passed on as a default such as `progress=print`) and
    each import of the Rich console (runner.console, rich's Console)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Name) and node.id == "print":
            found.append(f"print at line {node.lineno}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = {a.name for a in node.names}
            if node.module == "runner.console" or (node.module == "rich.console" and "Console" in names):
                found.append(f"from {node.module} import {', '.join(sorted(names))} at line {node.lineno}")
            elif node.module == "runner" and "console" in names:
                found.append(f"from runner import console at line {node.lineno}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in ("runner.console", "rich.console"):
                    found.append(f"import {a.name} at line {node.lineno}")
    return found


def test_library_modules_never_print() -> None:
    """Only commands print: library code reports through return values, exceptions and the
    progress functions its callers pass."""
    files = sorted((REPO / "runner").rglob("*.py"))
    rel = {str(f.relative_to(REPO)): f for f in files}
    assert set(OUTPUT_ALLOWED) <= set(rel), f"allowlisted modules gone: {set(OUTPUT_ALLOWED) - set(rel)}"
    bad = {
        name: hits
        for name, f in rel.items()
        if not name.startswith("runner/commands/") and name not in OUTPUT_ALLOWED and (hits := _output(f))
    }
    assert not bad, f"library modules print or import the console (only runner/commands/ may): {bad}"


def test_the_output_rule_sees_prints_and_console_imports(tmp_path: Path) -> None:
    mod = tmp_path / "m.py"
    mod.write_text(
        "from runner.console import console\nfrom rich.console import Console, Group\n"
        "import rich.console\ns = 'print(1)'\ndef f(say=print):\n    print(s)\n"
    )
    assert len(_output(mod)) == 5
    mod.write_text("from rich.console import Group\nsys.stdout.write('x')\n")
    assert _output(mod) == []
