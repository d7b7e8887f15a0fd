"""Real torch.compile on CPU, end to end through the CLI: warm-cache -> list -> restore into an empty
dir -> a NEW process compiling the same drafter step hits the cache with no misses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from shared_inputs import seed_runs_root

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "demo-cpu.toml"


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg-cache")
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg-config")
    env.pop("DFLASH_CACHE_STORE", None)
    env.pop("DFLASH_CACHE_SIGNING_KEY", None)
    return env


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runner.cli", *args],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        cwd=tmp_path,
        timeout=900,
    )


def _events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _warm(tmp_path: Path, out: Path, *sets: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "dflash.warm", str(CONFIG), "--out", str(out), *sets],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _events(proc.stdout)


def test_warm_restore_new_process_hits(tmp_path: Path, record_property: pytest.RecordProperty) -> None:
    runs = f"run.runs_root={seed_runs_root(tmp_path / 'runs')}"
    warm = _cli(tmp_path, "warm-cache", str(CONFIG), "--python", sys.executable, "--set", runs, "--json")
    assert warm.returncode == 0, warm.stderr[-3000:]
    result = json.loads(warm.stdout.strip().splitlines()[-1])
    key = result["key"]
    cold = result["warm"]
    assert cold["counters"]["fxgraph_misses"] > 0, "the warm run compiled cold into a fresh dir"
    assert cold["shapes"] and all(s["shape"]["rows"] >= 1 for s in cold["shapes"])
    store = tmp_path / "xdg-cache" / "dflashctl" / "artifacts"
    assert (store / key / "manifest.json").is_file()

    listed = _cli(tmp_path, "cache", "list", "--json")
    assert [a["key"] for a in json.loads(listed.stdout)["artifacts"]] == [key]
    assert _cli(tmp_path, "cache", "verify", key[:12]).returncode == 0

    dest = tmp_path / "fresh" / "cache"
    restored = _cli(
        tmp_path,
        "cache",
        "restore",
        key[:12],
        "--dest",
        str(dest),
        "--python",
        sys.executable,
        "--config",
        str(CONFIG),
        "--set",
        runs,
    )
    assert restored.returncode == 0, restored.stdout + restored.stderr
    assert json.loads((dest / "artifact.json").read_text())["key"] == key

    # A new process compiling the same step with the restored dir: all hits, no misses.
    done = next(e for e in _warm(tmp_path, dest, "--set", runs) if e["event"] == "done")
    c = done["counters"]
    assert c["fxgraph_misses"] == 0 and c["autograd_misses"] == 0, c
    # Every lookup the cold run made (a miss, or a hit on a graph it had compiled itself) is a hit now.
    cc = cold["counters"]
    assert c["fxgraph_hits"] == cc["fxgraph_misses"] + cc["fxgraph_hits"], (c, cc)
    assert c["autograd_hits"] == cc["autograd_misses"] + cc["autograd_hits"], (c, cc)
    ratio = done["seconds"] / cold["seconds"]
    record_property("compile_seconds_cold", cold["seconds"])
    record_property("compile_seconds_warm", done["seconds"])
    print(
        f"\ncompile time cold {cold['seconds']:.1f} s, warm after restore {done['seconds']:.1f} s, "
        f"ratio {ratio:.2f}"
    )  # the ratio is recorded, not asserted: speed goals live in bench/ (bench/h200.sh step d)

    # Same fingerprint check with a different job config is refused, listing the field.
    other = _cli(
        tmp_path,
        "cache",
        "restore",
        key,
        "--dest",
        str(tmp_path / "other"),
        "--python",
        sys.executable,
        "--config",
        str(CONFIG),
        "--set",
        runs,
        "--set",
        "train.max_batch_size=4",
    )
    assert other.returncode == 1 and "job.plan.shapes" in other.stderr, other.stderr
    assert not (tmp_path / "other").exists()


def test_compiled_target_is_warmed_and_keyed(tmp_path: Path) -> None:
    """target.compile = true is compiled code of the job too: warm-cache runs the target's forward per
    bucket (unpadded and padded), the key changes with it, and a new process then misses nothing."""
    sets = ["--set", f"run.runs_root={seed_runs_root(tmp_path / 'runs')}", "--set", "target.compile=true"]
    cold = _warm(tmp_path, tmp_path / "cache", *sets)
    parts = [(e["part"], e["shape"]["length"]) for e in cold if e["event"] == "shape"]
    lengths = [length for part, length in parts if part == "drafter"]
    assert lengths and parts == [("drafter", n) for n in lengths] + [("target", n) for n in lengths]
    # The plain config warms a copy of that cache: its drafter graphs are the same, so they load
    # instead of compiling cold a second time. The key and dynamo's graph count do not depend on
    # what the cache dir holds.
    shutil.copytree(tmp_path / "cache", tmp_path / "plain")
    plain = _warm(tmp_path, tmp_path / "plain", *sets[:2])

    def first(events: list[dict], kind: str) -> dict:
        return next(e for e in events if e["event"] == kind)

    assert first(plain, "fingerprint")["key"] != first(cold, "fingerprint")["key"], "part of the key"
    graphs = first(cold, "done")["counters"]["graphs"], first(plain, "done")["counters"]["graphs"]
    assert graphs[0] > graphs[1], f"the target's layers compiled graphs of their own: {graphs}"
    again = _warm(tmp_path, tmp_path / "cache", *sets)
    c = first(again, "done")["counters"]
    assert c["fxgraph_misses"] == 0 and c["fxgraph_hits"] > 0, c
