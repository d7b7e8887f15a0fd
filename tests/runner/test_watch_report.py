"""`dflashctl report`: the PNG (its panels, lines and markers, read back from the figure and the file),
the text summary's numbers, torn last lines, a run with no metrics yet, atomic writes, and the verb
over a run directory, a registry run on this machine and one on a host over a real loopback sshd."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from test_watch_fakes import append_jsonl, gpu, manifest, metric, worker
from typer.testing import CliRunner

from runner.cli import app
from runner.errors import RunnerError
from runner.launch.registry import HostRecord, Registry, RunRecord
from runner.watch import report as report_mod
from runner.watch.report import (
    NO_METRICS,
    NO_METRICS_PANEL,
    NO_SAMPLES,
    build_report,
    load_run,
    make_figure,
    summarize,
)

T0 = 1_800_000_000.0
RUN_ID = "field-20261201-000000"


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def torn(path: Path, text: str = '{"t": 1800009999, "step": 99') -> None:
    with open(path, "a") as f:
        f.write(text)  # a writer killed mid-record: no newline, not JSON


def make_run(run: Path, *, samples: int = 600, gpus: int = 8) -> Path:
    """A 10-minute pipeline run: 60 metrics records, two drafter-group restarts, watch findings and
    actions, a stop; 1 Hz watch samples over `gpus` GPUs (drafter-1 on GPU 7 idle after minute 5)."""
    (run / "watch").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({**manifest(), "started_at": T0, "run_id": RUN_ID}))
    for i in range(60):
        append_jsonl(
            run / "metrics.jsonl",
            metric(
                T0 + 10 * (i + 1),
                step=10 * (i + 1),
                loss=8.0 - i * 0.1,
                acc=0.01 * i,
                streak=0.05 * i,
                tok_s=1000.0 * (i + 1),
                q_pre=[50, 46, 48, 46, 47],
                q_hs=[i % 9],
            ),
        )
    torn(run / "metrics.jsonl")
    events: list[dict[str, Any]] = [
        {"t": T0 + 1, "event": "started", "role": "drafter-group", "generation": 0},
        {"t": T0 + 200, "event": "restart", "role": "drafter-group", "generation": 1},
        {"t": T0 + 300, "event": "finding", "source": "watch", "severity": "critical", "kind": "hung_worker",
         "subject": "drafter-1", "message": "m", "advice": "a"},
        {"t": T0 + 310, "event": "action", "source": "watch", "action": "terminate", "subject": "drafter-1",
         "detail": "SIGTERM"},
        {"t": T0 + 320, "event": "action", "source": "watch", "action": "kill", "subject": "drafter-1",
         "detail": "SIGKILL"},
        {"t": T0 + 330, "event": "restart", "role": "drafter-group", "generation": 2},
        {"t": T0 + 340, "event": "restart", "role": "target", "worker": "target-1", "pid": 7},
        {"t": T0 + 400, "event": "finding", "source": "watch", "severity": "warning", "kind": "eta_blowup",
         "subject": "run", "message": "m", "advice": "a"},
        {"t": T0 + 401, "event": "finding", "source": "watch", "severity": "info", "kind": "restarts",
         "subject": "drafter-group", "message": "m", "advice": "a"},
        {"t": T0 + 450, "event": "degraded", "worker": "drafter-0", "kind": "unfused_flex", "detail": ""},
        {"t": T0 + 590, "event": "stopped", "reason": "completed", "step": 600},
    ]  # fmt: skip
    append_jsonl(run / "events.jsonl", *events)
    torn(run / "events.jsonl", '{"t": 1800000700, "event": "fin')
    for k in range(samples):
        util = 0 if k >= 300 else 90
        s = {
            "t": T0 + k,
            "host": "gpu-host",
            "gpus": [gpu(i, util=util if i == 7 else 95, used=1024.0 * (10 + i)) for i in range(gpus)],
            "workers": {"drafter-1": worker("drafter-1", 7), "target-0": worker("target-0", 0)},
        }
        if k == 5 and gpus > 3:
            s["gpus"][3]["util_gpu"] = "n/a"  # NVML did not answer for one GPU once
        append_jsonl(run / "watch" / "samples.jsonl", s)
    torn(run / "watch" / "samples.jsonl", '{"t": 1800000600, "gpus": [{"index": 0, "util')
    return run


def panels(fig: Any) -> dict[str, Any]:
    return {ax.get_title(loc="left"): ax for ax in fig.axes}


def test_summary_numbers_and_torn_lines(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    out = tmp_path / "out" / "r.png"
    s = build_report(run, out)
    assert s.run_id == RUN_ID and s.duration_s == 600.0
    assert s.metrics_records == 60 and s.steps == 600, "the torn metrics line is skipped"
    assert (
        s.loss == pytest.approx(8.0 - 5.9)
        and s.acc == pytest.approx(0.59)
        and s.streak == pytest.approx(2.95)
    )
    assert s.tok_s_mean == pytest.approx(30500.0) and s.tok_s_last == 60000.0
    assert (s.restarts, s.generation, s.target_restarts) == (2, 2, 1)
    assert s.findings == {"hung_worker": 1, "eta_blowup": 1, "restarts": 1}
    assert s.findings_by_severity == {"critical": 1, "warning": 1, "info": 1}
    assert s.actions == {"terminate drafter-1": 1, "kill drafter-1": 1}
    assert s.job_events == {"degraded unfused_flex": 1}
    assert (s.stop_reason, s.stopped_at_step) == ("completed", 600)
    assert s.watch_samples == 600 and s.gpus == 8, "the torn samples line is skipped"
    text = "\n".join(s.lines)
    for want in (
        f"run {RUN_ID} ({run})",
        "duration 10 min from 2027-01-15 08:00 UTC",
        "steps 600 (60 metrics records)",
        "final loss 2.1000, acc 0.590, streak 2.95",
        "throughput mean 30.5K tok/s, last 60.0K tok/s",
        "restarts: 2 of the drafter group (last generation 2), 1 target restart(s)",
        "findings: 3 (eta_blowup x1, hung_worker x1, restarts x1); 1 critical, 1 warning, 1 info",
        "actions: 2 (kill drafter-1 x1, terminate drafter-1 x1)",
        "job events: degraded unfused_flex x1",
        "stopped: completed at step 600",
        "watch samples: 600 over 8 GPU(s)",
        f"png: {out}",
    ):
        assert want in s.lines, f"{want!r} not in:\n{text}"
    assert png_size(out) == (1600, 1300)
    assert [p.name for p in out.parent.iterdir()] == ["r.png"], "no temp file left beside the report"
    assert json.loads(json.dumps(s.to_dict()))["restarts"] == 2


def test_figure_panels_lines_and_markers(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    data = load_run(run)
    fig = make_figure(data, summarize(data, tmp_path / "x.png"))
    p = panels(fig)
    assert set(p) == {
        "tokens/s (thousands)",
        "loss",
        "accuracy (top-1)",
        "streak (expected accepted length)",
        "q_pre: data batches waiting per target",
        "q_hs: hidden-state batches ready",
        "GPU utilization (%)",
        "GPU memory used (GiB)",
    }

    def data_lines(ax: Any) -> list[Any]:
        return [ln for ln in ax.get_lines() if ln.get_gid() is None and len(ln.get_xdata()) > 2]

    tok = data_lines(p["tokens/s (thousands)"])
    assert len(tok) == 1 and list(tok[0].get_ydata())[-1] == 60.0
    assert list(tok[0].get_xdata())[-1] == pytest.approx(600 / 60), "minutes since start"
    q_pre = data_lines(p["q_pre: data batches waiting per target"])
    assert [ln.get_label() for ln in q_pre] == [f"target {i}" for i in range(5)]
    assert [list(ln.get_ydata())[0] for ln in q_pre] == [50, 46, 48, 46, 47]
    util = data_lines(p["GPU utilization (%)"])
    assert [ln.get_label() for ln in util][6:] == ["GPU 6", "GPU 7 drafter-1"] and len(util) == 8
    y7 = list(util[7].get_ydata())
    assert y7[0] == 90 and y7[-1] == 0, "GPU 7 goes idle at minute 5"
    y3 = list(util[3].get_ydata())
    assert y3[5] != y3[5] and y3[6] == 95, "an n/a reading is a gap (NaN), not 0"
    assert all(ln.get_gid() for ln in p["GPU utilization (%)"].get_lines()[8:]), "only markers besides GPUs"
    mem = [ln for ln in p["GPU memory used (GiB)"].get_lines() if ln.get_gid() is None]
    assert [ln.get_label() for ln in mem][-2:] == ["GPU 7 drafter-1", "total 95.6 GiB"]
    assert list(mem[2].get_ydata())[0] == 12.0 and list(mem[-1].get_ydata()) == [95.6, 95.6]

    for title, ax in p.items():
        kinds = [(ln.get_gid(), round(ln.get_xdata()[0] * 60)) for ln in ax.get_lines() if ln.get_gid()]
        assert kinds == [
            ("restart", 200),
            ("finding:critical", 300),
            ("action", 310),
            ("action", 320),
            ("restart", 330),
            ("target_restart", 340),
            ("finding:warning", 400),
            ("finding:info", 401),
            ("stopped", 590),
        ], title
    red = next(ln for ln in p["loss"].get_lines() if ln.get_gid() == "finding:critical")
    assert red.get_color() == "tab:red"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [
        "drafter-group restart",
        "target restart",
        "watch action",
        "finding (info)",
        "finding (warning)",
        "finding (critical)",
        "job stopped",
    ]


def test_gaps_break_lines_where_records_pause(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "gappy", "started_at": T0}))
    # records every 10 s, then the job is down for an hour, then it resumes
    ts = [T0 + 10 * i for i in range(10)] + [T0 + 3700 + 10 * i for i in range(10)]
    append_jsonl(run / "metrics.jsonl", *(metric(t, tok_s=5000.0) for t in ts))
    data = load_run(run)
    fig = make_figure(data, summarize(data, tmp_path / "x.png"))
    (line,) = [ln for ln in panels(fig)["tokens/s (thousands)"].get_lines() if ln.get_gid() is None]
    ys = list(line.get_ydata())
    assert len(ys) == 21 and ys[10] != ys[10] and ys[9] == ys[11] == 5.0


def test_a_run_with_no_metrics_yet(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"format": 1, "run_id": "fresh-1", "runner": {}}))
    (run / "metrics.jsonl").write_text('{"t": 18000')  # only a torn line
    out = run / "report.png"
    s = build_report(run, out)
    assert s.metrics_records == 0 and s.steps is None and s.tok_s_mean is None and s.duration_s is None
    assert (
        NO_METRICS in s.lines
        and "watch samples: none (GPU readings are kept while `dflashctl watch RUN` runs)" in s.lines
    )
    assert "stop: none recorded (still running, or ended without a stop event)" in s.lines
    assert png_size(out) == (1600, 1300)
    data = load_run(run)
    texts = {
        title: [t.get_text() for t in ax.texts]
        for title, ax in panels(make_figure(data, summarize(data, out))).items()
    }
    assert texts["loss"] == [NO_METRICS_PANEL] and texts["q_hs: hidden-state batches ready"] == [
        NO_METRICS_PANEL
    ]
    assert texts["GPU utilization (%)"] == [NO_SAMPLES] and texts["GPU memory used (GiB)"] == [NO_SAMPLES]


def test_single_process_run_says_why_queues_are_empty(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "single"}))
    append_jsonl(run / "metrics.jsonl", *({"t": T0 + i, "step": i, "loss": 5.0} for i in range(5)))
    data = load_run(run)
    fig = make_figure(data, summarize(data, tmp_path / "x.png"))
    texts = [t.get_text() for t in panels(fig)["q_pre: data batches waiting per target"].texts]
    assert texts == ["no q_pre in metrics.jsonl (a single-process run)"]
    assert [t.get_text() for t in panels(fig)["tokens/s (thousands)"].texts] == ["no tok_s in metrics.jsonl"]


def test_a_failed_write_keeps_the_old_report_and_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = make_run(tmp_path / "run", samples=5)
    out = run / "report.png"
    out.write_bytes(b"old report")

    def broken(self: Any, *a: Any, **kw: Any) -> None:
        a[0].write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(RunnerError, match="No space left on device"):
        build_report(run, out)
    assert out.read_bytes() == b"old report"
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []
    monkeypatch.undo()
    build_report(run, out)
    assert png_size(out) == (1600, 1300)


def test_without_matplotlib_it_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import fails
    with pytest.raises(RunnerError, match="needs matplotlib: pip install"):
        build_report(make_run(tmp_path / "run", samples=1), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(RunnerError, match="is not a directory"):
        build_report(tmp_path / "nope", tmp_path / "x.png")


def test_long_series_are_thinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report_mod, "MAX_POINTS", 100)
    run = make_run(tmp_path / "run", samples=600, gpus=1)
    data = load_run(run)
    fig = make_figure(data, summarize(data, tmp_path / "x.png"))
    (line,) = [ln for ln in panels(fig)["GPU utilization (%)"].get_lines() if ln.get_gid() is None]
    assert len(line.get_xdata()) == 100


# ---- the verb --------------------------------------------------------------------------------------


def invoke(*args: str) -> Any:
    r = CliRunner().invoke(app, ["report", *args], env={"COLUMNS": "300"})
    return r


def test_cli_on_a_run_directory(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", samples=30)
    r = invoke(str(run))
    assert r.exit_code == 0, r.output
    assert f"run {RUN_ID} ({run})" in r.output and f"png: {run / 'report.png'}" in r.output
    assert png_size(run / "report.png") == (1600, 1300)
    r = invoke(str(run), "--json", "--out", str(tmp_path / "elsewhere.png"))
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["png"] == str(tmp_path / "elsewhere.png") and d["restarts"] == 2 and d["watch_samples"] == 30
    assert (tmp_path / "elsewhere.png").is_file()


def save_record(state: Path, run_id: str, host: str | None, run_dir: Path) -> None:
    Registry(state).save(
        RunRecord(
            run_id=run_id,
            name="field",
            backend="tmux",
            created_at=T0,
            config="configs/demo-cpu.toml",
            hosts=[HostRecord(node_rank=0, host=host, run_dir=str(run_dir))],
        )
    )


def test_cli_by_run_id_on_this_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_STATE_DIR", str(tmp_path / "state"))
    run = make_run(tmp_path / "runs" / RUN_ID, samples=10)
    save_record(tmp_path / "state", RUN_ID, None, run)
    r = invoke("field")  # by name
    assert r.exit_code == 0, r.output
    assert f"png: {run / 'report.png'}" in r.output and (run / "report.png").is_file()
    r = invoke("no-such-run")
    assert r.exit_code == 1 and "no run 'no-such-run'" in r.output
    r = invoke("field", "--node", "3")
    assert r.exit_code == 1 and "has no node 3" in r.output
    (tmp_path / "plain").mkdir()
    r = invoke(str(tmp_path / "plain"))
    assert r.exit_code == 1 and "has no run.json: not a run directory" in r.output


@pytest.mark.ssh
def test_cli_on_a_remote_host_copies_only_what_it_reads(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sshd_server: Any,
) -> None:
    monkeypatch.setenv("DFLASH_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DFLASH_SSH_OPTS", sshd_server.opts)
    run = make_run(tmp_path / "host" / RUN_ID, samples=40)
    (run / "checkpoints" / "step-10").mkdir(parents=True)
    (run / "checkpoints" / "step-10" / "model.safetensors").write_bytes(b"x" * 1000)
    save_record(tmp_path / "state", RUN_ID, sshd_server.host, run)
    here = tmp_path / "laptop"
    here.mkdir()
    monkeypatch.chdir(here)
    r = invoke(RUN_ID, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["run_dir"] == f"{sshd_server.host}:{run}"
    assert d["png"] == str(here / f"{RUN_ID}-report.png") and png_size(here / f"{RUN_ID}-report.png")
    assert (d["metrics_records"], d["watch_samples"], d["restarts"]) == (60, 40, 2)
    assert not (run / "report.png").exists(), "a remote run's report lands here, not on the host"
    assert sorted(os.listdir(here)) == [f"{RUN_ID}-report.png"]

    # a run whose watch never ran and whose job wrote no events yet: those files are just absent
    (run / "watch" / "samples.jsonl").unlink()
    (run / "events.jsonl").unlink()
    r = invoke(RUN_ID)
    assert r.exit_code == 0, r.output
    assert f"run {RUN_ID} ({sshd_server.host}:{run})" in r.output and "watch samples: none" in r.output

    save_record(tmp_path / "state", "gone-1", sshd_server.host, tmp_path / "host" / "gone-1")
    r = invoke("gone-1")
    assert r.exit_code == 1 and "does not exist" in r.output


def _start(
    t: float, role: str, worker: str, generation: int, phases: list[tuple[str, float]]
) -> dict[str, Any]:
    at = origin = t - sum(s for _, s in phases)
    out = []
    for name, s in phases:
        out.append({"phase": name, "start": at, "seconds": s})
        at += s
    return {
        "t": t,
        "event": "generation_start",
        "role": role,
        "worker": worker,
        "generation": generation,
        "restart": generation > 0,
        "origin": "death" if generation else "launch",
        "origin_at": origin,
        "ready_at": at,
        "total_s": round(at - origin, 3),
        "phases": out,
        "resumed_from": 8 if generation else None,
        "resumed_from_kind": "checkpoint" if generation else None,
        "died_at_step": 11 if generation else None,
        "rolled_back_steps": 3 if generation else None,
        "graphs": {"8x256": 1.5},
    }


def test_each_start_is_a_row_of_phase_bars_in_the_figure_the_text_and_json(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", samples=30)
    first = [("launcher_start", 1.0), ("process_start", 0.01), ("imports", 3.0), ("first_step", 2.0)]
    again = [
        ("death_detection", 0.5),
        ("respawn", 0.25),
        ("imports", 2.75),
        ("model_build", 4.0),
        ("first_step", 1.5),
    ]
    target = [("process_start", 0.0), ("imports", 3.5), ("model_load", 0.5)]
    with open(run / "events.jsonl", "a") as f:
        f.write("\n")  # after make_run's torn last line: the job's next record starts a line of its own
    append_jsonl(
        run / "events.jsonl",
        _start(T0 + 8, "target", "target-0", 0, target),
        _start(T0 + 9, "drafter-group", "drafter-0", 0, first),
        _start(T0 + 215, "drafter-group", "drafter-0", 1, again),
    )
    data = load_run(run)
    summary = summarize(data, tmp_path / "x.png")
    ax = panels(make_figure(data, summary))[report_mod.STARTS_TITLE]
    bars = [b for b in ax.patches if (b.get_gid() or "").startswith("phase:")]
    rows: dict[int, list[tuple[str, float, float]]] = {}
    for b in bars:
        rows.setdefault(round(b.get_y() + b.get_height() / 2), []).append(
            (b.get_gid().removeprefix("phase:"), round(b.get_x(), 3), round(b.get_width(), 3))
        )
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "target-0 start (gen 0)",
        "drafters start (gen 0)",
        "drafters restart (gen 1)",
    ]
    offsets = [0.0, 0.5, 0.75, 3.5, 7.5]
    assert rows[2] == [(n, o, s) for (n, s), o in zip(again, offsets, strict=True)], "a bar per phase"
    assert [r[0] for r in rows[1]] == [n for n, _ in first] and len(rows[0]) == len(target)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:4] == ["process_start", "imports", "model_load", "launcher_start"], "one color per phase"
    assert (
        "  drafters restart (gen 1) at 3 min 35 s: 9.0 s from death to first step, 3 steps rolled back "
        "(from checkpoint); slowest: model_build 4.0 s, imports 2.8 s, first_step 1.5 s" in summary.lines
    ), summary.lines
    d = summary.to_dict()["starts"]
    assert [s["label"] for s in d] == [
        "target-0 start (gen 0)",
        "drafters start (gen 0)",
        "drafters restart (gen 1)",
    ]
    assert d[2]["slowest_phase"] == "model_build" and d[2]["total_s"] == 9.0
    assert [p["phase"] for p in d[2]["phases"]] == [n for n, _ in again]
    r = invoke(str(run), "--json", "--out", str(tmp_path / "r.png"))
    assert r.exit_code == 0 and json.loads(r.output)["starts"] == d


def test_tau_is_drawn_beside_acc_and_summarized(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    with open(run / "events.jsonl", "a") as f:
        f.write(
            "\n"
        )  # make_run leaves a torn last line (a job killed mid-write); the job's next event starts anew
    for step, tau in ((200, 1.3), (400, 1.6), (600, 1.9)):
        append_jsonl(
            run / "events.jsonl", {"t": T0 + step, "event": "tau", "step": step, "tau": tau, "acc": 0.3}
        )
    data = load_run(run)
    s = summarize(data, tmp_path / "x.png")
    assert [t["tau"] for t in s.taus] == [1.3, 1.6, 1.9]
    assert any(line.startswith("tau 1.90 tokens per target verification at step 600 (first 1.30 at step 200)")
               for line in s.lines), s.lines  # fmt: skip
    # The newest tau beside the final acc and streak: what the demo ends by printing.
    (final,) = [line for line in s.lines if line.startswith("final loss")]
    assert final.endswith(", tau 1.90 on held-out prompts (step 600)") and ", streak " in final
    fig = make_figure(data, s)
    p = panels(fig)
    ax = p["accuracy (top-1, green) and tau (purple, right axis)"]
    twins = [a for a in fig.axes if a is not ax and a.bbox.bounds == ax.bbox.bounds]
    (line,) = [ln for a in twins for ln in a.get_lines() if ln.get_gid() == "tau"]
    assert list(line.get_ydata()) == [1.3, 1.6, 1.9]
