"""Driving the real `dflashctl` CLI (a subprocess, as users run it) against a real job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shared_inputs import seed_runs_root

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo-cpu.toml")
SHARED_HOME = Path(tempfile.mkdtemp(prefix="dflash-test-home-"))
"""One $HOME for every job these tests launch in a pytest process: the managed compile caches live
in $HOME/.cache/dflashctl/compile/<key>, so only the first job compiles cold (tens of seconds on
2 cores) and the rest hit, as a user's second run would."""
LONG = [
    "--set",
    "train.total_steps=100000",
    "--set",
    "train.checkpoint_every=100000",
    "--set",
    "run.status_interval_s=1",
]


class Cli:
    """dflashctl with its own registry, cache store and runs root (nothing shared between tests)."""

    def __init__(self, tmp: Path, **env: str) -> None:
        self.runs = tmp / "runs"
        self.home = SHARED_HOME
        self.env = {
            **os.environ,
            "DFLASH_STATE_DIR": str(tmp / "state"),
            "DFLASH_CACHE_STORE": str(tmp / "store"),
            "XDG_CACHE_HOME": str(tmp / "xdg-cache"),
            "HOME": str(self.home),
            "COLUMNS": "400",  # rich wraps messages at the terminal width; keep each on one line
            **env,
        }

    def seed_runs_root(self) -> None:
        """The session's prepared demo inputs in this runs root (tests/shared_inputs.py): a job test's
        job then builds no tiny target and tokenizes no corpus (the refusal tests' runs roots stay
        as they are)."""
        seed_runs_root(self.runs)

    def __call__(
        self, *args: str, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "runner.cli", *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert proc.returncode == 0, (
                f"dflashctl {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def ps(self) -> list[dict[str, Any]]:
        return json.loads(self("ps", "--all", "--json").stdout)

    def wait_state(self, run_id: str, want: set[str], timeout: float = 240) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        row: dict[str, Any] = {}
        while time.monotonic() < deadline:
            row = next(r for r in self.ps() if r["run_id"] == run_id)
            if row["state"] in want:
                return row
            time.sleep(2)
        raise AssertionError(f"{run_id} never reached {want}: {row}")

    def wait_step(self, run_dir: Path, step: int, timeout: float = 240) -> None:
        """Until a drafter heartbeat reports at least `step` optimizer steps."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for hb in (run_dir / "workers").glob("drafter-*.json"):
                try:
                    if json.loads(hb.read_text()).get("step", 0) >= step:
                        return
                except (OSError, ValueError):
                    pass
            time.sleep(1)
        logs = "".join(
            f"\n--- {f.name}\n{f.read_text()[-2000:]}" for f in sorted((run_dir / "logs").glob("*.log"))
        )
        raise AssertionError(f"no drafter reached step {step} in {run_dir}{logs}")


def refused(cli: Cli, *args: str, want: str, code: int = 2) -> str:
    """`dflashctl ARGS` as a refusal: exit code `code`, one `error:` message holding `want` (its
    whitespace as one space: rich wraps), never a traceback. The whole output, for more checks."""
    out = cli(*args, check=False, timeout=120)
    text = out.stdout + out.stderr
    assert "Traceback" not in text, text
    assert out.returncode == code, f"dflashctl {' '.join(args)} -> {out.returncode}\n{text}"
    assert out.stderr.count("error:") == 1, text
    assert want in " ".join(out.stderr.split()), text
    return text


def recorded_pids(run_dir: Path) -> list[int]:
    """Every pid the run recorded: heartbeats, `launched` events and the lock file."""
    pids = set()
    for hb in (run_dir / "workers").glob("*-[0-9]*.json"):
        if not hb.name.endswith(".data.json"):
            pids.add(json.loads(hb.read_text())["pid"])
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "launched":
            pids.update(e["targets"].values())
            pids.add(e["drafter_group_pid"])
    pids.add(int((run_dir / "job.lock").read_text().split()[0]))
    return sorted(pids)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    out = []
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == kind:
            out.append(e)
    return out
