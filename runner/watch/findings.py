"""What a detector reports, and the exit code a set of findings means."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Severity = Literal["info", "warning", "critical"]
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


@dataclass(frozen=True, kw_only=True, slots=True)
class Finding:
    severity: Severity
    kind: str
    """What was found: dead_worker, hung_worker, likely_oom, drafters_bottleneck, ..."""
    subject: str
    """Whom it is about: a worker (drafter-1), a GPU (GPU 5), the pipeline, the run, nvml, sampler."""
    message: str
    """What is wrong, in plain words, with the numbers that show it."""
    advice: str
    """What to do next."""
    numbers: Mapping[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        """Stable across refreshes: the same problem on the same subject is one finding."""
        return (self.kind, self.subject)

    def to_dict(self) -> dict[str, Any]:
        return {
            "severity": self.severity,
            "kind": self.kind,
            "subject": self.subject,
            "message": self.message,
            "advice": self.advice,
            "numbers": dict(self.numbers),
        }


def sort_findings(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (-SEVERITY_RANK[f.severity], f.kind, f.subject))


def stop_reason(findings: Iterable[Finding]) -> str | None:
    """The reason of the `job_stopped` finding ("" when the job stopped without one), None if none."""
    stopped = next((f for f in findings if f.kind == "job_stopped"), None)
    return None if stopped is None else str(stopped.numbers.get("reason") or "")


def exit_code(findings: Iterable[Finding]) -> int:
    """0 healthy (info at most), 1 warnings, 2 critical: what `watch --once --json` exits with."""
    return max((SEVERITY_RANK[f.severity] for f in findings), default=0)
