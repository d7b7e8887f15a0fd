"""`dflashctl run --dry-run` checks and prints the plan and writes nothing anywhere (issue 49 part 3):
no tiny target under the runs root, no registry entry, no cache directory; its cache key is the one
a real launch computes with the tiny target built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from run_cli import DEMO, REPO, Cli


def _tree(root: Path) -> set[str]:
    return {str(Path(d, n).relative_to(root)) for d, dirs, files in os.walk(root) for n in [*dirs, *files]}


def test_dry_run_writes_nothing_and_keys_as_a_launch_does(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    cli = Cli(tmp_path, HOME=str(home), XDG_CONFIG_HOME=str(tmp_path / "xdg-config"))
    before = _tree(tmp_path)
    out = cli("run", DEMO, "--dry-run", "--json", "--backend", "foreground", "--runs-root", str(cli.runs))
    plan = json.loads(out.stdout)
    assert _tree(tmp_path) == before, sorted(_tree(tmp_path) - before)
    assert not cli.runs.exists(), "no runs root, no tiny target in it"
    # The key of the job as launched: the tiny target built where the job builds it.
    built = tmp_path / "built"
    fp = subprocess.run(
        [sys.executable, "-m", "dflash.fingerprint", DEMO, "--set", f"run.runs_root={built}", "--json"],
        capture_output=True, text=True, cwd=REPO, check=True, timeout=600,
    )  # fmt: skip
    assert any(p.name.startswith(".tiny-target") for p in built.iterdir()), "that one did build it"
    assert plan["hosts"][0]["cache_key"] == json.loads(fp.stdout.splitlines()[-1])["key"]
