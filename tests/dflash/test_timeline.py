"""dflash/pipeline/timeline.py: the phases of a start from the spawner's stamps and this process's
own marks (the whole job's restart is tests/dflash/test_pipeline.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from dflash.pipeline import timeline as tl_mod
from dflash.pipeline.timeline import (
    DETECTED_AT_ENV,
    LAUNCHED_AT_ENV,
    SPAWNED_AT_ENV,
    STOPPED_AT_ENV,
    Timeline,
    process_start_time,
)


def test_process_start_is_the_kernels_to_the_tens_of_milliseconds() -> None:
    before = time.time()
    out = subprocess.run(
        [sys.executable, "-c", "from dflash.pipeline.timeline import process_start_time as p; print(p())"],
        capture_output=True,
        text=True,
        check=True,
    )
    started = float(out.stdout)
    assert before - 0.05 <= started <= before + 0.5, (before, started)
    own = process_start_time()
    assert own is not None and own < before


def _timeline(monkeypatch: pytest.MonkeyPatch, started: float, **stamps: float) -> Timeline:
    for name in (LAUNCHED_AT_ENV, DETECTED_AT_ENV, STOPPED_AT_ENV, SPAWNED_AT_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in stamps.items():
        monkeypatch.setenv(name, repr(value))
    monkeypatch.setattr(tl_mod, "process_start_time", lambda: started)
    return Timeline()


def test_a_restart_runs_from_the_death_through_every_stamp(monkeypatch: pytest.MonkeyPatch) -> None:
    t = 1000.0
    tl = _timeline(
        monkeypatch,
        t + 3.0,
        **{DETECTED_AT_ENV: t + 0.5, STOPPED_AT_ENV: t + 1.5, SPAWNED_AT_ENV: t + 2.75},
    )
    tl.before_process(died_at=t)
    tl.mark("imports")
    fields = tl.fields()
    phases = [(p["phase"], p["start"], p["seconds"]) for p in fields["phases"]]
    assert phases[:4] == [
        ("death_detection", t, 0.5),
        ("stop_old_workers", t + 0.5, 1.0),
        ("respawn", t + 1.5, 1.25),
        ("process_start", t + 2.75, 0.25),
    ]
    assert phases[4][:2] == ("imports", t + 3.0)
    assert fields["origin"] == "death" and fields["origin_at"] == t
    assert fields["total_s"] == pytest.approx(sum(p[2] for p in phases), abs=0.005)


def test_a_missing_stamp_merges_into_the_next_phase_and_none_runs_backwards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = 1000.0
    # No stop stamp (a target's spawner has none); a spawn stamp a little before the detection.
    tl = _timeline(monkeypatch, t + 2.0, **{DETECTED_AT_ENV: t + 1.0, SPAWNED_AT_ENV: t + 0.9})
    tl.before_process(died_at=t)
    names = [(p.name, p.start, p.seconds) for p in tl.phases()]
    assert names == [("death_detection", t, 1.0), ("respawn", t + 1.0, 0.0), ("process_start", t + 1.0, 1.0)]


def test_a_first_start_runs_from_the_launch_or_the_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    t = 1000.0
    tl = _timeline(monkeypatch, t + 2.0, **{LAUNCHED_AT_ENV: t, SPAWNED_AT_ENV: t + 1.5})
    tl.before_process(died_at=None)
    assert [(p.name, p.seconds) for p in tl.phases()] == [("launcher_start", 1.5), ("process_start", 0.5)]
    assert tl.fields()["origin"] == "launch"
    tl = _timeline(monkeypatch, t + 2.0, **{SPAWNED_AT_ENV: t + 1.5})
    tl.before_process(died_at=None)
    assert [(p.name, p.seconds) for p in tl.phases()] == [("process_start", 0.5)]
    assert tl.fields()["origin"] == "spawn"
    tl = _timeline(monkeypatch, t + 2.0)
    tl.before_process(died_at=None)
    assert tl.phases() == [] and tl.fields()["origin"] == "process_start"
