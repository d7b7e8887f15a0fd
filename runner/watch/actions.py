"""What `dflashctl watch` does about its findings (--restart, on by default, drafters only).

- A dead drafter is the job's to handle: torchrun restarts the drafter group and the targets keep
  their weights. watch reports it, counts it, and checks the recovery: a drafter stepping past the
  step it died at.
- A hung drafter (alive, idle, no progress while its input waits; or a full GPU at 0% with no
  progress) is turned into a dead one: SIGTERM, then SIGKILL after a grace period. The group then
  restarts.
- A job that stopped for any reason but `completed` or a signal (its group's restarts spent, a
  target death) is relaunched through its backend: same run directory, so it resumes from the
  newest checkpoint.
- A worker on a GPU with a hardware fault (a critical XID, a lost GPU, uncorrected ECC errors) is
  left alone, and a stopped job on such a GPU is not relaunched: a restart would land on the GPU
  again. The findings say to drain it.
- Targets are never touched unless asked (--restart-targets). Kills and relaunches are capped per
  time window (--max-restarts per --restart-window: Policy.max_actions, Policy.window_s). Only the
  watch holding the run's watch lock acts (the sampler holds it on the host). Every finding, every
  action and every recovery is appended to events.jsonl with source `watch`; actions and
  recoveries are also kept in Actor.done for the dashboard.

Planning is pure (`plan_actions`): tests drive it with snapshots (tests/runner/test_watch_actions.py);
`Actor` applies the plan.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from runner.errors import RunnerError
from runner.rundir import clean_stop
from runner.watch.detect_gpus import faulted_gpus
from runner.watch.findings import Finding, stop_reason
from runner.watch.snapshot import Snapshot, WorkerView


@dataclass(kw_only=True, slots=True)
class Policy:
    restart: bool = True
    """Act at all (--restart / --no-restart)."""
    restart_targets: bool = False
    """Also turn hung targets into dead ones (the job restarts them only with pipeline.restart_targets)."""
    grace_s: float = 15.0
    """Between SIGTERM and SIGKILL of a hung worker."""
    max_actions: int = 4
    """Kills and relaunches allowed per window; beyond that watch only reports."""
    window_s: float = 1800.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Action:
    action: str
    """terminate | kill | relaunch"""
    subject: str
    detail: str
    pid: int | None = None
    started_at: float | None = None


@dataclass(kw_only=True, slots=True)
class ActorState:
    terminated: dict[str, tuple[float, int]] = field(default_factory=dict)
    """worker -> (when SIGTERM was sent, host pid)."""
    killed: set[int] = field(default_factory=set)
    """Host pids sent SIGKILL: not signalled again while the kernel tears them down."""
    taken: deque[float] = field(default_factory=deque)
    """When each kill or relaunch happened (for the cap)."""
    relaunched_at: float | None = None
    reported: set[tuple[str, str]] = field(default_factory=set)
    awaiting_recovery: dict[str, tuple[float, int]] = field(default_factory=dict)
    """drafter -> (when it died or was killed, the group's step then)."""


def _drafter_step(snap: Snapshot) -> int:
    return max((w.step or 0 for w in snap.workers if w.role == "drafter"), default=0)


def _hung_workers(snap: Snapshot, findings: Sequence[Finding], policy: Policy) -> list[WorkerView]:
    roles = ("drafter", "target") if policy.restart_targets else ("drafter",)
    names: set[str] = set()
    for f in findings:
        if f.kind == "hung_worker":
            names.add(f.subject)
        elif f.kind == "likely_oom":
            names.update(str(n) for n in f.numbers.get("workers", []) or [])
            names.update(w.name for w in snap.workers if f.subject == f"GPU {w.gpu_index}")
    return [w for w in snap.workers if w.name in names and w.role in roles and w.alive]


def _capped(state: ActorState, policy: Policy, now: float) -> bool:
    while state.taken and now - state.taken[0] > policy.window_s:
        state.taken.popleft()
    return len(state.taken) >= policy.max_actions


def plan_actions(
    snap: Snapshot,
    findings: Sequence[Finding],
    state: ActorState,
    policy: Policy,
    *,
    now: float,
    can_relaunch: bool,
) -> list[Action]:
    """The actions this refresh calls for (state records what was already done)."""
    if not policy.restart:
        return []
    out: list[Action] = []
    # A GPU hardware fault comes first: killing the worker on it would restart the group onto it,
    # and a relaunch would place the job on it again. A person drains it (the findings say how).
    faulted = faulted_gpus(findings)
    for w in _hung_workers(snap, findings, policy):
        if w.gpu_index in faulted:
            continue
        pid = w.host_pid or w.pid
        if pid in state.killed:
            continue
        started = w.heartbeat.get("started_at")
        sent = state.terminated.get(w.name)
        if sent is not None and sent[1] == pid:
            if now - sent[0] >= policy.grace_s and not _capped(state, policy, now):
                out.append(Action(action="kill", subject=w.name, pid=pid, started_at=started,
                                  detail=f"still hung {now - sent[0]:.0f} s after SIGTERM: SIGKILL"))  # fmt: skip
        elif not _capped(state, policy, now):
            out.append(Action(action="terminate", subject=w.name, pid=pid, started_at=started,
                              detail=f"hung at step {w.step} ({w.state}): SIGTERM, SIGKILL after {policy.grace_s:.0f} s"))  # fmt: skip
    reason = stop_reason(findings)
    ended_badly = reason is not None and not clean_stop(reason)
    recent = state.relaunched_at is not None and now - state.relaunched_at < 120
    on_faulted = any(w.gpu_index in faulted for w in snap.workers)
    if ended_badly and can_relaunch and not recent and not on_faulted and not _capped(state, policy, now):
        out.append(Action(action="relaunch", subject="run",
                          detail=f"the job stopped ({reason or 'no final event'}): relaunch, resume from the newest checkpoint"))  # fmt: skip
    return out


class Actor:
    """Applies planned actions on one host and writes findings and actions to its events.jsonl."""

    def __init__(
        self,
        policy: Policy,
        *,
        signal_host: Callable[[str, int, float | None], None],
        relaunch: Callable[[], None] | None,
        log_event: Callable[..., Any],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy
        self.signal_host = signal_host
        self.relaunch = relaunch
        self.log_event = log_event
        self.clock = clock
        self.state = ActorState()
        self.done: list[dict[str, Any]] = []
        """What the dashboard lists, oldest first: {t, event: action | recovered, action, subject,
        detail, ok[, error, target_pid]}."""

    def standing(self, snap: Snapshot, findings: Sequence[Finding]) -> list[Finding]:
        """watch says when it stops acting: with its kills and relaunches spent (Policy.max_actions
        per Policy.window_s), a finding lists what it did, when it may act again, and what a person
        should do; critical while a finding calls for an action watch now withholds."""
        now = self.clock()
        if not self.policy.restart or not _capped(self.state, self.policy, now):
            return []
        start = now - self.policy.window_s
        did = [
            d
            for d in self.done
            if d.get("event") == "action" and d["t"] >= start and d["action"] != "terminate"
        ]
        words = ", ".join(
            f"{d['action']} {d['subject']} at {time.strftime('%H:%M:%S', time.localtime(d['t']))}"
            for d in did
        )
        until = self.state.taken[0] + self.policy.window_s
        reason = stop_reason(findings)
        wanted = [w.name for w in _hung_workers(snap, findings, self.policy)]
        if reason is not None and not clean_stop(reason) and self.relaunch is not None:
            wanted.append("a relaunch of the stopped job")
        held = f"; it would now act on {', '.join(wanted)}" if wanted else ""
        return [
            Finding(
                severity="critical" if wanted else "warning",
                kind="watch_capped",
                subject="watch",
                message=(
                    f"watch has spent its {self.policy.max_actions} kills and relaunches of the last "
                    f"{self.policy.window_s / 60:.0f} min ({words or 'see events.jsonl'}) and will not act again "
                    f"until {time.strftime('%H:%M:%S', time.localtime(until))} (in {(until - now) / 60:.0f} min){held}"
                ),
                advice=(
                    "the same failure keeps coming back, so restarting is not fixing it: read the findings above "
                    "and the workers' logs, fix the cause (a GPU to drain, a config to change), then "
                    "`dflashctl stop RUN` and run it again; --max-restarts/--restart-window set the cap"
                ),
                numbers={
                    "max_actions": self.policy.max_actions,
                    "window_s": self.policy.window_s,
                    "until": until,
                    "withheld": wanted,
                },  # fmt: skip
            )
        ]

    def report(self, snap: Snapshot, findings: Sequence[Finding]) -> None:
        """Append each finding once when it appears (again after it cleared), and recoveries."""
        now = self.clock()
        keys = {f.key for f in findings}
        for f in findings:
            if f.key not in self.state.reported and f.severity != "info":
                self.log_event("finding", source="watch", **f.to_dict())
            if f.kind == "dead_worker" and f.subject.startswith("drafter-"):
                self.state.awaiting_recovery.setdefault(f.subject, (now, _drafter_step(snap)))
        self.state.reported = {k for k in self.state.reported if k in keys} | {
            f.key for f in findings if f.severity != "info"
        }
        step = _drafter_step(snap)
        drafters_ok = all(w.alive for w in snap.workers if w.role == "drafter")
        for name, (since, at_step) in list(self.state.awaiting_recovery.items()):
            if drafters_ok and step > at_step and ("dead_worker", name) not in keys:
                detail = f"the drafter group is training again (step {step}, was {at_step}) {now - since:.0f} s later"
                self.log_event("recovered", source="watch", subject=name, after_s=round(now - since, 1),
                               step=step, detail=detail)  # fmt: skip
                # Shown beside the actions: the recovery is what the kill was for.
                self.done.append({"t": now, "event": "recovered", "action": "recovered", "subject": name,
                                  "detail": detail, "ok": True})  # fmt: skip
                del self.state.awaiting_recovery[name]

    def act(self, snap: Snapshot, findings: Sequence[Finding]) -> list[Action]:
        now = self.clock()
        actions = plan_actions(
            snap, findings, self.state, self.policy, now=now, can_relaunch=self.relaunch is not None
        )
        for a in actions:
            try:
                if a.action in ("terminate", "kill"):
                    assert a.pid is not None
                    self.signal_host("SIGTERM" if a.action == "terminate" else "SIGKILL", a.pid, a.started_at)
                    if a.action == "terminate":
                        self.state.terminated[a.subject] = (now, a.pid)
                    else:
                        self.state.killed.add(a.pid)
                        self.state.taken.append(now)
                        self.state.awaiting_recovery.setdefault(a.subject, (now, _drafter_step(snap)))
                elif a.action == "relaunch":
                    assert self.relaunch is not None
                    self.relaunch()
                    self.state.relaunched_at = now
                    self.state.taken.append(now)
                ok, error = True, None
            except RunnerError as e:
                ok, error = False, str(e)
            rec = {
                "action": a.action,
                "subject": a.subject,
                "detail": a.detail,
                "target_pid": a.pid,
                "ok": ok,
            }
            if error:
                rec["error"] = error
            self.log_event("action", source="watch", **rec)
            self.done.append({"t": now, "event": "action", **rec})
        return actions


def signal_args(sig: str, pid: int, started_at: float | None) -> list[str]:
    """Arguments of runner/exec/proc.py that signal one recorded process (and its descendants)."""
    return ["signal", sig, json.dumps([[pid, started_at]])]
