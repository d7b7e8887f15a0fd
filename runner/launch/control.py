"""What ps, logs, stop and attach do to a registered run, on this machine or its hosts."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.errors import RunnerError
from runner.exec import remote
from runner.exec.proc import ProcId
from runner.launch import backend
from runner.launch.registry import HostRecord, RunRecord
from runner.rundir import RunLocation, RunView, layout, read_run, tail_argv, tau_series

_PROC_SOURCE = (Path(__file__).parents[1] / "exec" / "proc.py").read_text()
_STATE_ORDER = ["failed", "stale", "running", "starting", "stopped"]
"""How host states combine into the run's: the first one any host is in."""


def location(h: HostRecord) -> RunLocation:
    return RunLocation(h.run_dir, h.host)


@dataclass(kw_only=True, slots=True)
class RunStatus:
    record: RunRecord
    state: str
    views: list[RunView] = field(default_factory=list)
    step: int | None = None
    tok_s: float | None = None
    tau: float | None = None
    """The newest tau measurement's (the job's `tau` events): acceptance under speculative decoding."""
    reason: str | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def damage(self) -> list[str]:
        """Every host's damaged files and skipped records (RunView.damage), one line each."""
        return [line for v in self.views for line in v.damage]

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.record.run_id,
            "name": self.record.name,
            "state": self.state,
            "backend": self.record.backend,
            "hosts": [h.host or "local" for h in self.record.hosts],
            "run_dirs": [h.run_dir for h in self.record.hosts],
            "step": self.step,
            "tok_s": self.tok_s,
            "tau": self.tau,
            "age_s": round(time.time() - self.record.created_at, 1),
            "reason": self.reason,
            "errors": self.errors,
            "damage": self.damage,
        }


def located(rec: RunRecord) -> RunRecord:
    """The record with each host's handles as its backend finds them now (docker: the container that
    carries the run's labels), so a stop reaches what runs even where the record's name is stale."""
    runs_in = backend.of(rec.backend)
    return dataclasses.replace(rec, hosts=[runs_in.locate(rec.run_id, h) for h in rec.hosts])


def strays(records: list[RunRecord], registry: str) -> list[str]:
    """One line per handle a backend finds, tagged by this registry, of a run no record names (its
    entry was removed, or the launch was killed before it could undo itself), on this machine and
    every host a record of that backend names."""
    known = {r.run_id for r in records}
    lines = []
    for name in backend.NAMES:
        runs_in = backend.get(name)
        hosts = dict.fromkeys([None, *(h.host for r in records if r.backend == name for h in r.hosts)])
        for host in hosts:
            for handle, run_id in runs_in.found(host, registry):
                if run_id not in known:
                    lines.append(runs_in.stray(host or "this machine", handle, run_id))
    return lines


def status(rec: RunRecord) -> RunStatus:
    runs_in = backend.of(rec.backend)
    views, states, errors = [], [], []
    for h in rec.hosts:
        try:
            view = read_run(location(h), metrics_bytes=16 << 10, events_bytes=64 << 10)
        except RunnerError as e:
            errors.append(f"{h.host or 'local'}: {e}")
            states.append("stale")
            continue
        views.append(view)
        state = view.state(started_at=rec.created_at)
        if state == "starting" and runs_in.alive(runs_in.locate(rec.run_id, h)) is False:
            state = "failed"
        states.append(state)
    state = next((s for s in _STATE_ORDER if s in states), "stale")
    latest = next((v.latest for v in views if v.latest), None)
    reasons = [r for v in views if (r := v.stop_reason())]
    return RunStatus(
        record=rec,
        state=state,
        views=views,
        step=latest.get("step") if latest else None,
        tok_s=latest.get("tok_s") if latest else None,
        tau=next((float(t[-1]["tau"]) for v in views if (t := tau_series(v.events))), None),
        reason="; ".join(sorted(set(reasons))) or None,
        errors=errors,
    )


CLOCK_MARGIN_S = 5.0
"""Added to the start-time slack where a bound comes from this machine's clock (the run's creation
time) while the process started on the host's: the offset is read in whole seconds, over ssh."""


def recorded_processes(view: RunView, *, created_at: float | None = None) -> list[ProcId]:
    """Every process the run recorded on this host, each with the window its start time must lie in
    (runner/exec/proc.py): the pids of the `launched` events (the supervisor, the targets, the
    drafter group) started after the run was created and before the event; each worker's heartbeat
    pid before its started_at; the job.lock holder (the supervisor) after the run was created."""
    made = None if created_at is None else created_at + view.clock_offset - CLOCK_MARGIN_S
    ids: dict[int, ProcId] = {}
    for e in view.events:
        if e.get("event") == "launched":
            t = e.get("t") if isinstance(e.get("t"), (int, float)) else None
            for pid in [e.get("pid"), *(e.get("targets") or {}).values(), e.get("drafter_group_pid")]:
                if isinstance(pid, int):  # a newer launch of the same pid number replaces the older
                    ids[pid] = ProcId(pid, made, t) if made is not None else ProcId.recorded(pid, t)
    for hb in view.heartbeats.values():
        pid, at = hb.get("pid"), hb.get("started_at")
        if isinstance(pid, int) and hb.get("state") != "stopped":
            ids[pid] = ProcId.recorded(pid, at) if isinstance(at, (int, float)) else ProcId(pid, made)
    if view.lock_pid and view.lock_pid not in ids:
        ids[view.lock_pid] = ProcId(view.lock_pid, made)
    return [ids[p] for p in sorted(ids)]


def pane_processes(rec: RunRecord, h: HostRecord, view: RunView) -> list[ProcId]:
    """What the backend started around the supervisor (a tmux pane's shell: its parent), started
    after the run was created: what a stop can still reach before the supervisor has recorded
    anything."""
    made = rec.created_at + view.clock_offset - CLOCK_MARGIN_S
    return [ProcId(p, made) for p in backend.of(rec.backend).launcher_pids(h)]


def proc_tool(host: str | None, verb: list[str]) -> dict[str, Any]:
    """runner/exec/proc.py run on the host by its own python3 (stdlib only), fed over stdin."""
    python = sys.executable if host is None else "python3"
    proc = remote.run(host, [python, "-", *verb], input=_PROC_SOURCE.encode(), timeout=60)
    return remote.parse_json_tail(proc.stdout, "the process tool", "is python3 on that host?")


def _ids_json(ids: list[ProcId]) -> str:
    return json.dumps([p.to_json() for p in ids])


def alive_pids(host: str | None, ids: list[ProcId]) -> list[int]:
    if not ids:
        return []
    return list(proc_tool(host, ["alive", _ids_json(ids)]).get("alive", []))


def _kill_all(rec: RunRecord, h: HostRecord, ids: list[ProcId]) -> None:
    runs_in = backend.of(rec.backend)
    if ids and not runs_in.in_container:  # a container's pids are its namespace's: kill(h) reaches them
        proc_tool(h.host, ["signal", "SIGKILL", _ids_json(ids)])
    runs_in.kill(h)


def _takes_sigterm(view: RunView) -> bool:
    """The supervisor holds the run directory, so its SIGTERM handler is installed: the job installs
    it before it takes job.lock (dflash/pipeline/supervisor.py, EarlyStop), and a signal from then on ends the run
    in order (a `stopped` event; a checkpoint once the drafters train). Before that, a SIGTERM would
    meet the default handler and kill it without a trace."""
    return view.running


def _may_still_start(rec: RunRecord, h: HostRecord, view: RunView) -> bool:
    """Whether this host's job may yet reach the point where it takes SIGTERM."""
    if view.running:
        return True
    last = view.last_lifecycle()
    if last is not None and last.get("event") == "stopped":
        return False
    alive = backend.of(rec.backend).alive(h)
    return alive if alive is not None else view.state(started_at=rec.created_at) == "starting"


def _terminate(rec: RunRecord, h: HostRecord, view: RunView) -> bool:
    """SIGTERM to the host's supervisor (through the backend where it holds it, else to the pid that
    holds job.lock, its identity checked first); whether it was sent."""
    if backend.of(rec.backend).signal(h, "TERM"):
        return True
    assert view.lock_pid is not None
    sup = [p for p in recorded_processes(view, created_at=rec.created_at) if p.pid == view.lock_pid]
    return bool(proc_tool(h.host, ["signal-one", "SIGTERM", _ids_json(sup)]).get("signalled"))


@dataclass(kw_only=True, slots=True)
class StopResult:
    graceful: bool
    """Every host's supervisor got SIGTERM and the run ended `stopped` (a clean stop), unforced."""
    forced: bool
    seconds: float
    state: str
    """The run's state afterwards (control.status)."""
    reason: str | None
    signalled: list[str]
    """Hosts whose supervisor got the SIGTERM."""
    missed: list[str]
    """Hosts whose job had ended, or never came up, before the stop could reach it."""
    left: dict[str, list[int]]
    """Per host, recorded pids still alive afterwards (empty: nothing of the run is left)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "graceful": self.graceful,
            "forced": self.forced,
            "seconds": round(self.seconds, 1),
            "state": self.state,
            "reason": self.reason,
            "signalled": self.signalled,
            "missed": self.missed,
            "left": self.left,
        }


def _quiet(_message: str) -> None:
    """The default progress: library code does not print; commands pass their console."""


def stop(
    rec: RunRecord,
    *,
    force: bool = False,
    timeout: float = 240.0,
    progress: Callable[[str], None] = _quiet,
) -> StopResult:
    """Graceful: SIGTERM to each host's supervisor once it takes signals (a run still starting is
    waited for, within timeout), then wait for the run-dir lock to drop (the drafters agree on a
    step, checkpoint, exit). After timeout, or with force: SIGKILL to every recorded process and its
    descendants, each checked against its start time first."""
    started = time.monotonic()
    deadline = started + timeout
    rec = located(rec)
    runs_in = backend.of(rec.backend)
    known: dict[int, dict[int, ProcId]] = {h.node_rank: {} for h in rec.hosts}

    def look(h: HostRecord) -> RunView:
        view = read_run(location(h))
        found = recorded_processes(view, created_at=rec.created_at)
        found += pane_processes(rec, h, view)
        for p in found:
            known[h.node_rank].setdefault(p.pid, p)
        return view

    name = {h.node_rank: h.host or "local" for h in rec.hosts}
    signalled: list[str] = []
    missed: list[str] = []
    forced = force
    if not force:
        pending = {h.node_rank: h for h in rec.hosts}
        waited = False
        while pending:
            for rank, h in list(pending.items()):
                view = look(h)
                if _takes_sigterm(view):
                    (signalled if _terminate(rec, h, view) else missed).append(name[rank])
                    del pending[rank]
                elif not _may_still_start(rec, h, view):
                    missed.append(name[rank])
                    del pending[rank]
            if not pending or time.monotonic() >= deadline:
                break
            if not waited:
                progress(f"{rec.run_id} is still starting: waiting for its supervisor to take SIGTERM")
                waited = True
            time.sleep(1.0)
        if signalled:
            left_s = max(0.0, deadline - time.monotonic())
            progress(f"asked {rec.run_id} to stop (SIGTERM); waiting up to {left_s:.0f} s for its checkpoint")
        hosts = [h for h in rec.hosts if name[h.node_rank] in signalled]
        while hosts and any(look(h).running for h in hosts):
            if time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        else:
            hosts = []
        # A host whose supervisor was gone may still have workers of the run (killed hard: stale).
        leftovers = [
            h
            for h in rec.hosts
            if name[h.node_rank] in missed
            and not runs_in.in_container
            and alive_pids(h.host, list(known[h.node_rank].values()))
        ]
        if pending or hosts:
            forced = True
            progress(f"not stopped after {timeout:.0f} s: killing every process of the run")
        elif leftovers:
            forced = True
            progress(f"{rec.run_id} had no supervisor left to ask: killing the processes it left behind")
    if forced:
        for h in rec.hosts:
            look(h)
            _kill_all(rec, h, list(known[h.node_rank].values()))
    left: dict[str, list[int]] = {}
    settle = time.monotonic() + 30
    for h in rec.hosts:
        ids = list(known[h.node_rank].values())
        while True:
            alive = [] if runs_in.in_container else alive_pids(h.host, ids)
            if not alive or time.monotonic() > settle:
                break
            time.sleep(0.5)
        if runs_in.in_container and runs_in.alive(h):
            alive = [-1]
        if alive:
            left[name[h.node_rank]] = alive
    final = status(rec)
    return StopResult(
        graceful=not forced and not missed and final.state == "stopped",
        forced=forced,
        seconds=time.monotonic() - started,
        state=final.state,
        reason=final.reason,
        signalled=signalled,
        missed=missed,
        left=left,
    )


def log_argv(rec: RunRecord, h: HostRecord, worker: str | None, *, lines: int, follow: bool) -> list[str]:
    """argv that prints (and follows, until the run ends) a log of the run: the supervisor's by
    default, or a worker's."""
    if worker in (None, layout.SUPERVISOR):
        argv = backend.of(rec.backend).logs_argv(h, lines=lines, follow=follow)
        if argv is not None:
            return argv
        rel = layout.SUPERVISOR_LOG
    else:
        if not all(c.isalnum() or c in "-_" for c in worker):
            raise RunnerError(f"--worker {worker!r}: give a name such as drafter-0, target-1 or data")
        rel = layout.log(worker)
    if not follow:
        return tail_argv(location(h), rel, lines=lines, follow=False)
    # Following ends with the run: tail watches the supervisor's pid. A run that has ended already
    # writes nothing more, so its log is printed, not followed; one still starting is followed.
    view = read_run(location(h), metrics_bytes=0, events_bytes=64 << 10)
    if view.running:
        return tail_argv(location(h), rel, lines=lines, follow=True, until_pid=view.lock_pid)
    ended = view.last_lifecycle() is not None and view.state(started_at=rec.created_at) != "starting"
    return tail_argv(location(h), rel, lines=lines, follow=not ended)


def follow_end(rec: RunRecord, h: HostRecord) -> tuple[int, str] | None:
    """Whether `logs --follow` should stop now: None while the run may still write (running, or
    starting), else (exit code, one line): 0 and the state it ended in, 1 when its directory is gone
    (removed, or a host that lost it). A read that fails for now (a dropped ssh link) is None."""
    loc = location(h)
    try:
        view = read_run(loc, metrics_bytes=0, events_bytes=64 << 10)
    except RunnerError:
        return None
    if not view.exists:
        return 1, f"the run directory {loc.describe()} is gone: nothing more to follow"
    if view.running:
        return None
    state = view.state(started_at=rec.created_at)
    return None if state == "starting" else (0, f"the run is {state}: nothing more to follow")


def log_names(h: HostRecord) -> list[str]:
    proc = remote.run(h.host, ["ls", "-1", f"{h.run_dir}/logs"], check=False)
    return sorted(n.removesuffix(".log") for n in proc.stdout.decode().split() if n.endswith(".log"))


def attach_argv(rec: RunRecord, h: HostRecord) -> list[str]:
    return backend.of(rec.backend).attach_argv(rec.run_id, h)
