"""watch's actions, driven with snapshots: the plan (plan_actions), the restart cap per time window,
targets left alone unless asked, recoveries shown, and one acting watch per run (the lock)."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

from test_watch_fakes import healthy_sample

from runner.errors import RunnerError
from runner.launch.registry import HostRecord, RunRecord
from runner.watch.actions import Action, Actor, ActorState, Policy, plan_actions
from runner.watch.detectors import detect
from runner.watch.live import done_line, view
from runner.watch.session import WatchSession
from runner.watch.snapshot import History, Snapshot

T0 = 1_800_000_000.0
FROZEN = {"age_s": 30.0, "progress_age_s": 30.0, "proc_state": "stopped"}
"""A SIGSTOPped worker: its process is there, its heartbeat is not rewritten."""


def judged(**workers: dict[str, Any]) -> tuple[Snapshot, list[Any]]:
    s = copy.deepcopy(healthy_sample(T0))
    for name, fields in workers.items():
        s["workers"][name].update(fields)
    h = History()
    h.ingest(s)
    return h.snapshots[-1], detect(h.snapshots)


def stopped_badly() -> tuple[Snapshot, list[Any]]:
    s = copy.deepcopy(healthy_sample(T0))
    s["job"] = {"lock_pid": None, "lock_held": False}
    s["events"] = [{"t": T0 - 5, "event": "stopped", "reason": "target-0 died (exit code 1)"}]
    h = History()
    h.ingest(s)
    return h.snapshots[-1], detect(h.snapshots)


def plan(snap: Snapshot, findings: list[Any], state: ActorState, policy: Policy, now: float,
         can_relaunch: bool = False) -> list[tuple[str, str, int | None]]:  # fmt: skip
    acts = plan_actions(snap, findings, state, policy, now=now, can_relaunch=can_relaunch)
    return [(a.action, a.subject, a.pid) for a in acts]


def test_a_hung_drafter_gets_sigterm_then_sigkill_after_the_grace() -> None:
    snap, findings = judged(**{"drafter-0": FROZEN})
    assert ("hung_worker", "drafter-0") in {f.key for f in findings}
    policy, state = Policy(grace_s=15), ActorState()
    assert plan(snap, findings, state, policy, now=T0) == [("terminate", "drafter-0", 1002)]
    state.terminated["drafter-0"] = (T0, 1002)
    assert plan(snap, findings, state, policy, now=T0 + 14) == [], "inside the grace period"
    assert plan(snap, findings, state, policy, now=T0 + 15) == [("kill", "drafter-0", 1002)]
    state.killed.add(1002)
    assert plan(snap, findings, state, policy, now=T0 + 20) == [], "not signalled again while it dies"
    assert plan(snap, findings, state, Policy(restart=False), now=T0) == [], "--no-restart only reports"


def test_targets_are_never_acted_on_unless_asked() -> None:
    snap, findings = judged(**{"target-1": FROZEN})
    assert ("hung_worker", "target-1") in {f.key for f in findings}
    assert plan(snap, findings, ActorState(), Policy(), now=T0) == []
    asked = Policy(restart_targets=True)
    assert plan(snap, findings, ActorState(), asked, now=T0) == [("terminate", "target-1", 1001)]


def test_a_job_that_stopped_badly_is_relaunched_once_a_clean_stop_never() -> None:
    snap, findings = stopped_badly()
    state = ActorState()
    assert plan(snap, findings, state, Policy(), now=T0, can_relaunch=True) == [("relaunch", "run", None)]
    assert plan(snap, findings, state, Policy(), now=T0, can_relaunch=False) == [], (
        "foreground: nothing to relaunch through"
    )
    state.relaunched_at = T0
    assert plan(snap, findings, state, Policy(), now=T0 + 60, can_relaunch=True) == [], "a relaunch under way"
    s = copy.deepcopy(healthy_sample(T0))
    s["job"] = {"lock_pid": None, "lock_held": False}
    s["events"] = [{"t": T0 - 5, "event": "stopped", "reason": "completed"}]
    h = History()
    h.ingest(s)
    assert plan(h.snapshots[-1], detect(h.snapshots), ActorState(), Policy(), now=T0, can_relaunch=True) == []


class Host:
    """What an Actor reaches on a host: signals and relaunches recorded, events kept."""

    def __init__(self, fail: bool = False) -> None:
        self.signals: list[tuple[str, int]] = []
        self.relaunches = 0
        self.events: list[dict[str, Any]] = []
        self.fail = fail

    def signal(self, sig: str, pid: int, started_at: float | None) -> None:
        if self.fail:
            raise RunnerError("ssh: connection refused")
        self.signals.append((sig, pid))

    def relaunch(self) -> None:
        self.relaunches += 1

    def actor(self, policy: Policy, clock: list[float]) -> Actor:
        return Actor(policy, signal_host=self.signal, relaunch=self.relaunch,
                     log_event=lambda event, **f: self.events.append({"event": event, **f}),
                     clock=lambda: clock[0])  # fmt: skip


def test_spent_caps_are_a_finding_with_what_watch_did_and_until_when() -> None:
    """watch at its cap said nothing and ran on silently: now a finding says what it did, when it
    may act again and what a person should do; critical while it withholds an action."""
    clock = [T0]
    host = Host()
    actor = host.actor(Policy(grace_s=0, max_actions=1, window_s=600), clock)
    snap, findings = judged(**{"drafter-0": {**FROZEN, "pid": 1002, "host_pid": 1002}})
    assert actor.standing(snap, findings) == [], "under the cap: nothing to say"
    actor.act(snap, findings)
    clock[0] += 1
    actor.act(snap, findings)  # SIGKILL: the one action of the window
    clock[0] += 60
    snap, findings = judged(**{"drafter-0": {**FROZEN, "pid": 2002, "host_pid": 2002}})  # hung again
    (f,) = actor.standing(snap, findings)
    assert (f.severity, f.kind, f.subject) == ("critical", "watch_capped", "watch")
    assert "spent its 1 kills and relaunches of the last 10 min (kill drafter-0 at " in f.message
    assert "will not act again until " in f.message and "(in 9 min)" in f.message
    assert "it would now act on drafter-0" in f.message and "dflashctl stop RUN" in f.advice
    assert f.numbers["until"] == T0 + 1 + 600 and actor.act(snap, findings) == []
    healthy, quiet = judged()
    (g,) = actor.standing(healthy, quiet)
    assert g.severity == "warning" and "would now act" not in g.message, "spent, with nothing withheld"
    clock[0] = T0 + 602
    assert actor.standing(healthy, quiet) == [], "the window passed: watch acts again"


def test_restarts_are_capped_per_window() -> None:
    """Each kill and relaunch counts; at the cap watch only reports until the window has passed."""
    clock = [T0]
    host = Host()
    actor = host.actor(Policy(grace_s=0, max_actions=2, window_s=600), clock)
    for pid in (1002, 2002, 3002):  # the drafter hangs again after each restart, with a new pid
        snap, findings = judged(**{"drafter-0": {**FROZEN, "pid": pid, "host_pid": pid}})
        actor.act(snap, findings)  # SIGTERM (under the cap)
        clock[0] += 1
        actor.act(snap, findings)  # SIGKILL after the (zero) grace: counts
        clock[0] += 60
    assert host.signals == [("SIGTERM", 1002), ("SIGKILL", 1002), ("SIGTERM", 2002), ("SIGKILL", 2002)]
    snap, findings = stopped_badly()
    assert actor.act(snap, findings) == [], "the cap holds relaunches too"
    clock[0] = T0 + 601 + 60  # the first kill (at T0 + 1) is out of the window
    assert [a.action for a in actor.act(snap, findings)] == ["relaunch"] and host.relaunches == 1
    assert [(e["event"], e["action"], e["source"]) for e in host.events] == [
        ("action", "terminate", "watch"), ("action", "kill", "watch"),
        ("action", "terminate", "watch"), ("action", "kill", "watch"), ("action", "relaunch", "watch"),
    ]  # fmt: skip


def test_a_failed_signal_is_recorded_not_raised() -> None:
    host = Host(fail=True)
    actor = host.actor(Policy(), [T0])
    snap, findings = judged(**{"drafter-0": FROZEN})
    assert actor.act(snap, findings) == [Action(action="terminate", subject="drafter-0", pid=1002,
        started_at=snap.worker("drafter-0").heartbeat.get("started_at"), detail=actor.done[0]["detail"])]  # fmt: skip
    assert actor.done[0]["ok"] is False and "connection refused" in actor.done[0]["error"]
    assert host.events[0]["ok"] is False and "drafter-0" not in actor.state.terminated


def test_findings_reported_once_and_the_recovery_shown() -> None:
    clock = [T0]
    host = Host()
    actor = host.actor(Policy(), clock)
    dead = {"alive": False, "proc_state": "gone", "host_pid": None}
    for _ in range(3):
        actor.report(*judged(**{"drafter-0": dead}))
        clock[0] += 1
    findings = [e for e in host.events if e["event"] == "finding"]
    assert [(e["kind"], e["subject"], e["source"]) for e in findings] == [
        ("dead_worker", "drafter-0", "watch")
    ]
    actor.report(*judged(**{"drafter-0": {"step": 500}}))  # back, but not past the step it died at
    assert not [e for e in host.events if e["event"] == "recovered"] and actor.done == []
    clock[0] += 19
    actor.report(*judged(**{"drafter-0": {"step": 501}, "drafter-1": {"step": 501}}))
    (rec,) = [e for e in host.events if e["event"] == "recovered"]
    assert rec["subject"] == "drafter-0" and rec["after_s"] == 22.0 and rec["source"] == "watch"
    (shown,) = actor.done
    assert (
        shown["event"] == "recovered" and "training again (step 501, was 500) 22 s later" in shown["detail"]
    )
    assert done_line(shown).startswith("recovered ") and done_line(shown).endswith("22 s later")


def _session(run: Path, spec: Path) -> WatchSession:
    rec = RunRecord(run_id=run.name, name=run.name, backend="tmux", created_at=0.0, config="",
                    hosts=[HostRecord(node_rank=0, host=None, run_dir=str(run))])  # fmt: skip
    return WatchSession(rec, interval_s=0.1, fake_nvml=str(spec))


def _refresh_until(session: WatchSession, lines: int) -> None:
    deadline = time.monotonic() + 20
    while len(session.hosts[0].watcher.history.snapshots) < lines and time.monotonic() < deadline:
        session.refresh(timeout=1.0)


def test_one_watch_acts_a_second_is_read_only_and_says_so(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "run", "config": {}}))  # no job.lock: not running
    spec = tmp_path / "nvml.json"
    spec.write_text(json.dumps({"gpus": []}))
    first = _session(run, spec)
    try:
        _refresh_until(first, 2)
        second = _session(run, spec)
        try:
            _refresh_until(second, 3)
            assert first.hosts[0].acting and not second.hosts[0].acting
            assert "read-only: another watch acts on this run" in str(view(second).renderables[0].title)
            assert "read-only" not in str(view(first).renderables[0].title)
            # Both see the stopped job; only the acting watch writes its finding, once.
            assert [hw.findings[0].kind for hw in (first.hosts[0], second.hosts[0])] == ["job_stopped"] * 2
            events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
            assert [(e["event"], e["kind"], e["pid"]) for e in events] == [
                ("finding", "job_stopped", events[0]["pid"])
            ]
        finally:
            second.close()
        first.close()
        # The lock goes with the first watch's sampler: a new watch acts.
        third = _session(run, spec)
        try:
            _refresh_until(third, 2)
            assert third.hosts[0].acting
        finally:
            third.close()
    finally:
        first.close()
