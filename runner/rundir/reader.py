"""Read one host's run directory in one shell call: see runner/rundir/__init__.py."""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runner.errors import RunnerError
from runner.exec import remote
from runner.exec.proc import flock_holders
from runner.rundir import layout, schema
from runner.rundir.schema import EVENTS, HEARTBEAT, METRICS, RUN_JSON, Damaged, Tally

RUN_FORMAT = 1
"""run.json `format` this reader understands; a newer one is refused with advice to upgrade."""

WORKER_STATES = (
    "starting",
    "computing",
    "waiting_input",
    "waiting_output",
    "compiling",
    "checkpointing",
    "stopped",
)
"""The states a heartbeat reports (docs/run-directory.md; the job's dflash.rundir.WORKER_STATES)."""


def clean_stop(reason: str) -> bool:
    """Whether a `stopped` event's reason is a stop for good: completed, or a signal (a user's stop)."""
    return reason == "completed" or reason.startswith("signal")


METRICS_TAIL_BYTES = 256 << 10
EVENTS_TAIL_BYTES = 512 << 10

_SCRIPT = r"""
M="$1"
cd "$2" 2>/dev/null || { echo "$M missing"; exit 0; }
echo "$M now"; date +%s
echo "$M manifest"; cat "$5" 2>/dev/null
echo; echo "$M lock"; stat -c '%i %d' "$6" 2>/dev/null
echo "$M locks"; cat /proc/locks 2>/dev/null
echo "$M metrics"; tail -c "$3" "$7" 2>/dev/null
echo; echo "$M events"; tail -c "$4" "$8" 2>/dev/null
for f in "$9"/*.json; do
  [ -f "$f" ] || continue
  echo; echo "$M worker $f"; cat "$f"
done
echo; echo "$M end"
"""
"""$1 the section marker, $2 the run dir, $3/$4 the metrics/events tail bytes, $5.. the layout's files."""


@dataclass(frozen=True, slots=True)
class RunLocation:
    """A run directory as the host that holds it sees it; host None: this machine."""

    run_dir: str
    host: str | None = None

    def describe(self) -> str:
        return f"{self.host}:{self.run_dir}" if self.host else self.run_dir


@dataclass(kw_only=True, slots=True)
class RunView:
    location: RunLocation
    exists: bool
    manifest: dict[str, Any] | None = None
    lock_pid: int | None = None
    """Pid holding job.lock (from /proc/locks, in the reading host's pid namespace), if held."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    heartbeats: dict[str, dict[str, Any]] = field(default_factory=dict)
    damage: list[str] = field(default_factory=list)
    """One line per damaged file (what is wrong, what to do) and per file with records skipped for
    their shape (docs/run-directory.md): what ps, logs, stop and report print beside the run."""
    read_at: float = field(default_factory=time.time)
    clock_offset: float = 0.0
    """The reading host's clock minus this machine's (whole seconds): the job's times and the
    kernel's process start times are on the host's clock, the registry's on this machine's."""

    @property
    def running(self) -> bool:
        return self.lock_pid is not None

    @property
    def latest(self) -> dict[str, Any] | None:
        return self.metrics[-1] if self.metrics else None

    def last_lifecycle(self) -> dict[str, Any] | None:
        return last_lifecycle(self.events)

    def state(self, *, started_at: float | None = None, grace_s: float = 120.0) -> str:
        """running | starting | stopped | failed | stale: what `dflashctl ps` shows."""
        if not self.exists:
            return "stale"
        if self.running:
            return "running"
        last = self.last_lifecycle()
        if last is not None and last.get("event") == "stopped":
            return "stopped" if clean_stop(str(last.get("reason", ""))) else "failed"
        job_started = bool((self.manifest or {}).get("command_lines"))
        if not job_started and started_at is not None and time.time() - started_at < grace_s:
            return "starting"
        # No process holds the directory and no final event: killed hard, or never came up.
        return "stale" if job_started else "failed"

    def stop_reason(self) -> str | None:
        last = self.last_lifecycle()
        return str(last.get("reason")) if last and last.get("event") == "stopped" else None


def last_lifecycle(events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest started / launched / stopped event (a resume appends a new start)."""
    for e in reversed(events):
        if e.get("event") in ("started", "launched", "stopped"):
            return e
    return None


def tau_series(events: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The job's tau measurements (`tau` events: acceptance under speculative decoding after a
    checkpoint), by step; the newest of a step kept."""
    by_step: dict[int, Mapping[str, Any]] = {}
    for e in events:
        if (
            e.get("event") == "tau"
            and isinstance(e.get("step"), int)
            and isinstance(e.get("tau"), int | float)
        ):
            by_step[int(e["step"])] = e
    return [by_step[k] for k in sorted(by_step)]


def parse_jsonl(text: str, kind: schema.Schema = EVENTS, tally: Tally | None = None) -> list[dict[str, Any]]:
    """Complete records of the right shape (runner.rundir.schema); the cut-off first line of a tail
    is dropped, and any other line that is torn, not JSON or of the wrong shape is skipped and
    counted in `tally`."""
    if text and not text.lstrip().startswith("{"):
        text = text.partition("\n")[2]  # a tail that began mid-line
    return schema.parse_lines(kind, text, tally)


def _lock_holder(stat_line: str, locks: str) -> int | None:
    """The pid holding an flock on the file whose `stat -c '%i %d'` is stat_line, per the text of
    /proc/locks (runner.exec.proc.flock_holders); None when nobody holds it or stat failed."""
    try:
        inode_s, dev_s = stat_line.split()
        inode, dev = int(inode_s), int(dev_s)
    except ValueError:
        return None
    holders = flock_holders(locks, dev, inode)
    return holders[0] if holders else None


def read_run(
    loc: RunLocation, *, metrics_bytes: int = METRICS_TAIL_BYTES, events_bytes: int = EVENTS_TAIL_BYTES
) -> RunView:
    marker = f"@@dflash-{secrets.token_hex(6)}"
    argv = ["sh", "-c", _SCRIPT, "sh", marker, loc.run_dir, str(metrics_bytes), str(events_bytes)]
    argv += [layout.RUN_JSON, layout.JOB_LOCK, layout.METRICS, layout.EVENTS, layout.WORKERS]
    proc = remote.run(loc.host, argv, timeout=60)
    sections: dict[str, str] = {}
    name = None
    chunk: list[str] = []
    for line in proc.stdout.decode(errors="replace").splitlines():
        if line.startswith(marker + " "):
            if name is not None:
                sections[name] = "\n".join(chunk)
            name, chunk = line[len(marker) + 1 :], []
        else:
            chunk.append(line)
    if name is not None:
        sections[name] = "\n".join(chunk)
    if "missing" in sections:
        return RunView(location=loc, exists=False)
    if "end" not in sections:
        raise RunnerError(f"reading the run directory {loc.describe()} was cut short; try again")
    where = loc.describe().rstrip("/")
    damage: list[str] = []
    manifest = None
    if sections.get("manifest", "").strip():
        try:
            manifest = schema.parse_record(RUN_JSON, sections["manifest"])
        except Damaged as e:  # run.json is written whole (temp file + rename): it is damaged
            damage.append(schema.damaged_line(f"{where}/{layout.RUN_JSON}", RUN_JSON, str(e)))
    if manifest is not None and manifest.get("format", 0) > RUN_FORMAT:
        raise RunnerError(
            f"{where}/{layout.RUN_JSON} has format {manifest['format']}, newer than this dflashctl "
            f"reads ({RUN_FORMAT}); upgrade dflashctl"
        )
    heartbeats = {}
    for key, text in sections.items():
        if key.startswith("worker "):
            file_name = key.split("/")[-1]
            if not layout.is_heartbeat(file_name):
                continue  # a target's data position, or a temp file
            base = file_name.removesuffix(".json")
            try:
                heartbeats[base] = schema.parse_record(HEARTBEAT, text)
            except Damaged as e:
                damage.append(
                    schema.damaged_line(f"{where}/{key.removeprefix('worker ')}", HEARTBEAT, str(e))
                )
    tallies = {layout.METRICS: Tally(), layout.EVENTS: Tally()}
    metrics = parse_jsonl(sections.get("metrics", ""), METRICS, tallies[layout.METRICS])
    events = parse_jsonl(sections.get("events", ""), EVENTS, tallies[layout.EVENTS])
    damage += [t.line(f"{where}/{name}") for name, t in tallies.items() if t.skipped]
    try:
        offset = float(int(sections.get("now", "").strip()) - int(time.time()))
    except ValueError:
        offset = 0.0
    return RunView(
        location=loc,
        exists=True,
        clock_offset=offset,
        manifest=manifest,
        lock_pid=_lock_holder(sections.get("lock", "").strip(), sections.get("locks", "")),
        metrics=metrics,
        events=events,
        heartbeats=heartbeats,
        damage=damage,
    )


def append_event(loc: RunLocation, event: str, **fields: Any) -> dict[str, Any]:
    """Append one record to events.jsonl as the job does (one O_APPEND write), source `watch` or
    `dflashctl`: the run's history keeps what the runner saw and did beside what the job did."""
    rec = {"t": time.time(), "event": event, "host": socket.gethostname(), "pid": os.getpid(), **fields}
    line = json.dumps(rec, default=str, allow_nan=False) + "\n"
    script = 'cat >> "$1/$2"'
    remote.run(
        loc.host, ["sh", "-c", script, "sh", loc.run_dir, layout.EVENTS], input=line.encode(), timeout=60
    )
    return rec


def tail_argv(
    loc: RunLocation, rel: str, *, lines: int, follow: bool, until_pid: int | None = None
) -> list[str]:
    """argv (for this machine) that prints the last lines of a file in the run dir, and follows it;
    with until_pid (a pid on that host: the supervisor), following ends once that process has."""
    path = f"{loc.run_dir.rstrip('/')}/{rel}"
    until = [f"--pid={until_pid}"] if follow and until_pid else []
    argv = ["tail", "-n", str(lines), *(["-F", *until] if follow else []), "--", path]
    return remote.remote_argv(loc.host, argv)
