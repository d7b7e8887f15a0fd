"""The run's steady rate: the reference a slowdown is judged against.

A median of recent records follows a slide down: every slower record pulls it along, so a run that
loses a little each interval never looks slower than "recently". The reference here is the best
sustained rate the run has shown: the highest median tok/s over REFERENCE_RECORDS consecutive
records. A median of several needs most of them fast, so one burst cannot set it, and the slow
records of a start or a compile never raise it. Once set, later slow records cannot lower it; only a
faster sustained stretch replaces it. One reference per drafter world size: a group that shrank
trains slower for a reason of its own.

History folds every metrics record in as it arrives, so the reference outlives the bounded record
window (a slide longer than that window is still measured from where it began).
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

REFERENCE_RECORDS = 5
"""Consecutive metrics records whose median tok/s can become the reference."""


@dataclass(frozen=True, slots=True)
class Reference:
    tok_s: float
    """The median tok/s of the best sustained stretch."""
    t: float
    """When that stretch's last record was written."""
    step: int | None
    world: int | None
    """The drafter world size it was measured with."""


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def world_of(m: Mapping[str, Any]) -> int | None:
    """The drafter world size a metrics record was written with (None: not recorded)."""
    w = m.get("world_size")
    return w if isinstance(w, int) and not isinstance(w, bool) else None


class SteadyRate:
    def __init__(self, records: int = REFERENCE_RECORDS) -> None:
        self.records = records
        self._recent: dict[int | None, collections.deque[float]] = {}
        self.best: dict[int | None, Reference] = {}

    def add(self, m: Mapping[str, Any]) -> None:
        tok, t = _num(m.get("tok_s")), _num(m.get("t"))
        if tok is None or t is None:
            return
        world = world_of(m)
        recent = self._recent.setdefault(world, collections.deque(maxlen=self.records))
        recent.append(tok)
        if len(recent) < self.records:
            return
        med = statistics.median(recent)
        best = self.best.get(world)
        if med > 0 and (best is None or med > best.tok_s):
            step = m.get("step")
            self.best[world] = Reference(
                tok_s=med, t=t, step=step if isinstance(step, int) else None, world=world
            )

    def reference(self, world: int | None) -> Reference | None:
        return self.best.get(world)
