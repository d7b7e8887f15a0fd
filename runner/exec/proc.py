"""Process identity and kill-tree, from /proc, with the standard library only.

A pid alone does not name a process: pids are reused. A recorded process is (pid, start time), and
anything that signals a recorded pid checks the start time first, so a stop never hits a stranger
that inherited the number.

Standard library only, and runnable as a script, because the same code must run on a GPU host
where only the job's python exists: `python3 - signal SIG '[[pid, started_at], ...]'` fed this
file's source prints the pids it signalled (one JSON line). Locally the functions are called directly.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

START_LEAD_S = 1800.0
"""How far a recorded start time may lie after the kernel's start time and still name the same
process: a heartbeat's started_at is written after torch is imported and the model built, which
can take minutes. A reused pid is told apart because its process started after the record."""


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (field 3 onwards), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def start_time(pid: int) -> float | None:
    """Unix time the process started, or None if it is gone or a zombie."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcId:
    pid: int
    started_at: float | None = None
    """Unix time the process started (or shortly after); None: unknown, trust the pid."""

    def alive(self) -> bool:
        """Whether the process this names runs (not gone, not a zombie, pid not reused)."""
        started = start_time(self.pid)
        if started is None:
            return False
        return self.started_at is None or started - 1.0 <= self.started_at <= started + START_LEAD_S


def children(pid: int) -> list[int]:
    """Every descendant of pid, found by walking parent links over /proc."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat(int(name))
            if fields is not None:
                kids.setdefault(int(fields[1]), []).append(int(name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def signal_trees(ids: Iterable[ProcId], sig: int = signal.SIGKILL) -> list[int]:
    """Send sig to every live recorded process and all its descendants; the pids signalled. The
    trees are listed before anything is signalled: an orphan is re-parented and can no longer be
    found from its parent (torchrun starts its workers in sessions of their own)."""
    pids: list[int] = []
    for p in ids:
        if p.alive():
            for q in [p.pid, *children(p.pid)]:
                if q not in pids:
                    pids.append(q)
    for q in pids:
        try:
            os.kill(q, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return sorted(pids)


def wait_gone(ids: Iterable[ProcId], timeout: float) -> list[ProcId]:
    """Wait up to timeout for the recorded processes to exit; those still alive."""
    pending = list(ids)
    deadline = time.monotonic() + timeout
    while pending:
        pending = [p for p in pending if p.alive()]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    return pending


def main(argv: list[str]) -> int:
    """`signal SIG IDS` or `alive IDS`, IDS a JSON list of [pid, started_at|null]."""
    verb, *rest = argv
    if verb == "signal":
        ids = [ProcId(int(p), s) for p, s in json.loads(rest[1])]
        print(json.dumps({"signalled": signal_trees(ids, signal.Signals[rest[0]])}))
    elif verb == "alive":
        ids = [ProcId(int(p), s) for p, s in json.loads(rest[0])]
        print(json.dumps({"alive": [p.pid for p in ids if p.alive()]}))
    else:
        raise SystemExit(f"unknown verb {verb!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
