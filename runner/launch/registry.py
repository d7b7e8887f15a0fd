"""The local run registry: one JSON file per launched run under the XDG state dir, saying where the
run lives (hosts, run directories, backend names), so ps/logs/stop/attach find it from the launching
machine whether it runs here or on a host."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runner.errors import BadInput, RunnerError
from runner.fsutil import atomic_write_text
from runner.rundir.schema import REGISTRY_ENTRY, read_record_file

STATE_ENV = "DFLASH_STATE_DIR"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,47}")
"""A run name: what the config's run.name or --name says, kept as given in the run id, the run
directory, the registry and every verb. Dots are common in model names (qwen3.6) and harmless in
paths; anything else a shell, ssh or an option parser would read (space, quote, '$', ';', '/', a
leading '-') is refused, never rewritten, so the name the user typed is the name the run has."""
SESSION_MAPPED = {".": "_"}
"""What backend_name rewrites. tmux reads '.' (and ':', refused above) in a target as the pane
(window) separator, and renames a new session `a.b` to `a_b` without a word: the session the
registry recorded would never be found again (`has-session -t =dflash-a.b` answers "can't find
pane: b")."""


def check_name(name: str, *, origin: str = "--name") -> str:
    """The name as given, or BadInput naming where it came from (--name, or the config's run.name)."""
    if not NAME_RE.fullmatch(name):  # fullmatch: `$` would let a trailing newline through
        fix = "" if origin == "--name" else "; change it, or pass --name NAME"
        raise BadInput(
            f"run name {name!r} ({origin}) is not allowed: use 1-48 letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit{fix}"
        )
    return name


def backend_name(run_id: str) -> str:
    """The tmux session and container stem of a run: `dflash-<run id>` with each '.' as '_'. Stable
    (the same run id gives the same name on every host, in the plan and in the registry) and only
    letters, digits, '_' and '-', which tmux and Docker both take as they are."""
    return "dflash-" + "".join(SESSION_MAPPED.get(c, c) for c in run_id)


def state_dir() -> Path:
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "dflashctl"


@dataclass(kw_only=True, slots=True)
class HostRecord:
    node_rank: int
    host: str | None
    run_dir: str
    tmux_session: str | None = None
    tmux_window: str | None = None
    container: str | None = None


@dataclass(kw_only=True, slots=True)
class RunRecord:
    run_id: str
    name: str
    backend: str
    created_at: float
    config: str
    hosts: list[HostRecord] = field(default_factory=list)
    argv: dict[str, list[str]] = field(default_factory=dict)
    """Per node rank, the job's command line."""
    plan: dict[str, Any] = field(default_factory=dict)
    """The whole launch plan (RunPlan.to_dict()): what `watch` relaunches a stopped job with."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunRecord:
        hosts = [HostRecord(**h) for h in d.get("hosts", [])]
        return cls(**{**d, "hosts": hosts})


class Registry:
    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or state_dir()) / "runs"
        self.damaged: list[str] = []
        """One line per entry the last all() skipped (runner.rundir.schema): what ps prints."""

    @property
    def ident(self) -> str:
        """Names this registry among every machine's and user's (the launching host and the registry's
        path): what a backend tags its handles with, so `ps` finds those whose entry is gone."""
        where = f"{socket.gethostname()}:{self.root.resolve()}"
        return hashlib.sha256(where.encode()).hexdigest()[:12]

    def save(self, rec: RunRecord) -> Path:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.root / f"{rec.run_id}.json"
        atomic_write_text(path, json.dumps(rec.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    def remove(self, run_id: str) -> None:
        (self.root / f"{run_id}.json").unlink(missing_ok=True)

    def all(self) -> list[RunRecord]:
        out, self.damaged = [], []
        for p in sorted(self.root.glob("*.json")) if self.root.is_dir() else []:
            # One damaged entry must not hide every other run: it is skipped, with one line.
            d, why = read_record_file(p, REGISTRY_ENTRY)
            if d is None:
                if why:
                    self.damaged.append(why)
                continue
            try:
                out.append(RunRecord.from_dict(d))
            except TypeError as e:  # a field this dflashctl does not know
                self.damaged.append(f"{p} is damaged ({e}); remove that file if the run is not needed")
        return sorted(out, key=lambda r: r.created_at)

    def find(self, ref: str) -> RunRecord:
        """By run id, name (the newest run of that name), tmux session or container name, or unique
        id prefix: exact matches first, so a run named like the start of another run's id is still
        found by its name."""
        runs = self.all()
        for r in runs:
            if r.run_id == ref:
                return r
        by_name = [r for r in runs if r.name == ref]
        if by_name:
            return by_name[-1]
        # What `tmux ls` and `docker ps` show: the session, or one node's container.
        for r in runs:
            if any(ref in (h.tmux_session, h.container) for h in r.hosts):
                return r
        by_prefix = [r for r in runs if r.run_id.startswith(ref)]
        if len(by_prefix) == 1:
            return by_prefix[0]
        if len(by_prefix) > 1:
            raise RunnerError(
                f"{ref!r} matches {len(by_prefix)} runs ({', '.join(r.run_id for r in by_prefix[:5])}); "
                "give more of the run id"
            )
        damaged = f"; {len(self.damaged)} damaged entries skipped: {self.damaged[0]}" if self.damaged else ""
        raise RunnerError(
            f"no run {ref!r} in {self.root}; `dflashctl ps --all` lists the known runs{damaged}"
        )
