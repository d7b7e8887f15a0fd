"""`dflashctl baselines` lists what a healthy run stored beside the cache artifacts."""

from __future__ import annotations

import json
from pathlib import Path

from run_cli import Cli

from runner.watch.baseline import update_from_healthy_run


def test_baselines_lists_a_stored_baseline(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    assert json.loads(cli("baselines", "--json").stdout) == []
    root = tmp_path / "store" / ".." / "baselines"  # beside DFLASH_CACHE_STORE, as watch keeps them
    metrics = [
        {"t": 1000.0 + i, "elapsed_s": 400.0 + i, "tok_s": 20000.0 + 10 * i, "step": i} for i in range(10)
    ]
    b = update_from_healthy_run(root.resolve(), "ab" * 32, "c" * 64, metrics, run_id="r1")
    assert b is not None
    (listed,) = json.loads(cli("baselines", "--json").stdout)
    assert listed["fingerprint_key"] == "ab" * 32 and listed["runs"][0]["run_id"] == "r1"
    assert 20000 <= listed["tok_s"] <= 20090
    assert "abababababababab" in cli("baselines").stdout
