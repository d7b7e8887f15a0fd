"""The sampler: incremental JSONL reads, heartbeats joined to processes and GPUs, the line schema, and
the self-contained program that runs the same code on a host with nothing but python3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_watch_fakes import (
    add_proc,
    append_jsonl,
    hold_lock,
    manifest,
    own_start_time,
    proc_root,
    write_heartbeat,
)

from runner.watch.bundle import bundle_source, sampler_argv
from runner.watch.fakenvml import FakeGPU, FakeNVML
from runner.watch.nvml import NVML
from runner.watch.procinfo import ProcessProbe
from runner.watch.sampler import JsonlTail, SamplerState, device_index, dumps, read_heartbeats, sample_once


def test_jsonl_tail_reads_new_records_and_waits_for_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tail = JsonlTail(path, first_read_max_bytes=1 << 20)
    assert tail.read() == []  # not there yet
    append_jsonl(path, {"a": 1}, {"a": 2})
    assert tail.read() == [{"a": 1}, {"a": 2}]
    with open(path, "a") as f:
        f.write('{"a": 3')  # a writer mid-record
    assert tail.read() == []
    with open(path, "a") as f:
        f.write("}\nnot json\n")
    assert tail.read() == [{"a": 3}]
    path.write_text('{"a": 9}\n')  # replaced by a shorter file: start over
    assert tail.read() == [{"a": 9}]


def test_jsonl_tail_first_read_starts_at_a_line_boundary(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    append_jsonl(path, *({"i": i, "pad": "x" * 50} for i in range(1000)))
    records = JsonlTail(path, first_read_max_bytes=2000).read()
    assert 20 < len(records) < 40 and records[-1]["i"] == 999
    assert [r["i"] for r in records] == list(range(1000 - len(records), 1000))


def test_device_index_and_heartbeat_files(tmp_path: Path) -> None:
    assert [device_index(d) for d in ("cuda:5", "cuda", "cpu", None)] == [5, 0, None, None]
    write_heartbeat(tmp_path, "drafter-0")
    (tmp_path / "workers" / "target-0.data.json").write_text("{}")
    (tmp_path / "workers" / ".drafter-1.json.abc.tmp").write_text("{")
    (tmp_path / "workers" / "drafter-2.json").write_text("{torn")
    assert list(read_heartbeats(tmp_path / "workers")) == ["drafter-0"]


def _state(run: Path, proc: Path, fake: FakeNVML, **kw: object) -> SamplerState:
    return SamplerState(
        run, nvml=NVML(fake), probe=ProcessProbe(proc, hostname="gpu-host"), host="gpu-host", **kw
    )  # type: ignore[arg-type]


def _locked_run(tmp_path: Path, now: float) -> tuple[Path, Path]:
    """A run directory whose job.lock pid 41000 holds, and the fake /proc that says so."""
    run = tmp_path / "run"
    proc = proc_root(tmp_path, now - 86400)
    (run / "workers").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps(manifest()))
    (run / "job.lock").write_text("41000\n")
    hold_lock(proc, run / "job.lock", 41000)
    return run, proc


def test_sample_schema_gpu_join_and_increments(tmp_path: Path) -> None:
    now = time.time()
    run, proc = _locked_run(tmp_path, now)
    # target-0 in this namespace; drafter-0 in a container (pid 7 inside, 41007 on the host); drafter-1 gone.
    add_proc(proc, 500, start=now - 100)
    add_proc(proc, 41007, start=now - 100, nspid=(41007, 7))
    write_heartbeat(run, "target-0", pid=500, device="cuda:0", started_at=now - 90, q_pre=50)
    write_heartbeat(run, "drafter-0", pid=7, host="c0ffee", device="cuda:0", started_at=now - 90)
    write_heartbeat(
        run, "drafter-1", pid=8, host="c0ffee", device="cuda:1", started_at=now - 90, updated_at=now - 30
    )
    fake = FakeNVML(
        [
            FakeGPU(mem_used_mb=1000, procs=[[500, 300.0], [41007, 20.0]]),  # drafter-0's stray context
            FakeGPU(mem_used_mb=9000, procs=[[41007, 8000.0], [99999, 5.0]]),  # 99999: already exited
        ]
    )
    append_jsonl(
        run / "metrics.jsonl", *({"t": now, "step": i, "q_pre": [50], "q_hs": [1]} for i in range(5))
    )
    append_jsonl(
        run / "events.jsonl", {"event": "started"}, {"event": "batch"}, {"event": "degraded", "kind": "x"}
    )
    state = _state(run, proc, fake, backlog=3)

    s = sample_once(state)
    assert s["v"] == 1 and s["host"] == "gpu-host" and s["nvml"] == "ok" and s["run_dir_exists"]
    assert s["job"] == {"lock_pid": 41000, "lock_held": True}
    assert s["manifest"]["config"]["pipeline"]["prefetch_depth"] == 50
    assert [m["step"] for m in s["metrics"]] == [2, 3, 4], "the backlog keeps the newest records"
    assert [e["event"] for e in s["events"]] == ["started", "degraded"], "batch records are left out"
    assert s["xid"] == [] and len(s["gpus"]) == 2
    w = s["workers"]
    assert w["target-0"]["alive"] and w["target-0"]["host_pid"] == 500 and w["target-0"]["gpu_index"] == 0
    assert w["target-0"]["gpu_mem_mb"] == 300.0 and w["target-0"]["gpu_match"] == "pid"
    d0 = w["drafter-0"]
    assert d0["alive"] and d0["host_pid"] == 41007, "the container pid found through NSpid"
    assert d0["gpu_index"] == 1 and d0["gpu_mem_mb"] == 8000.0, "the bigger context, not the stray one"
    assert d0["proc_state"] == "sleeping" and d0["rss_mb"] == pytest.approx(100, abs=0.1)
    d1 = w["drafter-1"]
    assert d1["alive"] is False and d1["proc_state"] == "gone" and d1["age_s"] >= 29
    assert d1["gpu_index"] == 1 and d1["gpu_match"] == "device"
    json.loads(dumps(s))  # NA and all: one JSON line

    append_jsonl(run / "metrics.jsonl", {"t": now, "step": 5})
    s2 = sample_once(state)
    assert [m["step"] for m in s2["metrics"]] == [5] and s2["events"] == []
    assert "manifest" not in s2, "run.json is sent again only when it changes"
    (run / "run.json").write_text(json.dumps(manifest(queue_depth=16)))
    assert sample_once(state)["manifest"]["config"]["pipeline"]["queue_depth"] == 16


def test_sample_without_a_run_directory_or_nvml(tmp_path: Path) -> None:
    state = SamplerState(tmp_path / "absent", nvml=NVML(FakeNVML([], init_error=12)))
    s = sample_once(state)
    assert s["run_dir_exists"] is False and s["workers"] == {} and s["gpus"] == []
    assert s["nvml"] == "unavailable: libnvidia-ml.so not found"
    assert s["job"] == {"lock_pid": None, "lock_held": False}


def _spec(tmp_path: Path) -> Path:
    spec = tmp_path / "fake.json"
    spec.write_text(json.dumps({"gpus": [{"mem_used_mb": 123, "util_gpu": 42}], "xids": [[0, 79]]}))
    return spec


def test_bundle_runs_on_a_bare_python_with_only_the_standard_library(tmp_path: Path) -> None:
    """The program ssh feeds to `python3 -`: /usr/bin/python3 -I has no venv, no psutil, no pynvml,
    and (cwd elsewhere) no runner package: everything it runs comes in the bundle."""
    run = tmp_path / "run"
    write_heartbeat(run, "drafter-0", pid=os.getpid())
    bare = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    argv = sampler_argv(run, once=True, python=bare, fake_nvml=_spec(tmp_path))
    argv.insert(1, "-I")
    out = subprocess.run(
        argv, input=bundle_source(), capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1
    s = json.loads(lines[0])
    assert s["gpus"][0]["mem_used_mb"] == 123 and s["gpus"][0]["util_gpu"] == 42
    assert [(x["gpu"], x["xid"]) for x in s["xid"]] == [(0, 79)]
    assert s["workers"]["drafter-0"]["alive"] is True
    # Without the fake: the bundled pynvml, finding no driver here, says so.
    argv = sampler_argv(run, once=True, python=bare)
    argv.insert(1, "-I")
    out = subprocess.run(
        argv, input=bundle_source(), capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["nvml"].startswith("unavailable: ")


def test_module_entry_point_prints_a_line_per_interval(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner.watch.sampler", "--run-dir", str(run), "--interval", "0.2"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert proc.stdout is not None
        t = [json.loads(proc.stdout.readline())["t"] for _ in range(4)]
    finally:
        proc.kill()
        proc.wait()
    gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
    assert all(0.1 < g < 1.0 for g in gaps), gaps


def test_keep_writes_compact_samples_only_while_holding_the_watch_lock(tmp_path: Path) -> None:
    """--keep: the sampler holding <run>/watch/lock appends one compact GPU and worker record per
    line to watch/samples.jsonl (what `report` plots); a second sampler on the run writes nothing."""
    run = tmp_path / "run"
    write_heartbeat(run, "drafter-0", device="cuda:0", step=7, started_at=own_start_time())
    fake = FakeNVML([FakeGPU(mem_used_mb=5000, util_gpu=88, temp_c=61, procs=[[os.getpid(), 4000.0]])])
    keeper = SamplerState(run, nvml=NVML(fake), host="gpu-host")
    keeper.keep = True
    reader = SamplerState(run, nvml=NVML(fake), host="gpu-host")
    reader.keep = True
    off = SamplerState(run, nvml=NVML(fake), host="gpu-host")  # no --keep (watch --once)
    try:
        assert sample_once(keeper)["watch_lock"] == "held"
        assert sample_once(reader)["watch_lock"] == "other"
        assert sample_once(off)["watch_lock"] == "off"
        s = sample_once(keeper)
        kept = [json.loads(line) for line in (run / "watch" / "samples.jsonl").read_text().splitlines()]
        assert len(kept) == 2 and kept[1]["t"] == s["t"] and kept[1]["host"] == "gpu-host"
        assert kept[1]["gpus"] == [{"index": 0, "util_gpu": 88, "mem_used_mb": 5000.0, "mem_total_mb": 143771.0,
                                    "temp_c": 61, "power_w": 80.0, "throttle": []}]  # fmt: skip
        assert kept[1]["workers"] == {
            "drafter-0": {"state": "computing", "step": 7, "alive": True, "gpu_index": 0}
        }
        assert (run / "watch" / "lock").read_text().strip() == str(os.getpid())
        # A full disk (here: watch/ replaced by a file) must not stop the monitor.
        (run / "watch" / "samples.jsonl").unlink()
        (run / "watch" / "samples.jsonl").mkdir()
        assert sample_once(keeper)["watch_lock"] == "held"
    finally:
        for st in (keeper, reader):
            if st._lock_fd is not None:
                os.close(st._lock_fd)


def test_a_job_that_ends_between_the_reads_is_never_seen_stopped_without_its_records(tmp_path: Path) -> None:
    """The job writes its "stopped" event, then releases job.lock as it exits. If that happens while
    a sample is being taken, the sample shows the lock held (the job was running when it was read),
    never a free lock without the event (a "not running" warning for a completed job: the demo
    test's flake of 2026-12-03)."""
    run, proc = _locked_run(tmp_path, time.time())
    append_jsonl(run / "events.jsonl", {"event": "started"})
    state = _state(run, proc, FakeNVML([]))
    read_events = state.events.read

    def job_ends_right_after_this_read() -> list:
        records = read_events()
        append_jsonl(run / "events.jsonl", {"event": "stopped", "reason": "completed"})
        (proc / "locks").write_text("")  # the job exited
        return records

    state.events.read = job_ends_right_after_this_read  # type: ignore[method-assign]
    s = sample_once(state)
    stopped = [e for e in s["events"] if e["event"] == "stopped"]
    assert s["job"]["lock_held"] is True or stopped, s["job"]
    state.events.read = read_events  # type: ignore[method-assign]
    after = sample_once(state)
    assert after["job"]["lock_held"] is False and [e["event"] for e in after["events"]] == ["stopped"]
