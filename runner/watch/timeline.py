"""The runner's reader of the job's `generation_start` event: where each start of a worker generation
(the drafter group's, a target's) spent its seconds, from the death it replaces or the launch to its
first useful work (docs/run-directory.md). Read by `dflashctl report`, the dashboard and watch's
`restarts` finding. Every field is untrusted: a malformed one reads as unknown, never as an error.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

EVENT = "generation_start"
DRAFTERS = "drafter-group"


def _seconds(x: Any) -> float | None:
    """Finite, non-negative seconds, else None (null, a string such as "3.2", a bool, NaN, -1)."""
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x < 0:
        return None
    return float(x)


def _int(x: Any) -> int | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    if isinstance(x, float) and not x.is_integer():
        return None
    return int(x)


def _name(x: Any, width: int = 40) -> str:
    """An untrusted name as one short printable line (it is printed and drawn)."""
    text = "".join(c if c.isprintable() else "?" for c in str(x))
    return text if len(text) <= width else text[: width - 3] + "..."


def secs(s: float) -> str:
    """Seconds as the timeline gives them: 0.01, 6.2, 118."""
    return f"{s:.2f}" if s < 0.1 else f"{s:.1f}" if s < 100 else f"{s:.0f}"


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseSpan:
    name: str
    offset_s: float
    """Seconds from the start's origin (the death, or the launch) to the phase's start."""
    seconds: float


@dataclass(frozen=True, kw_only=True, slots=True)
class StartTimeline:
    """One `generation_start` event."""

    t: float | None
    role: str
    worker: str
    generation: int | None
    restart: bool
    origin: str
    total_s: float | None
    phases: tuple[PhaseSpan, ...]
    graphs: tuple[tuple[str, float], ...]
    """The first step's seconds per batch shape (graph load or compile, and the step)."""
    resumed_from: int | None
    resumed_from_kind: str | None
    died_at_step: int | None
    rolled_back_steps: int | None

    @property
    def label(self) -> str:
        who = "drafters" if self.role == DRAFTERS else self.worker
        gen = "?" if self.generation is None else str(self.generation)
        return f"{who} {'restart' if self.restart else 'start'} (gen {gen})"

    def slowest(self) -> list[PhaseSpan]:
        return sorted(self.phases, key=lambda p: -p.seconds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "t": self.t,
            "role": self.role,
            "worker": self.worker,
            "generation": self.generation,
            "restart": self.restart,
            "origin": self.origin,
            "total_s": self.total_s,
            "phases": [{"phase": p.name, "offset_s": p.offset_s, "seconds": p.seconds} for p in self.phases],
            "slowest_phase": None if not self.phases else self.slowest()[0].name,
            "graphs": dict(self.graphs),
            "resumed_from": self.resumed_from,
            "resumed_from_kind": self.resumed_from_kind,
            "died_at_step": self.died_at_step,
            "rolled_back_steps": self.rolled_back_steps,
        }


def _phases(raw: Any, origin_at: float | None) -> tuple[PhaseSpan, ...]:
    out: list[PhaseSpan] = []
    offset = 0.0
    for p in raw if isinstance(raw, list) else []:
        if not isinstance(p, Mapping):
            continue
        seconds = _seconds(p.get("seconds"))
        if seconds is None or "phase" not in p:
            continue
        start = p.get("start")
        if origin_at is not None and isinstance(start, int | float) and math.isfinite(start):
            offset = max(0.0, float(start) - origin_at)
        out.append(PhaseSpan(name=_name(p["phase"]), offset_s=offset, seconds=seconds))
        offset += seconds
    return tuple(out)


def parse_start(e: Mapping[str, Any]) -> StartTimeline | None:
    """A `generation_start` event as a StartTimeline; None for any other record."""
    if e.get("event") != EVENT:
        return None
    origin_at = e.get("origin_at")
    origin_at = float(origin_at) if isinstance(origin_at, int | float) and math.isfinite(origin_at) else None
    phases = _phases(e.get("phases"), origin_at)
    total = _seconds(e.get("total_s"))
    died, resumed, rolled = (
        _int(e.get("died_at_step")),
        _int(e.get("resumed_from")),
        _int(e.get("rolled_back_steps")),
    )
    raw = e.get("graphs")
    raw_graphs: Mapping[Any, Any] = raw if isinstance(raw, Mapping) else {}
    graphs = [(_name(k), v) for k, v in ((k, _seconds(v)) for k, v in raw_graphs.items()) if v is not None]
    generation = _int(e.get("generation"))
    restart = e.get("restart")
    kind = e.get("resumed_from_kind")
    return StartTimeline(
        t=_seconds(e.get("t")),
        role=_name(e.get("role", DRAFTERS)),
        worker=_name(e.get("worker", "")),
        generation=generation,
        restart=restart if isinstance(restart, bool) else bool(generation),
        origin=_name(e.get("origin", "?")),
        total_s=total if total is not None else (sum(p.seconds for p in phases) if phases else None),
        phases=phases,
        graphs=tuple(sorted(graphs, key=lambda kv: -kv[1])),
        resumed_from=resumed,
        resumed_from_kind=_name(kind) if isinstance(kind, str) and kind else None,
        died_at_step=died,
        rolled_back_steps=rolled if rolled is not None and rolled >= 0 else None,
    )


def starts(events: Iterable[Any]) -> list[StartTimeline]:
    return [s for s in (parse_start(e) for e in events if isinstance(e, Mapping)) if s is not None]


def last_restart(events: Iterable[Any], role: str = DRAFTERS) -> StartTimeline | None:
    """The newest restart of `role` whose new generation reached its first step."""
    return next((s for s in reversed(starts(events)) if s.restart and s.role == role), None)


def rollback(s: StartTimeline) -> str:
    source = f"from {s.resumed_from_kind}" if s.resumed_from_kind else "from step 0"
    n = s.rolled_back_steps
    if n is None:
        return f"steps rolled back unknown ({source})"
    return f"{n} step{'' if n == 1 else 's'} rolled back ({source})"


def cost(s: StartTimeline, slowest: int = 2) -> str:
    """One line: `18.1 s from death to first step, 3 steps rolled back (from checkpoint); slowest:
    imports 6.2 s, first_step 3.2 s`."""
    what = "first step" if s.role == DRAFTERS else "first batch"
    since = "death" if s.origin == "death" else s.origin
    line = (
        f"{secs(s.total_s)} s from {since} to {what}" if s.total_s is not None else f"time to {what} unknown"
    )
    if s.role == DRAFTERS and s.restart:
        line += f", {rollback(s)}"
    top = s.slowest()[:slowest]
    if top:
        line += "; slowest: " + ", ".join(f"{p.name} {secs(p.seconds)} s" for p in top)
    return line
