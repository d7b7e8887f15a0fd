"""Detector thresholds, with defaults, overridable from a `[watch]` TOML table (Thresholds.from_table).
Defaults are set so the field's incident fires and a healthy run stays quiet (tests/runner/test_watch_*)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runner.errors import BadInput


class OutOfRange(BadInput):
    """A threshold outside its range (Thresholds.RANGES)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Thresholds:
    stale_s: float = 10.0
    """A heartbeat older than this means the worker is dead (process gone) or frozen (process still
    there: stopped, or stuck holding the GIL). Heartbeats are rewritten every second."""
    hung_s: float = 20.0
    """No progress (step, published batch) for this long, while input waits and the GPU is idle,
    means a hung worker. Longer than the slowest normal step."""
    starting_limit_s: float = 900.0
    """A worker still `starting` (loading its model, joining its group) after this long is stuck."""
    compile_limit_s: float = 900.0
    """A worker `compiling` this long is stuck, where the run has no compile of its own to go by."""
    compile_history_factor: float = 4.0
    """Where it has one: compiling longer than this many times the run's longest compile so far (its
    `compiled` events), and at least 120 s, is stuck."""
    checkpoint_limit_s: float = 600.0
    """A worker `checkpointing` this long is stuck (a hung filesystem, a full disk)."""
    wait_limit_s: float = 600.0
    """A worker waiting on a queue (waiting_input, waiting_output) this long without a change of
    state: a warning naming the other side it waits for."""
    idle_util_pct: float = 10.0
    """A GPU at or below this utilization is idle (the field's stuck drafters read 0-4%)."""
    busy_util_pct: float = 90.0
    """A GPU at or above this utilization is busy (for "which GPU is the busy one")."""
    idle_window_s: float = 10.0
    """A GPU counts as idle only if it stayed idle in every sample over this window."""
    targets_busy_util_pct: float = 50.0
    """Target GPUs at or above this median utilization are working, not blocked."""
    mem_full_frac: float = 0.95
    """GPU memory at or above this fraction of the total counts as full."""
    oom_util_pct: float = 5.0
    """A full GPU at or below this utilization, with no progress, is likely OOM or a broken context."""
    oom_no_progress_s: float = 20.0
    """How long a full, idle GPU's worker must have made no progress to be called likely OOM."""
    warmup_s: float = 300.0
    """After a worker starts (and while it is compiling), its memory spike and low throughput are
    not judged: the first compile fills memory and the first records are slow."""
    idle_share_warn: float = 0.2
    """The waiting half's GPUs idle this share of the time (1 - utilization over idle_share_window_s)
    while the other half is the bottleneck: the slower-half finding is then a warning, not info."""
    idle_share_window_s: float = 60.0
    """The window over which that idle share is averaged."""
    queue_full_frac: float = 0.9
    """A queue at or above this fraction of its capacity is full (q_pre: pipeline.prefetch_depth,
    q_hs: pipeline.queue_depth from run.json)."""
    queue_empty_frac: float = 0.25
    """A queue at or below this fraction of its capacity is near empty (q_hs=[2] of 8 is)."""
    degraded_frac: float = 0.7
    """tok/s below this fraction of the stored baseline (same fingerprint and config) is degraded."""
    throughput_window: int = 5
    """Metrics records whose median tok/s is compared (one slow interval is not a trend)."""
    eta_blowup: float = 2.0
    """tok/s this many times below the run's steady reference (its best sustained rate, which a slide
    cannot drag down: runner.watch.steady), so the ETA this many times what the steady rate gives."""
    slowdown_records: int = 3
    """The newest records (after warm-up) that must all be that slow: one slow interval is no slowdown."""
    metrics_stale_intervals: float = 6.0
    """No metrics record for this many of the run's record cadences while the job runs (the cadence:
    the largest of run.status_interval_s, its recent records' median gap and its step time)."""
    xid_window_s: float = 3600.0
    """XID events are reported for this long after they happened."""
    sampler_silent_s: float = 10.0
    """No line from the sampler for this long: the host, the ssh link or the sampler is stuck."""
    tau_drop_frac: float = 0.1
    """tau below its best measurement so far by this share, while acc holds or rises: the "high
    accuracy, no acceptance" failure (the job's `tau` events, train.tau_eval)."""
    tau_stall_measurements: int = 4
    """This many tau measurements in a row without a gain of tau_stall_gain over the first of them."""
    tau_stall_gain: float = 0.02
    """The stall's gain, in tokens per verification."""

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise OutOfRange(problem)

    def problem(self) -> str | None:
        """The first value out of its range (RANGES), or None: a NaN or infinite threshold would make
        its detector never (or always) fire, and that must not pass as a setting."""
        for name, (low, high, low_open, words) in RANGES.items():
            v = getattr(self, name)
            if not math.isfinite(v) or v < low or (low_open and v == low) or (high is not None and v > high):
                return f"{name} must be {words} (got {v!r})"
        for small, big in PAIRS:
            if getattr(self, small) >= getattr(self, big):
                return f"{small} ({getattr(self, small)!r}) must be below {big} ({getattr(self, big)!r})"
        return None

    @classmethod
    def from_table(cls, table: Mapping[str, Any] | None, *, where: str = "[watch]") -> Thresholds:
        """Defaults overridden by a TOML table, e.g. the `[watch]` table of dflashctl's config file:
        keys are the field names; a wrong key or type, or a value out of its range (finite, within
        RANGES), raises BadInput naming it."""
        if not table:
            return cls()
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in table.items():
            if key not in fields:
                raise BadInput(f"{where} {key}: unknown threshold; known: {', '.join(sorted(fields))}")
            want = int if fields[key].type in ("int", int) else float
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or (want is int and not isinstance(value, int))
            ):
                raise BadInput(
                    f"{where} {key} must be {'an integer' if want is int else 'a number'} (got {value!r})"
                )
            values[key] = want(value)
        try:
            return cls(**values)
        except OutOfRange as e:
            raise BadInput(f"{where} {e}") from None

    def to_table(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_PCT = (0.0, 100.0, False, "a percentage from 0 to 100")
_SHARE = (0.0, 1.0, True, "a share above 0 and at most 1")
_SECONDS = (0.0, None, True, "a number of seconds above 0")
RANGES: dict[str, tuple[float, float | None, bool, str]] = {
    "stale_s": _SECONDS,
    "hung_s": _SECONDS,
    "starting_limit_s": _SECONDS,
    "compile_limit_s": _SECONDS,
    "compile_history_factor": (1.0, None, True, "a factor above 1"),
    "checkpoint_limit_s": _SECONDS,
    "wait_limit_s": _SECONDS,
    "idle_util_pct": _PCT,
    "busy_util_pct": _PCT,
    "idle_window_s": (0.0, None, False, "a number of seconds, 0 or more"),
    "targets_busy_util_pct": _PCT,
    "mem_full_frac": _SHARE,
    "oom_util_pct": _PCT,
    "oom_no_progress_s": _SECONDS,
    "warmup_s": (0.0, None, False, "a number of seconds, 0 or more"),
    "idle_share_warn": _SHARE,
    "idle_share_window_s": _SECONDS,
    "queue_full_frac": _SHARE,
    "queue_empty_frac": (0.0, 1.0, False, "a share from 0 to 1"),
    "degraded_frac": _SHARE,
    "throughput_window": (1, None, False, "a count of 1 or more"),
    "eta_blowup": (1.0, None, True, "a factor above 1"),
    "slowdown_records": (1, None, False, "a count of 1 or more"),
    "metrics_stale_intervals": (0.0, None, True, "a number of intervals above 0"),
    "xid_window_s": _SECONDS,
    "sampler_silent_s": _SECONDS,
    "tau_drop_frac": _SHARE,
    "tau_stall_measurements": (2, None, False, "a count of 2 or more"),
    "tau_stall_gain": (0.0, None, False, "a number of tokens, 0 or more"),
}
"""Each threshold's range: (low, high or None, low excluded, the words for the error line)."""
PAIRS = (("idle_util_pct", "busy_util_pct"), ("queue_empty_frac", "queue_full_frac"))
"""Thresholds that must stay in order: an idle GPU is below a busy one, an empty queue below a full one."""
