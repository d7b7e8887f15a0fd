"""`dflashctl watch` at the CLI edge: --once --json exits with its verdict (0 healthy, 1 warnings,
2 critical) on a real run directory with fake NVML, and the option combinations it refuses."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_watch_fakes import append_jsonl, manifest, write_heartbeat
from typer.testing import CliRunner

from runner.cli import app


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    """A single-process CPU run, running: its job.lock held (by this process, as the job would),
    a fresh heartbeat of a live process and a fresh metrics record."""
    run = tmp_path / "run"
    run.mkdir()
    m = manifest()
    m["config"]["run"]["status_interval_s"] = 1.0
    del m["config"]["pipeline"]
    (run / "run.json").write_text(json.dumps(m))
    fd = os.open(run / "job.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\n".encode())
    write_heartbeat(run, "drafter-0", step=20)
    append_jsonl(run / "metrics.jsonl", {"t": time.time(), "elapsed_s": 60.0, "step": 20, "tok_s": 500.0})
    (tmp_path / "nvml.json").write_text(json.dumps({"gpus": []}))
    yield run
    os.close(fd)


def watch(run: Path, *args: str) -> tuple[int, str]:
    out = CliRunner().invoke(app, ["watch", str(run), *args, "--fake-nvml", str(run.parent / "nvml.json")])
    return out.exit_code, out.output


def verdict(run: Path) -> tuple[int, list[tuple[str, str]]]:
    code, out = watch(run, "--once", "--json")
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["exit_code"] == code, out
    return code, [(f["severity"], f["kind"]) for h in doc["hosts"] for f in h["findings"]]


def test_once_json_exits_0_healthy(run_dir: Path) -> None:
    assert verdict(run_dir) == (0, [])


def test_once_json_exits_1_on_a_warning(run_dir: Path) -> None:
    (run_dir / "metrics.jsonl").write_text(
        json.dumps({"t": time.time() - 120, "elapsed_s": 60.0, "step": 20}) + "\n"
    )
    assert verdict(run_dir) == (1, [("warning", "metrics_stale")])


def test_once_json_exits_2_on_a_critical_finding(run_dir: Path) -> None:
    write_heartbeat(run_dir, "drafter-1", pid=2**22 + 7, started_at=time.time() - 60)  # no such process
    code, findings = verdict(run_dir)
    assert code == 2 and ("critical", "dead_worker") in findings


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--json"], "--json prints one snapshot: use it with --once"),
        (["--once", "--prometheus", "9464"], "drop --once"),
        (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
        (["--restart-window", "0"], "--restart-window > 0"),
    ],
)
def test_refused_combinations_exit_2_and_say_why(run_dir: Path, args: list[str], says: str) -> None:
    code, out = watch(run_dir, *args)
    assert code == 2 and says in " ".join(out.split()), out


def test_the_prometheus_exporter_is_closed_when_watch_ends(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    run = tmp_path / "done"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(manifest()))
    append_jsonl(run / "events.jsonl", {"t": time.time(), "event": "stopped", "reason": "completed"})
    (tmp_path / "nvml.json").write_text(json.dumps({"gpus": []}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out = watch(run, "--interval", "0.2", "--prometheus", str(port))
    assert code == 0 and "the job completed" in out, out  # the run had finished: watch ends at once
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))
