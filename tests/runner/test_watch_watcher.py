"""The Watcher: any line stream in, (Snapshot, findings) out; a silent or ended sampler is a finding,
not a frozen dashboard."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from test_watch_fakes import healthy_sample, write_heartbeat

from runner.watch.bundle import sampler_argv
from runner.watch.thresholds import Thresholds
from runner.watch.watcher import Watcher, start_sampler

T0 = 1_800_000_000.0


def test_lines_from_a_list_noise_kept_aside() -> None:
    lines = [
        json.dumps(healthy_sample(T0)),
        "Warning: Permanently added 'gpu-host'",
        "",
        json.dumps(healthy_sample(T0 + 1)),
    ]
    w = Watcher(lines)
    snap, findings = w.refresh(timeout=2.0)
    assert snap.t == T0 + 1 and findings == []
    assert list(w.noise) == ["Warning: Permanently added 'gpu-host'"]
    assert len(w.history.snapshots) == 2 and len(snap.metrics) == 2


def test_silent_sampler_is_a_finding_and_refresh_never_blocks() -> None:
    release = threading.Event()

    def stuck() -> Iterator[str]:
        yield json.dumps(healthy_sample(T0))
        release.wait(30)  # a host that stopped answering

    now = [100.0]
    w = Watcher(stuck(), Thresholds(sampler_silent_s=10), clock=lambda: now[0])
    snap, findings = w.refresh(timeout=2.0)
    assert snap.source == "ok" and findings == []
    now[0] += 30
    t0 = time.monotonic()
    snap, findings = w.refresh(timeout=0.2)
    assert time.monotonic() - t0 < 1.0
    assert snap.source == "silent" and snap.sample_age_s == 30
    assert [(f.kind, f.severity) for f in findings] == [("sampler", "critical")]
    assert "no sample from gpu-host for 30 s" in findings[0].message
    release.set()


def test_ended_sampler() -> None:
    now = [100.0]
    w = Watcher([json.dumps(healthy_sample(T0))], clock=lambda: now[0])
    assert w.refresh(timeout=2.0)[1] == [], "a --once sampler ending right after its line is fine"
    now[0] += 60
    snap, findings = w.refresh(timeout=0.1)
    assert snap.source == "ended" and w.ended and "exited" in findings[0].message


def test_local_sampler_subprocess_over_eight_fake_gpus(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_heartbeat(run, "drafter-0")
    spec = tmp_path / "fake.json"
    spec.write_text(json.dumps({"gpus": [{"util_gpu": 10 * i, "mem_used_mb": 1000 * i} for i in range(8)]}))
    proc = start_sampler(sampler_argv(run, interval_s=0.2, python=sys.executable, fake_nvml=spec))
    try:
        w = Watcher(proc.stdout)
        deadline = time.monotonic() + 20
        snap, _ = w.refresh(timeout=5.0)
        while len(w.history.snapshots) < 3 and time.monotonic() < deadline:
            snap, _ = w.refresh(timeout=1.0)
        assert len(w.history.snapshots) >= 3
        assert [g.util_gpu for g in snap.gpus] == [10.0 * i for i in range(8)] and snap.nvml == "ok"
        assert snap.worker("drafter-0") is not None and snap.worker("drafter-0").alive is True
    finally:
        proc.kill()
        proc.wait()


def test_a_failing_sampler_says_why_in_noise() -> None:
    proc = start_sampler([sys.executable, "-", "--no-such-option"])
    try:
        w = Watcher(proc.stdout)
        deadline = time.monotonic() + 20
        while not w.ended and time.monotonic() < deadline:
            w.refresh(timeout=0.5)
        assert w.ended and any("--run-dir" in line for line in w.noise), list(w.noise)
    finally:
        proc.kill()
        proc.wait()
