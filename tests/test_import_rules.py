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
