"""The in-job tau's pacing and its room on a GPU (dflash.pipeline.supervisor.TauEval): a measurement
starts only within train.tau_budget of the wall time, the final checkpoint's always; an eval that
finds no room (exit 3) turns the measurements off with one tau_skipped event."""

from __future__ import annotations

import sys
import time

from dflash.config import load_config
from dflash.errors import DoesNotFit
from dflash.pipeline.supervisor import Proc, TauEval, tau_device
from dflash.rundir import RunDir


def _tau(repo, tmp_path, budget: float) -> TauEval:
    cfg = load_config(repo / "configs" / "demo-cpu.toml", [f"train.tau_budget={budget}"])
    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True, exist_ok=True)
    return TauEval(cfg, run, "demo")


def test_a_measurement_waits_for_the_budget(repo, tmp_path, monkeypatch) -> None:
    tau = _tau(repo, tmp_path, 0.02)
    started: list[tuple[str, int | None]] = []
    monkeypatch.setattr(tau, "_start", lambda path, step: started.append((path, step)))
    now = time.time()
    assert tau.allowed(now)  # nothing spent yet: the first checkpoint is measured at once
    tau.spent_s, tau.since = 10.0, now - 100  # 10 s spent in 100: 10%, above 2%
    tau.due("ck/step-200", 200)
    tau.due("ck/step-300", 300)
    assert started == [] and tau.waiting == ("ck/step-300", 300)  # only the newest waits
    tau.since = now - 501  # 10 s in 501 s: within 2%
    tau.poll()
    assert started == [("ck/step-300", 300)] and tau.waiting is None
    tau.since = now - 100
    tau.due("ck/step-400", 400)
    assert len(started) == 1
    tau.finish(wait_s=0.5)  # the final checkpoint is measured whatever the budget says
    assert started[-1] == ("ck/step-400", 400)


def test_budget_one_measures_every_checkpoint(repo, tmp_path) -> None:
    tau = _tau(repo, tmp_path, 1.0)
    tau.spent_s, tau.since = 6.0, time.time() - 6  # measurements back to back since the start
    assert tau.allowed(time.time())
    tau.cfg.train.tau_budget = 0.5
    assert not tau.allowed(time.time())


def test_no_room_on_the_gpu_is_said_once_and_measuring_stops(repo, tmp_path, monkeypatch) -> None:
    tau = _tau(repo, tmp_path, 1.0)
    line = "error: the target and drafter need 22.4 GiB on cuda:0 and it has 9.0 GiB free of 139.8"
    proc = Proc(
        "tau-eval",
        [
            sys.executable,
            "-c",
            f"import sys; print({line!r}, file=sys.stderr); sys.exit({DoesNotFit.EXIT_CODE})",
        ],
        tau.run.logs / "tau-eval.log",
    )
    proc.start()
    assert proc.popen is not None and proc.popen.wait(timeout=60) == DoesNotFit.EXIT_CODE
    tau.proc, tau.step, tau.started = proc, 200, time.time()
    tau.poll()
    (skipped,) = tau.run.read_events("tau_skipped")
    assert (
        skipped["step"] == 200
        and "no room for the in-job tau: the target and drafter need 22.4" in skipped["reason"]
    )
    assert not tau.run.read_events("tau_failed")
    started: list[object] = []
    monkeypatch.setattr(tau, "_start", lambda path, step: started.append(step))
    tau.due("ck/step-300", 300)
    tau.finish(wait_s=0.5)
    assert started == [] and len(tau.run.read_events("tau_skipped")) == 1


def test_the_eval_runs_on_the_first_targets_gpu() -> None:
    assert tau_device(["cuda:2", "cuda:3"]) == "cuda:2"
    assert tau_device(["cpu"]) == "cpu" and tau_device([]) == "cpu"


def test_a_measurement_killed_with_a_stopping_job_is_no_failure(repo, tmp_path, monkeypatch) -> None:
    import signal

    tau = _tau(repo, tmp_path, 1.0)
    proc = Proc(
        "tau-eval", [sys.executable, "-c", "import time; time.sleep(60)"], tau.run.logs / "tau-eval.log"
    )
    proc.start()
    tau.proc, tau.step, tau.started = proc, 120, time.time()
    tau.stopping = True  # the supervisor's signal handler sets it; its second signal kills every process
    proc.signal(signal.SIGKILL)
    assert proc.popen is not None and proc.popen.wait(timeout=30) < 0
    started: list[object] = []
    monkeypatch.setattr(tau, "_start", lambda path, step: started.append(step))
    tau.due("ck/step-134", 134)  # the stop's own checkpoint: not measured while the job stops
    tau.finish(wait_s=0)
    (failed,) = tau.run.read_events("tau_failed")
    assert failed["step"] == 120 and failed["error"] == "stopped with the job before it finished"
    assert started == []
