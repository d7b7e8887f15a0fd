"""Process identity and kill-tree, from /proc, with the standard library only.

A pid alone does not name a process: pids are reused. A recorded process is a pid and the window
its kernel start time must fall in (from a heartbeat's started_at, an event's time, the time the
run was created), and anything that signals a recorded pid checks the start time first, so a stop
never hits a stranger that inherited the number.

Standard library only, and runnable as a script, because the same code must run on a GPU host
where only the job's python exists: `python3 - signal SIG IDS` fed this file's source prints the
pids it signalled (one JSON line). Locally the functions are called directly.
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
START_SLACK_S = 2.0
"""How far the kernel's start time may lie after a recorded one: /proc/stat's btime is whole
seconds, and the clock may have been stepped since boot."""


def stat_fields(pid: int, proc_root: str = "/proc") -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (field 3 onwards), or None if gone. The
    command name may hold spaces and parentheses, so the split is at the last ')'."""
    try:
        with open(f"{proc_root}/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def boot_time(proc_root: str = "/proc") -> float:
    with open(f"{proc_root}/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise OSError(f"no btime in {proc_root}/stat")


def start_from_stat(fields: list[str], btime: float) -> float:
    """Unix start time from stat fields (starttime is field 22, in clock ticks since boot)."""
    return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def start_time(pid: int) -> float | None:
    """Unix time the process started, or None if it is gone or a zombie."""
    fields = stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return start_from_stat(fields, boot_time())


def started_within(
    kernel_start: float, earliest: float | None, latest: float | None, slack: float = START_SLACK_S
) -> bool:
    """Whether a process that the kernel says started at kernel_start can be the one recorded as
    having started between earliest and latest (None: unbounded on that side)."""
    return (earliest is None or kernel_start >= earliest - slack) and (
        latest is None or kernel_start <= latest + slack
    )


def matches_record(
    kernel_start: float, started_at: float, *, lead: float = START_LEAD_S, slack: float = START_SLACK_S
) -> bool:
    """Whether kernel_start fits a process that recorded started_at itself, after its imports."""
    return started_within(kernel_start, started_at - lead, started_at, slack)


@dataclass(frozen=True)
class ProcId:
    pid: int
    earliest: float | None = None
    """The process started no earlier than this (Unix time); None: no lower bound."""
    latest: float | None = None
    """...and no later than this; both None: unknown, trust the pid."""

    @classmethod
    def recorded(cls, pid: int, started_at: float | None) -> ProcId:
        """A process that wrote its own start time (a heartbeat's started_at), or that was started
        shortly before a record was written (a `launched` event's time)."""
        if started_at is None:
            return cls(pid)
        return cls(pid, started_at - START_LEAD_S, started_at)

    def alive(self) -> bool:
        """Whether the process this names runs (not gone, not a zombie, pid not reused)."""
        started = start_time(self.pid)
        return started is not None and started_within(started, self.earliest, self.latest)

    def to_json(self) -> list[float | None]:
        return [self.pid, self.earliest, self.latest]

    @classmethod
    def from_json(cls, item: list[float | None]) -> ProcId:
        """[pid, earliest, latest], or [pid, started_at] as recorded (see `recorded`)."""
        if len(item) == 2:
            return cls.recorded(int(item[0] or 0), item[1])
        return cls(int(item[0] or 0), item[1], item[2])


def children(pid: int) -> list[int]:
    """Every descendant of pid, found by walking parent links over /proc."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = stat_fields(int(name))
            if fields is not None:
                kids.setdefault(int(fields[1]), []).append(int(name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def signal_trees(ids: Iterable[ProcId], sig: int = signal.SIGKILL, *, tree: bool = True) -> list[int]:
    """Send sig to every live recorded process (and, with tree, all its descendants); the pids
    signalled. The trees are listed before anything is signalled: an orphan is re-parented and can
    no longer be found from its parent (torchrun starts its workers in sessions of their own)."""
    pids: list[int] = []
    for p in ids:
        if p.alive():
            for q in [p.pid, *(children(p.pid) if tree else [])]:
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


def flock_holders(locks: str, dev: int, inode: int) -> list[int]:
    """Pids holding an flock on the file (dev, inode), per the text of /proc/locks
    (`1: FLOCK  ADVISORY  WRITE <pid> <maj>:<min>:<inode> 0 EOF`, major/minor in hex). Reading it
    takes no lock, so a reader can never make a starting job think its directory is in use. Blocked
    waiters (`1: -> FLOCK ...`) are not holders."""
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{inode}"
    pids = []
    for line in locks.splitlines():
        f = line.split()
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == want and f[4].lstrip("-").isdigit():
            pids.append(int(f[4]))
    return pids


def main(argv: list[str]) -> int:
    """`signal SIG IDS` (the trees), `signal-one SIG IDS` (the processes only) or `alive IDS`; IDS a
    JSON list of [pid, earliest, latest] or [pid, started_at|null] (ProcId.from_json)."""
    verb, *rest = argv
    if verb in ("signal", "signal-one"):
        ids = [ProcId.from_json(i) for i in json.loads(rest[1])]
        sent = signal_trees(ids, signal.Signals[rest[0]], tree=verb == "signal")
        print(json.dumps({"signalled": sent}))
    elif verb == "alive":
        ids = [ProcId.from_json(i) for i in json.loads(rest[0])]
        print(json.dumps({"alive": [p.pid for p in ids if p.alive()]}))
    else:
        raise SystemExit(f"unknown verb {verb!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
