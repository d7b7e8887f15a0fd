import json
import os
import time
from pathlib import Path

import pytest

from dflash.rundir import Heartbeat, RunDir, format_status_line, parse_status_line, read_jsonl

FIELD_23M = (
    "[23m] step=14 loss=10.6894 acc=0.011 streak=0.0 lr=7.53e-06 noise=0.0006 | tgt=0.11b/s "
    "dft=0.11b/s (4.6Ktok/s) | q_pre=[50, 46, 48, 46, 47] q_hs=[0] | epoch~0.01 ETA=36.9d"
)
FIELD_14M = (
    "[14m] step=12 loss=--- acc=--- streak=--- lr=--- noise=0.0005 | tgt=0.11b/s dft=0.10b/s "
    "(4.2Ktok/s) | q_pre=[50, 47, 48, 50, 49] q_hs=[2] | epoch~0.01 ETA=37.5d"
)


def test_parse_field_lines():
    m = parse_status_line(FIELD_23M)
    assert m["step"] == 14 and m["loss"] == pytest.approx(10.6894) and m["acc"] == pytest.approx(0.011)
    assert m["q_pre"] == [50, 46, 48, 46, 47] and m["q_hs"] == [0]
    assert m["tok_s"] == pytest.approx(4600) and m["eta_s"] == pytest.approx(36.9 * 86400)
    m2 = parse_status_line(FIELD_14M)
    assert (
        m2["loss"] is None and m2["lr"] is None and m2["q_hs"] == [2] and m2["dft_bps"] == pytest.approx(0.10)
    )
    with pytest.raises(ValueError):
        parse_status_line("step=1 loss=2")


def test_format_round_trips_field_line():
    assert format_status_line(parse_status_line(FIELD_23M)) == FIELD_23M
    assert format_status_line(parse_status_line(FIELD_14M)) == FIELD_14M


def test_events_metrics_and_torn_line(tmp_path):
    run = RunDir(tmp_path / "r").create()
    run.event("started", step=0)
    run.metric({"step": 1, "loss": float("nan")})
    with open(run.events, "a") as f:
        f.write('{"event": "torn"')  # a writer killed mid-line
    assert [e["event"] for e in run.read_events()] == ["started"]
    assert run.read_metrics()[0]["loss"] is None  # NaN is not JSON
    assert list(read_jsonl(tmp_path / "missing.jsonl")) == []


def test_heartbeat_rewritten_while_blocked(tmp_path):
    run = RunDir(tmp_path / "r").create()
    hb = Heartbeat(run, "drafter", 2, rank=2, device="cpu", interval_s=0.1).start()
    hb.set("waiting_input")
    first = json.loads(run.heartbeat_path("drafter", 2).read_text())
    # The worker is "blocked": no calls, yet the file keeps being rewritten (polled, not a fixed
    # sleep: a loaded CI machine may schedule the heartbeat thread late, but it must come).
    deadline = time.time() + 10
    second = first
    while second["updated_at"] == first["updated_at"] and time.time() < deadline:
        time.sleep(0.05)
        second = json.loads(run.heartbeat_path("drafter", 2).read_text())
    assert second["updated_at"] > first["updated_at"]
    assert second["state"] == "waiting_input" and second["pid"] == os.getpid() and second["rank"] == 2
    hb.set("computing", progress=True, step=5)
    hb.stop()
    final = json.loads(run.heartbeat_path("drafter", 2).read_text())
    assert final["state"] == "stopped" and final["step"] == 5
    assert not list(run.workers.glob(".*.tmp"))  # no temp files left behind
    with pytest.raises(ValueError):
        hb.set("sleeping")


def test_read_jsonl_from_tails_without_rereading(tmp_path):
    from dflash.rundir import append_jsonl, read_jsonl_from

    path = tmp_path / "m.jsonl"
    assert read_jsonl_from(path, 0) == ([], 0)
    append_jsonl(path, {"step": 1})
    recs, off = read_jsonl_from(path, 0)
    assert recs == [{"step": 1}]
    with open(path, "a") as f:
        f.write('{"step": 2')  # a writer mid-line
    recs, off2 = read_jsonl_from(path, off)
    assert recs == [] and off2 == off
    with open(path, "a") as f:
        f.write("}\n")
    assert read_jsonl_from(path, off2)[0] == [{"step": 2}]


def test_supervisor_token_tells_live_from_dead_and_zombie():
    import subprocess

    from dflash.rundir import supervisor_alive, supervisor_token

    assert supervisor_alive(supervisor_token())
    child = subprocess.Popen(["sleep", "0"])
    token = f"{child.pid}:{supervisor_token().split(':')[1]}"  # a pid with someone else's start time
    assert not supervisor_alive(token), "a reused pid is told apart by its start time"
    deadline = time.time() + 10
    while time.time() < deadline:  # exited, not reaped: a zombie is dead
        if Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    from dflash.rundir import _proc_stat

    zombie = f"{child.pid}:{_proc_stat(child.pid)[1]}"
    assert not supervisor_alive(zombie)
    child.wait()
    assert not supervisor_alive(zombie) and not supervisor_alive("garbage")


def test_heartbeat_state_since_moves_only_when_the_state_changes(tmp_path):
    """watch limits how long a state lasts (runner.watch.detect_workers.stuck_state) from this."""
    run = RunDir(tmp_path / "r").create()
    hb = Heartbeat(run, "drafter", 0, rank=0, device="cpu", interval_s=10).start()
    born = hb.get()["state_since"]
    hb.set("compiling")
    since = hb.get()["state_since"]
    assert since >= born
    time.sleep(0.02)
    hb.set("compiling", step=1)  # the same state again: its start stays
    assert hb.get()["state_since"] == since
    hb.set("computing", progress=True)
    assert hb.get()["state_since"] > since
    on_disk = json.loads(run.heartbeat_path("drafter", 0).read_text())
    assert on_disk["state_since"] == hb.get()["state_since"]
    hb.stop()


def test_heartbeat_state_s_adds_up_the_time_in_each_state(tmp_path):
    """state_s: the seconds in each state so far, the current one up to the write; over a window the
    states' shares add up to its length (bench/pipeline.py's gap profile reads two samples)."""
    run = RunDir(tmp_path / "r").create()
    hb = Heartbeat(run, "target", 0, device="cpu", interval_s=10).start()
    hb.set("computing")
    time.sleep(0.2)
    hb.set("waiting_output")
    time.sleep(0.1)
    hb.set("waiting_output", q_pre=3)  # the same state again: its time runs on
    time.sleep(0.1)
    hb.set("computing")
    time.sleep(0.05)
    hb.set(step=1)
    on_disk = json.loads(run.heartbeat_path("target", 0).read_text())
    s = on_disk["state_s"]
    assert s["computing"] == pytest.approx(0.25, abs=0.04)
    assert s["waiting_output"] == pytest.approx(0.2, abs=0.04)
    assert sum(s.values()) == pytest.approx(on_disk["updated_at"] - on_disk["started_at"], abs=0.005)
    later = hb.get()["state_s"]
    assert later["computing"] > s["computing"] and later["waiting_output"] == s["waiting_output"]
    hb.stop()
