"""watch's tau findings (runner.watch.detect_tau) on the job's `tau` events: quiet but shown on a
healthy run, tau_falling on the "high accuracy, no acceptance" case, tau_stalled on a flat tau and
on tau 1.0, and the tau gauge in the Prometheus families."""

from __future__ import annotations

from typing import Any

from test_watch_detectors import T0, kinds, run, sample

from runner.watch.detectors import Thresholds


def _tau(step: int, tau: float, acc: float, t: float) -> dict[str, Any]:
    return {"t": t, "event": "tau", "step": step, "tau": tau, "acc": acc, "histogram": {"1": 1}}


def _with_taus(*points: tuple[int, float, float]) -> dict[str, Any]:
    s = sample()
    s["events"] = [_tau(step, tau, acc, T0 - 100 + i) for i, (step, tau, acc) in enumerate(points)]
    return s


def _tau_kinds(findings) -> list[tuple[str, str, str]]:
    return [k for k in kinds(findings) if k[1].startswith("tau")]


def test_a_rising_tau_is_shown_and_raises_nothing() -> None:
    findings = run(_with_taus((200, 1.4, 0.20), (400, 1.9, 0.25), (600, 2.3, 0.28)))
    assert _tau_kinds(findings) == [("info", "tau", "drafter")]
    (f,) = [f for f in findings if f.kind == "tau"]
    assert "tau 2.30" in f.message and "rising: 1.90 at step 400" in f.message and f.numbers["step"] == 600


def test_tau_falling_while_acc_rises_is_the_high_accuracy_no_acceptance_failure() -> None:
    findings = run(_with_taus((200, 1.4, 0.20), (400, 2.2, 0.25), (600, 1.6, 0.31)))
    assert ("warning", "tau_falling", "drafter") in _tau_kinds(findings)
    (f,) = [f for f in findings if f.kind == "tau_falling"]
    assert "2.20 at step 400" in f.message and "0.250 -> 0.310" in f.message
    assert f.numbers["best_tau"] == 2.2 and f.numbers["tau"] == 1.6
    # tau falling with acc falling too is a worse drafter, not this failure: no tau_falling.
    assert "tau_falling" not in [
        k[1] for k in _tau_kinds(run(_with_taus((200, 2.2, 0.30), (400, 1.6, 0.20))))
    ]


def test_a_flat_tau_and_no_acceptance_stall() -> None:
    flat = run(_with_taus((200, 1.50, 0.2), (400, 1.51, 0.21), (600, 1.50, 0.22), (800, 1.51, 0.23)))
    assert ("warning", "tau_stalled", "drafter") in _tau_kinds(flat)
    none = run(_with_taus((200, 1.0, 0.2), (400, 1.0, 0.3)))
    (f,) = [f for f in none if f.kind == "tau_stalled"]
    assert "no draft token was accepted in the last 2 measurements" in f.message
    loose = Thresholds(tau_stall_measurements=5)
    assert "tau_stalled" not in [
        k[1] for k in _tau_kinds(run(_with_taus((2, 1.5, 0.2), (4, 1.51, 0.2), (6, 1.5, 0.2)), th=loose))
    ]


def test_no_tau_events_no_tau_findings() -> None:
    assert _tau_kinds(run(sample())) == []


def test_a_tau_the_job_could_not_measure_is_explained() -> None:
    s = sample()
    reason = (
        "no room for the in-job tau: the target and drafter need 22.4 GiB on cuda:0 and it has 9.0 GiB free"
    )
    s["events"] = [{"t": T0 - 50, "event": "tau_skipped", "step": 200, "reason": reason}]
    findings = run(s)
    assert _tau_kinds(findings) == [("info", "tau_unmeasured", "drafter")]
    (f,) = [f for f in findings if f.kind == "tau_unmeasured"]
    assert f.message == f"tau not measured at step 200: {reason}"
    # A failure after a measurement: the newest tau is still shown, and why the next one is missing.
    s = _with_taus((200, 1.4, 0.20))
    s["events"].append(
        {"t": T0 - 10, "event": "tau_failed", "step": 400, "exit_code": 1, "error": "error: boom"}
    )
    findings = run(s)
    assert _tau_kinds(findings) == [("info", "tau", "drafter"), ("info", "tau_unmeasured", "drafter")]
    assert [f.message for f in findings if f.kind == "tau_unmeasured"] == [
        "tau not measured at step 400: error: boom"
    ]
    # A measurement after the failure: nothing left to explain.
    s["events"].append(_tau(600, 1.6, 0.22, T0 - 5))
    assert _tau_kinds(run(s)) == [("info", "tau", "drafter")]
