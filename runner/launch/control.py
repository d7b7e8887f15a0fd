"""What ps, logs, stop and attach do to a registered run, on this machine or its hosts."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.errors import RunnerError
from runner.exec import remote
from runner.launch import docker as docker_backend
from runner.launch import tmux
from runner.launch.plan import SUPERVISOR_LOG
from runner.launch.registry import HostRecord, RunRecord
from runner.rundir import RunLocation, RunView, read_run, tail_argv

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
    reason: str | None = None
    errors: list[str] = field(default_factory=list)

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
            "age_s": round(time.time() - self.record.created_at, 1),
            "reason": self.reason,
            "errors": self.errors,
        }


def status(rec: RunRecord) -> RunStatus:
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
        if (
            state == "starting"
            and h.container
            and docker_backend.state(h.host, h.container) not in ("running", "created")
        ):
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
        reason="; ".join(sorted(set(reasons))) or None,
        errors=errors,
    )


def recorded_processes(view: RunView) -> list[tuple[int, float | None]]:
    """Every process the run recorded on this host: the lock holder (the supervisor), each worker's
    heartbeat pid (with its start time) and the pids of the `launched` events."""
    ids: dict[int, float | None] = {}
    if view.lock_pid:
        ids[view.lock_pid] = None
    for hb in view.heartbeats.values():
        if isinstance(hb.get("pid"), int) and hb.get("state") != "stopped":
            ids[hb["pid"]] = hb.get("started_at")
    for e in view.events:
        if e.get("event") == "launched":
            for pid in [*(e.get("targets") or {}).values(), e.get("drafter_group_pid")]:
                if isinstance(pid, int):
                    ids.setdefault(pid, None)
    return sorted(ids.items())


def proc_tool(host: str | None, verb: list[str]) -> dict[str, Any]:
    """runner/exec/proc.py run on the host by its own python3 (stdlib only), fed over stdin."""
    python = sys.executable if host is None else "python3"
    proc = remote.run(host, [python, "-", *verb], input=_PROC_SOURCE.encode(), timeout=60)
    return remote.parse_json_tail(proc.stdout, "the process tool", "is python3 on that host?")


def alive_pids(host: str | None, ids: list[tuple[int, float | None]]) -> list[int]:
    if not ids:
        return []
    return list(proc_tool(host, ["alive", json.dumps(ids)]).get("alive", []))


def _kill_all(rec: RunRecord, h: HostRecord, view: RunView) -> None:
    if h.container:
        docker_backend.signal(h.host, h.container, "KILL")
    ids = recorded_processes(view)
    if ids and not h.container:  # container pids are in the container's namespace: docker kill did it
        proc_tool(h.host, ["signal", "SIGKILL", json.dumps(ids)])
    if h.tmux_session:
        tmux.kill(h.host, h.tmux_session)


@dataclass(kw_only=True, slots=True)
class StopResult:
    graceful: bool
    forced: bool
    seconds: float
    left: dict[str, list[int]]
    """Per host, recorded pids still alive afterwards (empty: nothing of the run is left)."""


def stop(rec: RunRecord, *, force: bool = False, timeout: float = 240.0, progress=print) -> StopResult:  # type: ignore[no-untyped-def]
    """Graceful: SIGTERM to each host's supervisor (the drafters agree on a step, checkpoint, exit),
    then wait for the run-dir lock to drop. After timeout, or with force: SIGKILL to every recorded
    process and its descendants."""
    started = time.monotonic()
    views = {h.node_rank: read_run(location(h)) for h in rec.hosts}
    before = {h.node_rank: recorded_processes(views[h.node_rank]) for h in rec.hosts}
    forced = force
    if not force:
        for h in rec.hosts:
            view = views[h.node_rank]
            if h.container:
                docker_backend.signal(h.host, h.container, "TERM")
            elif view.lock_pid:
                remote.run(h.host, ["kill", "-TERM", str(view.lock_pid)], check=False)
        progress(f"asked {rec.run_id} to stop (SIGTERM); waiting up to {timeout:.0f} s for its checkpoint")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            views = {h.node_rank: read_run(location(h)) for h in rec.hosts}
            if not any(v.running for v in views.values()):
                break
            time.sleep(1.0)
        else:
            forced = True
            progress(f"still running after {timeout:.0f} s: killing every process of the run")
    if forced:
        for h in rec.hosts:
            _kill_all(rec, h, views[h.node_rank])
    left: dict[str, list[int]] = {}
    deadline = time.monotonic() + 30
    for h in rec.hosts:
        while True:
            alive = [] if h.container else alive_pids(h.host, before[h.node_rank])
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if h.container and docker_backend.state(h.host, h.container) == "running":
            alive = [-1]
        if alive:
            left[h.host or "local"] = alive
    return StopResult(graceful=not forced, forced=forced, seconds=time.monotonic() - started, left=left)


def log_argv(rec: RunRecord, h: HostRecord, worker: str | None, *, lines: int, follow: bool) -> list[str]:
    """argv that prints (and follows) a log of the run: the supervisor's by default, or a worker's."""
    if worker in (None, "supervisor"):
        if h.container:
            return docker_backend.logs_argv(h.host, h.container, lines=lines, follow=follow)
        rel = SUPERVISOR_LOG
    else:
        if not all(c.isalnum() or c in "-_" for c in worker):
            raise RunnerError(f"--worker {worker!r}: give a name such as drafter-0, target-1 or data")
        rel = f"logs/{worker}.log"
    return tail_argv(location(h), rel, lines=lines, follow=follow)


def log_names(h: HostRecord) -> list[str]:
    proc = remote.run(h.host, ["ls", "-1", f"{h.run_dir}/logs"], check=False)
    return sorted(n.removesuffix(".log") for n in proc.stdout.decode().split() if n.endswith(".log"))


def attach_argv(rec: RunRecord, h: HostRecord) -> list[str]:
    if rec.backend == "tmux" and h.tmux_session:
        return tmux.attach_argv(h.host, h.tmux_session, h.tmux_window)
    if rec.backend == "docker" and h.container:
        return docker_backend.attach_argv(h.host, h.container)
    raise RunnerError(
        f"{rec.run_id} runs in the foreground of the terminal that started it: nothing to attach to; "
        f"`dflashctl logs {rec.run_id} --follow` shows its output"
    )
