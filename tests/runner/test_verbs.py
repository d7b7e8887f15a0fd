"""attach, logs --follow and ps through the real CLI against real files, processes and tmux."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from run_cli import Cli

from runner.launch.control import attach_argv
from runner.launch.registry import HostRecord, Registry, RunRecord

# A stand-in supervisor holding job.lock (as the job does) until killed.
HOLDER = "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(300)"


def _register(cli: Cli, run_dir: Path, *, backend: str = "tmux", **host: str | None) -> RunRecord:
    rec = RunRecord(
        run_id=f"vb-{run_dir.name}",
        name=run_dir.name,
        backend=backend,
        created_at=time.time(),
        config="c.toml",
        hosts=[HostRecord(node_rank=0, host=host.pop("host", None), run_dir=str(run_dir), **host)],
    )
    Registry(Path(cli.env["DFLASH_STATE_DIR"])).save(rec)
    return rec


def _run_dir(tmp_path: Path, name: str, *events: dict[str, object]) -> Path:
    run_dir = tmp_path / "runs" / name
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "workers").mkdir()
    (run_dir / "run.json").write_text(json.dumps({"format": 1, "command_lines": ["python -m dflash.launch"]}))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "logs" / "supervisor.log").write_text("old 1\nold 2\n")
    return run_dir


@pytest.fixture
def holder() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _hold(run_dir: Path, procs: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir / "job.lock")], stdout=subprocess.PIPE, text=True
    )
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline() == "held\n"
    return p


def _sigint_default() -> None:
    # As in a terminal's foreground job: a suite started in the background (`cmd &` in a script)
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler in the child.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _follow(cli: Cli, ref: str, *, stderr: int | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "runner.cli", "logs", ref, "--follow", "-n", "1"],
        env=cli.env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        preexec_fn=_sigint_default,
    )


def test_logs_follow_streams_new_lines_and_ends_with_the_run(
    tmp_path: Path, holder: list[subprocess.Popen[str]]
) -> None:
    cli = Cli(tmp_path)
    run_dir = _run_dir(tmp_path, "fol", {"t": time.time(), "event": "launched"})
    sup = _hold(run_dir, holder)
    _register(cli, run_dir)
    logs = _follow(cli, "fol")
    assert logs.stdout is not None
    assert logs.stdout.readline() == "old 2\n", "the last --lines lines first"
    with (run_dir / "logs" / "supervisor.log").open("a") as f:
        f.write("new 3\n")
    assert logs.stdout.readline() == "new 3\n", "then each line as the job appends it"
    sup.kill()  # the run ends (and is reaped, as its shell does): following ends with it
    sup.wait()
    try:
        assert logs.wait(timeout=20) == 0
    finally:
        logs.kill()


def test_logs_follow_stops_when_asked_and_does_not_follow_an_ended_run(
    tmp_path: Path, holder: list[subprocess.Popen[str]]
) -> None:
    cli = Cli(tmp_path)
    run_dir = _run_dir(tmp_path, "ask", {"t": time.time(), "event": "launched"})
    _hold(run_dir, holder)
    _register(cli, run_dir)
    logs = _follow(cli, "ask")
    assert logs.stdout is not None and logs.stdout.readline() == "old 2\n"
    logs.send_signal(signal.SIGINT)  # Ctrl-C
    try:
        logs.wait(timeout=20)
    finally:
        logs.kill()

    ended = _run_dir(tmp_path, "done", {"t": time.time(), "event": "stopped", "reason": "completed"})
    _register(cli, ended)
    out = subprocess.run(
        [sys.executable, "-m", "runner.cli", "logs", "done", "--follow", "-n", "5"],
        env=cli.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and out.stdout == "old 1\nold 2\n", (
        "an ended run's log is printed, not followed"
    )


def _follow_then_remove(cli: Cli, run_dir: Path, ref: str, says: str = "") -> tuple[int, str]:
    """Follow a registered run's log, see its last line, remove its directory: how following ends."""
    logs = _follow(cli, ref, stderr=subprocess.PIPE)
    assert logs.stdout is not None and logs.stdout.readline() == "old 2\n", says
    shutil.rmtree(run_dir)
    return _ends(logs)


def _ends(logs: subprocess.Popen[str], timeout: float = 20) -> tuple[int, str]:
    try:
        _, err = logs.communicate(timeout=timeout)
    finally:
        logs.kill()
    return logs.returncode, err


def test_logs_follow_returns_when_the_run_directory_goes_away(
    tmp_path: Path, holder: list[subprocess.Popen[str]]
) -> None:
    """Following a running run whose directory is removed (its supervisor still there), and a run
    still starting (no lock yet, its files garbage) whose directory is removed: both return, exit 1,
    one line; before, `tail -F` followed a missing file for ever."""
    cli = Cli(tmp_path)
    run_dir = _run_dir(tmp_path, "rm", {"t": time.time(), "event": "launched"})
    _hold(run_dir, holder)
    _register(cli, run_dir)
    code, err = _follow_then_remove(cli, run_dir, "rm")
    assert code == 1 and "is gone: nothing more to follow" in err, err

    early = _run_dir(tmp_path, "early")
    (early / "run.json").write_text("[1, 2")  # torn: the job has not written it yet
    (early / "events.jsonl").write_bytes(b"\xff\xfe garbage\n")
    _register(cli, early)
    code, err = _follow_then_remove(cli, early, "early", "a starting run is followed")
    assert code == 1 and "is gone" in err and "Traceback" not in err, err


def test_logs_follow_returns_when_a_starting_run_ends(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    run_dir = _run_dir(tmp_path, "brief")
    (run_dir / "run.json").write_text(json.dumps({"format": 1}))  # no job yet: starting
    _register(cli, run_dir)
    logs = _follow(cli, "brief", stderr=subprocess.PIPE)
    assert logs.stdout is not None and logs.stdout.readline() == "old 2\n"
    with (run_dir / "logs" / "supervisor.log").open("a") as f:
        f.write("last words\n")
    with (run_dir / "events.jsonl").open("a") as f:
        f.write(json.dumps({"t": time.time(), "event": "stopped", "reason": "completed"}) + "\n")
    assert logs.stdout.readline() == "last words\n"
    code, err = _ends(logs)
    assert code == 0 and "the run is stopped" in err, err


def test_ps_shows_failed_for_a_job_that_exited_non_zero(tmp_path: Path) -> None:
    """The job's last record when it exits non-zero: `stopped` with a reason that is no clean stop."""
    cli = Cli(tmp_path)
    t = time.time()
    failed = _run_dir(
        tmp_path,
        "bad",
        {"t": t, "event": "launched"},
        {"t": t + 1, "event": "stopped", "reason": "drafter group failed: exit code 1"},
    )
    _register(cli, failed)
    ok = _run_dir(
        tmp_path,
        "good",
        {"t": t, "event": "launched"},
        {"t": t + 0.5, "event": "tau", "step": 200, "tau": 1.42},
        {"t": t + 0.6, "event": "tau", "step": 300, "tau": 1.87},
        {"t": t + 1, "event": "stopped", "reason": "completed"},
    )
    _register(cli, ok)
    rows = {r["name"]: r for r in cli.ps()}
    assert rows["good"]["tau"] == 1.87 and rows["bad"]["tau"] is None, "ps shows the newest tau"
    assert rows["bad"]["state"] == "failed" and rows["bad"]["reason"] == "drafter group failed: exit code 1"
    assert rows["good"]["state"] == "stopped"
    table = cli("ps", "--all").stdout
    assert any("bad" in line and "failed" in line for line in table.splitlines()), table
    assert any("good" in line and "1.87" in line for line in table.splitlines()), table
    assert json.loads(cli("ps", "--json").stdout) == [], "without --all, only running and starting runs"


def test_attach_argv_for_tmux_and_docker(tmp_path: Path) -> None:
    def rec(backend: str, **host: str | None) -> tuple[RunRecord, HostRecord]:
        h = HostRecord(node_rank=0, host=host.pop("host", None), run_dir="/r", **host)
        return RunRecord(run_id="r-1", name="r", backend=backend, created_at=0.0, config="c", hosts=[h]), h

    assert attach_argv(*rec("tmux", tmux_session="dflash-r-1", tmux_window="node0")) == [
        "tmux",
        "attach-session",
        "-t",
        "=dflash-r-1:node0",
    ]
    remote = attach_argv(*rec("tmux", host="root@10.0.0.5:2222", tmux_session="s", tmux_window="w"))
    assert remote[:2] == ["ssh", "-t"] and remote[-2:] == ["root@10.0.0.5", "tmux attach-session -t =s:w"]
    assert remote[remote.index("-p") : remote.index("-p") + 2] == ["-p", "2222"]
    assert attach_argv(*rec("docker", container="dflash-r-1-node0")) == [
        "docker",
        "attach",
        "--no-stdin",
        "--sig-proxy=false",
        "dflash-r-1-node0",
    ]
    with pytest.raises(Exception, match="foreground.*logs r-1 --follow"):
        attach_argv(*rec("foreground"))


@pytest.mark.skipif(not shutil.which("tmux"), reason="needs tmux")
def test_attach_target_names_the_real_tmux_window(tmp_path: Path) -> None:
    session = f"dflash-test-attach-{tmp_path.name}"[:48]
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-n", "node0", "sleep", "60"], check=True)
    try:
        argv = attach_argv(*_rec_for(session))
        panes = subprocess.run(
            ["tmux", "list-panes", "-t", argv[3], "-F", "#{window_name}"], capture_output=True, text=True
        )
        assert panes.returncode == 0 and panes.stdout.split() == ["node0"], panes.stderr
    finally:
        subprocess.run(["tmux", "kill-session", "-t", f"={session}"])


def _rec_for(session: str) -> tuple[RunRecord, HostRecord]:
    h = HostRecord(node_rank=0, host=None, run_dir="/r", tmux_session=session, tmux_window="node0")
    return RunRecord(run_id="r-1", name="r", backend="tmux", created_at=0.0, config="c", hosts=[h]), h
