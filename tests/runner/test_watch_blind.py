"""watch is never blind in silence (issue 49 part 2): a sampler that fails before its first sample,
exits, goes quiet or sends lines it cannot read, and a source the sampler cannot read, are critical
findings naming the host and the source; `watch --once` exits 2 on them; a live watch starts an
exited sampler again; thresholds and timings that are not finite or out of range are refused."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from test_watch_fakes import healthy_sample, manifest, write_heartbeat
from typer.testing import CliRunner

from runner.cli import app
from runner.errors import RunnerError
from runner.launch.registry import HostRecord, RunRecord
from runner.watch import detectors
from runner.watch.findings import Finding
from runner.watch.sampler import SamplerState, sample_once
from runner.watch.session import WatchSession
from runner.watch.snapshot import History
from runner.watch.thresholds import Thresholds
from runner.watch.watcher import Watcher

T0 = 1_800_000_000.0


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(manifest()))
    write_heartbeat(run, "drafter-0", step=3)
    return run


def _once(run: Path, spec: Path, *args: str) -> tuple[int, dict]:
    out = CliRunner().invoke(app, ["watch", str(run), "--once", "--json", "--fake-nvml", str(spec), *args])
    return out.exit_code, json.loads(out.output.strip().splitlines()[-1])


def _findings(doc: dict) -> list[dict]:
    return [f for h in doc["hosts"] for f in h["findings"]]


def test_once_exits_2_when_the_sampler_dies_before_its_first_sample(tmp_path: Path) -> None:
    """The field's worst case: damage killed the sampler and --once said "healthy", exit 0."""
    run = _run_dir(tmp_path)
    spec = tmp_path / "nvml.json"
    spec.write_text("{not json")  # the sampler raises at its start
    code, doc = _once(run, spec)
    f = [f for f in _findings(doc) if f["kind"] == "sampler"]
    assert code == 2 and doc["exit_code"] == 2 and f and f[0]["severity"] == "critical", doc
    assert f[0]["subject"] == "sampler on localhost" and "before its first sample" in f[0]["message"]
    assert "JSONDecodeError" in f[0]["message"], "the sampler's last words are quoted"


def test_a_source_the_sampler_cannot_read_is_critical_and_names_it(tmp_path: Path) -> None:
    """metrics.jsonl that is a directory: the sampler goes on without it (GPUs and workers still
    judged) and says which source failed on which host."""
    run = _run_dir(tmp_path)
    (run / "metrics.jsonl").mkdir()
    spec = tmp_path / "nvml.json"
    spec.write_text(json.dumps({"gpus": [{"util_gpu": 50}]}))
    state = SamplerState(run, host="gpu-7")
    s = sample_once(state)
    assert [e["source"] for e in s["source_errors"]] == ["metrics.jsonl"]
    assert "IsADirectoryError" in s["source_errors"][0]["error"] and "drafter-0" in s["workers"]
    code, doc = _once(run, spec)
    failed = [f for f in _findings(doc) if f["kind"] == "source_failed"]
    assert code == 2 and failed and failed[0]["severity"] == "critical", doc
    assert (
        failed[0]["subject"].startswith("metrics.jsonl on ")
        and "could not read metrics.jsonl" in failed[0]["message"]
    )
    assert doc["hosts"][0]["workers"], "the other sources are still read"


def test_an_nvml_that_raises_is_a_source_error_not_a_dead_sampler(tmp_path: Path) -> None:
    class Broken:  # stands in for an NVML binding that raises something of its own
        status = "ok"

        def read_gpus(self) -> list:
            raise RuntimeError("driver went away")

        def poll_xids(self) -> str:
            return "n/a"

        def stuck_calls(self) -> list:
            return []

    run = _run_dir(tmp_path)
    s = sample_once(SamplerState(run, nvml=Broken(), host="gpu-7"))  # type: ignore[arg-type]
    assert s["source_errors"] == [{"source": "nvml", "error": "RuntimeError: driver went away"}]
    history = History()
    history.ingest(json.loads(json.dumps(s, default=str)))
    f = [x for x in detectors.detect(history.snapshots) if x.kind == "source_failed"]
    assert [(x.severity, x.subject) for x in f] == [("critical", "nvml on gpu-7")]


def test_a_watcher_with_no_sample_is_never_healthy() -> None:
    now = [100.0]
    noise_only = Watcher(
        ["Traceback (most recent call last):", "OSError: boom"], clock=lambda: now[0], host="h1"
    )
    snap, f = noise_only.refresh(timeout=2.0)
    assert snap.source == "failed" and [(x.severity, x.kind, x.subject) for x in f] == [
        ("critical", "sampler", "sampler on h1")
    ]
    assert "OSError: boom" in f[0].message
    # Lines that are JSON but no readable sample: counted, quoted, and silent once the limit passes.
    bad = Watcher([json.dumps({"t": 5, "workers": 7})], clock=lambda: now[0], host="h2")
    snap, f = bad.refresh(timeout=2.0)
    assert bad.bad_samples == 1 and "could not read" in bad.last_words
    assert snap.source == "failed" and f[0].severity == "critical"
    # Still starting: info, not healthy and not critical.
    waiting = Watcher(None, clock=lambda: now[0], host="h3")
    snap, f = waiting.refresh()
    assert snap.source == "starting" and [(x.severity, x.kind) for x in f] == [("info", "sampler")]
    now[0] += 11
    snap, f = waiting.refresh()
    assert snap.source == "silent" and f[0].severity == "critical" and "no sample from h3" in f[0].message


def test_a_healthy_sampler_stays_quiet() -> None:
    w = Watcher([json.dumps(healthy_sample(T0))], host="gpu-host")
    snap, f = w.refresh(timeout=2.0)
    assert snap.source == "ok" and f == []


def test_a_live_watch_starts_an_exited_sampler_again(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    spec = tmp_path / "nvml.json"
    spec.write_text("{not json")
    rec = RunRecord(run_id="r", name="r", backend="unknown", created_at=time.time(), config="",
                    hosts=[HostRecord(node_rank=0, host=None, run_dir=str(run))])  # fmt: skip
    session = WatchSession(
        rec, interval_s=0.2, thresholds=Thresholds(sampler_silent_s=0.5), fake_nvml=str(spec)
    )
    try:
        deadline = time.monotonic() + 20
        hw = session.hosts[0]
        while not hw.watcher.ended and time.monotonic() < deadline:
            session.refresh(timeout=0.2)
        assert hw.watcher.ended and hw.watcher.history.latest is None
        assert any(f.kind == "sampler" and f.severity == "critical" for f in hw.findings)
        spec.write_text(json.dumps({"gpus": [{"util_gpu": 80}]}))  # the host is mended
        while hw.watcher.history.latest is None and time.monotonic() < deadline:
            session.refresh(timeout=0.2)
        assert hw.watcher.restarts >= 1 and hw.watcher.history.latest is not None
        session.refresh(timeout=0.5)
        assert not [f for f in hw.findings if f.kind == "sampler"], hw.findings
    finally:
        session.close()


def test_a_check_that_breaks_is_a_finding_and_the_others_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(history: object, th: object) -> list[Finding]:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(detectors, "DETECTORS", (broken, *detectors.DETECTORS))
    history = History()
    history.ingest(dict(healthy_sample(T0), run_dir_exists=False))
    f = detectors.detect(history.snapshots)
    assert ("critical", "watch_error", "broken") in [(x.severity, x.kind, x.subject) for x in f]
    assert any(x.kind == "run_dir_missing" for x in f)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--threshold", "hung_s=nan"], "hung_s must be a number of seconds above 0 (got nan)"),
        (["--threshold", "stale_s=inf"], "stale_s must be a number of seconds above 0 (got inf)"),
        (["--threshold", "idle_util_pct=-1"], "idle_util_pct must be a percentage from 0 to 100"),
        (["--threshold", "mem_full_frac=1.5"], "mem_full_frac must be a share above 0 and at most 1"),
        (["--threshold", "idle_util_pct=95"], "idle_util_pct (95.0) must be below busy_util_pct (90.0)"),
        (["--threshold", "throughput_window=0"], "throughput_window must be a count of 1 or more"),
        (["--interval", "nan"], "--interval must be a number of seconds above 0"),
        (["--grace", "inf"], "--grace must be a number of seconds, 0 or more"),
    ],
)
def test_thresholds_and_timings_out_of_range_are_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    run = _run_dir(tmp_path)
    out = CliRunner().invoke(app, ["watch", str(run), "--once", *args])
    assert out.exit_code == 2 and says in " ".join(out.output.split()), out.output
    assert "Traceback" not in out.output


def test_thresholds_in_range_are_taken() -> None:
    th = Thresholds.from_table({"hung_s": 60, "idle_util_pct": 0, "warmup_s": 0, "queue_empty_frac": 0})
    assert (th.hung_s, th.idle_util_pct, th.warmup_s) == (60.0, 0.0, 0.0)
    with pytest.raises(RunnerError, match="eta_blowup must be a factor above 1"):
        Thresholds(eta_blowup=1.0)
    assert sys.modules["runner.watch.thresholds"].RANGES.keys() == {
        f for f in Thresholds.__dataclass_fields__
    }, "every threshold has its range"


def test_a_gpu_whose_nvml_call_hangs_is_named_and_the_others_still_read(tmp_path: Path) -> None:
    """One stuck NVML call used to blank every GPU with a warning naming neither the GPU nor the call."""
    run = _run_dir(tmp_path)
    spec = tmp_path / "nvml.json"
    gpus = [{"util_gpu": 40, "name": "NVIDIA H200"}, {"util_gpu": 50, "name": "NVIDIA H200"}]
    gpus.append({"util_gpu": 60, "name": "NVIDIA H200", "hang": ["nvmlDeviceGetUtilizationRates"]})
    spec.write_text(json.dumps({"gpus": gpus}))
    code, doc = _once(run, spec)
    hung = [f for f in _findings(doc) if f["kind"] == "nvml_hung"]
    assert [f["subject"] for f in hung] == ["GPU 2"], doc
    assert "nvmlDeviceGetUtilizationRates on GPU 2 (NVIDIA H200) has not returned" in hung[0]["message"]
    assert not [f for f in _findings(doc) if f["kind"] == "nvml"], "NVML as a whole still answers"
    utils = {g["index"]: g["util_gpu"] for g in doc["hosts"][0]["gpus"]}
    assert utils == {0: 40, 1: 50, 2: None}, utils
    assert code == 1


def test_nvml_hung_and_not_answering_findings_name_the_calls() -> None:
    s = healthy_sample(T0)
    s["gpus"][1].update(util_gpu="n/a", stuck_call="nvmlDeviceGetPowerUsage", stuck_s=42.0)
    s["nvml_stuck"] = [{"gpu": 1, "call": "nvmlDeviceGetPowerUsage", "for_s": 42.0}]
    f = [x for x in detectors.detect(_snaps(s)) if x.kind.startswith("nvml")]
    assert [(x.severity, x.kind, x.subject) for x in f] == [("warning", "nvml_hung", "GPU 1")]
    assert "nvmlDeviceGetPowerUsage" in f[0].message and "42 s" in f[0].message
    assert "drain GPU 1" in f[0].advice
    s["nvml"] = "not answering"
    s["nvml_stuck"].append({"gpu": None, "call": "nvmlEventSetWait", "for_s": 3.0})
    f = [x for x in detectors.detect(_snaps(s)) if x.kind.startswith("nvml")]
    assert [(x.kind, x.subject) for x in f] == [("nvml", "nvml")]
    assert (
        "nvmlDeviceGetPowerUsage on GPU 1" in f[0].message
        and "nvmlEventSetWait on no one GPU" in f[0].message
    )
    assert not [x for x in detectors.detect(_snaps(healthy_sample(T0))) if x.kind.startswith("nvml")]


def _snaps(s: dict) -> list:
    h = History()
    h.ingest(s)
    return list(h.snapshots)
