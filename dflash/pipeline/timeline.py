"""Where a worker generation's start goes, phase by phase: from the death it replaces (a restart) or
from the launch (a first start) to its first useful work (a drafter's first trained step, a target's
first published batch). One `generation_start` event carries the phases (docs/run-directory.md).

The phases before the process exists come from the process that spawns it, through the environment:
torchrun's agent for drafters (dflash.pipeline.torchrun stamps when it noticed the death, stopped the
old workers and spawned the new ones), the supervisor for targets. The death itself is the dead
generation's last heartbeat (rewritten at least every second, and on every state change, so it is
at most a second early). The process's own start is the kernel's (/proc, 10 ms resolution). Every
phase begins where the one before it ended, so the phases add up to the whole gap.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LAUNCHED_AT_ENV = "DFLASH_LAUNCHED_AT"
"""Set by the supervisor for torchrun: when it started the drafter group's launcher (a first start's origin)."""
DETECTED_AT_ENV = "DFLASH_DEATH_DETECTED_AT"
"""Set by the spawner: when it noticed the death of the generation this one replaces."""
STOPPED_AT_ENV = "DFLASH_OLD_STOPPED_AT"
"""Set by torchrun's agent: when the dead generation's other workers were stopped."""
SPAWNED_AT_ENV = "DFLASH_SPAWNED_AT"
"""Set by the spawner just before it starts this process."""
GENERATION_ENV = "DFLASH_WORKER_GENERATION"
"""Set by the supervisor for a target: how many times it started that target before (torchrun
numbers drafter generations itself: TORCHELASTIC_RESTART_COUNT)."""


def process_start_time() -> float | None:
    """This process's start as unix time, None where /proc is absent. The kernel counts it in clock
    ticks since boot (10 ms); /proc/stat's btime is whole seconds, so the offset is taken from the
    boot-time clock now instead."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - since_start


def env_time(name: str) -> float | None:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return None


def last_heartbeat(path: Path) -> dict[str, Any]:
    """A worker's heartbeat as its last writer left it (read before this generation rewrites it)."""
    try:
        beat = json.loads(path.read_text())
        return beat if isinstance(beat, dict) else {}
    except (OSError, ValueError):
        return {}


def number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    start: float
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"phase": self.name, "start": round(self.start, 3), "seconds": round(self.seconds, 3)}


class Timeline:
    """The phases of one start, in order, each from the end of the one before. Made at import time
    of the worker module, so `imports` is the interpreter's start and the imports that follow it."""

    def __init__(self, started: float | None = None) -> None:
        """started: when the generation's process started (default this one's; a spare drafter
        that takes a rank over gives the start of the torchrun worker it serves)."""
        self.started = started or process_start_time() or time.time()
        self._before: list[Phase] = []
        self._phases: list[Phase] = []
        self._last = self.started
        self.origin: float = self.started
        self.origin_kind = "process_start"

    def mark(self, name: str) -> None:
        """The phase `name` ended now."""
        now = time.time()
        self._phases.append(Phase(name, self._last, max(0.0, now - self._last)))
        self._last = now

    def before_process(self, died_at: float | None) -> None:
        """The phases before this process existed: from the death (died_at, a restart) or from the
        launch, through what the spawner stamped in the environment, to the process's start. A stamp
        that is missing merges its phase into the next one."""
        spawned = env_time(SPAWNED_AT_ENV)
        if died_at is not None:
            origin: tuple[str, float | None] = ("death", died_at)
            ends = [
                ("death_detection", env_time(DETECTED_AT_ENV)),
                ("stop_old_workers", env_time(STOPPED_AT_ENV)),
                ("respawn", spawned),
            ]
        elif env_time(LAUNCHED_AT_ENV) is not None:
            origin, ends = ("launch", env_time(LAUNCHED_AT_ENV)), [("launcher_start", spawned)]
        else:
            origin, ends = ("spawn", spawned), []
        ends.append(("process_start", self.started))
        if origin[1] is None:
            return
        self.origin_kind, last = origin[0], min(origin[1], self.started)
        self.origin = last
        out = []
        for name, t in ends:
            if t is None:
                continue
            t = min(max(t, last), self.started)  # clocks of one host; a stamp never runs backwards
            out.append(Phase(name, last, t - last))
            last = t
        self._before = out

    def phases(self) -> list[Phase]:
        return [*self._before, *self._phases]

    def fields(self) -> dict[str, Any]:
        """The event's timing fields: every phase, where the gap began and what it cost in all."""
        return {
            "phases": [p.to_dict() for p in self.phases()],
            "origin": self.origin_kind,
            "origin_at": round(self.origin, 3),
            "total_s": round(self._last - self.origin, 3),
            "ready_at": round(self._last, 3),
        }


TIMELINE = Timeline()
"""This process's start (one generation per process)."""
