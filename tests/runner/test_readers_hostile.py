"""The runner's readers under damage (runner.rundir.schema): random and hostile JSON in every file a
verb reads (run.json, metrics.jsonl, events.jsonl, heartbeats, watch samples, registry entries,
baselines) raises nothing; a damaged record is skipped and counted, a damaged file is one line naming
it; one damaged registry entry never hides the others, in ps and logs through the real CLI."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from run_cli import Cli

from runner.launch.registry import Registry
from runner.rundir import RunLocation, read_run
from runner.rundir import schema as sc
from runner.watch.baseline import list_baselines
from runner.watch.report import load_run, summarize
from runner.watch.sampler import SamplerState, dumps, read_heartbeats, sample_once
from runner.watch.snapshot import History
from runner.watch.watcher import Watcher

DEEP = "[" * 100_000 + "]" * 100_000
HOSTILE_TEXTS: dict[str, str | bytes] = {
    "a list": "[]",
    "a string": '"x"',
    "a number": "5",
    "null": "null",
    "nesting 100,000 deep": DEEP,
    "a 5,000-digit integer": "1" * 5000,
    "a 4,000-digit integer": "9" * 4000,
    "truncated": '{"t": 1, "event": "stopped", "reas',
    "not UTF-8": b"\xff\xfe{\x80}",
    "an infinite number": '{"t": 1e999, "event": "x"}',
    "NaN": '{"t": NaN, "event": "x"}',
    "empty": "",
    "NUL bytes": '{"t": 1,\x00 "event": "x"}',
}


def _hostile_value(rng: random.Random, depth: int = 0) -> Any:
    makers = [
        lambda: None,
        lambda: True,
        lambda: rng.randint(-(2**70), 2**70),
        lambda: rng.randint(-5, 5),
        lambda: rng.random() * 10 ** rng.randint(-5, 300),
        lambda: "",
        lambda: "x" * rng.randint(1, 40),
        lambda: "cuda:" + str(rng.randint(-3, 99)),
        lambda: [_hostile_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
        lambda: {str(rng.randint(0, 9)): _hostile_value(rng, depth + 1) for _ in range(rng.randint(0, 3))},
        lambda: {"phase": _hostile_value(rng, 9), "start": _hostile_value(rng, 9)},
        lambda: [[[{}]]],
    ]
    return makers[rng.randrange(12 if depth < 3 else 8)]()


def _hostile_record(rng: random.Random, fields: list[str], valid: dict[str, Any]) -> dict[str, Any]:
    """A valid record with some of its fields (or the schema's others) replaced by hostile values."""
    rec = dict(valid)
    for name in rng.sample(fields, k=rng.randint(1, min(4, len(fields)))):
        rec[name] = _hostile_value(rng)
    return rec


def _hostile_text(rng: random.Random, fields: list[str], valid: dict[str, Any]) -> str | bytes:
    roll = rng.random()
    if roll < 0.2:
        return rng.choice(list(HOSTILE_TEXTS.values()))
    if roll < 0.3:
        text = json.dumps(valid)
        return text[: rng.randrange(len(text))]
    return json.dumps(_hostile_record(rng, fields, valid))


def _valid(t: float, run_dir: Path) -> dict[str, dict[str, Any]]:
    return {
        "run.json": {
            "format": 1, "run_id": "r1", "config": {"train": {"total_steps": 100}}, "started_at": t - 100,
            "hosts": ["h"], "command_lines": [{"t": t - 100, "host": "h", "argv": ["python"]}],
        },
        "metrics.jsonl": {
            "t": t - 5, "elapsed_s": 50, "step": 10, "loss": 1.0, "acc": 0.5, "acc_per_pos": [0.5, None],
            "streak": 1.2, "tok_s": 100.0, "q_pre": [1], "q_hs": [1], "eta_s": 100, "compile": {"graphs": 1},
            "queue": {"produced": 3}, "world_size": 1, "generation": 0,
        },
        "events.jsonl": {
            "t": t - 90, "event": "generation_start", "role": "drafter-group", "generation": 0, "total_s": 3.0,
            "phases": [{"phase": "imports", "start": t - 93, "seconds": 3.0}], "tau": 1.5, "step": 5,
            "histogram": {"1": 3}, "severity": "warning", "kind": "x", "subject": "pipeline", "reason": "completed",
        },
        "workers/drafter-0.json": {
            "pid": 999_999, "host": "h", "role": "drafter", "index": 0, "rank": 0, "device": "cuda:0",
            "state": "computing", "step": 10, "last_progress_at": t - 10, "updated_at": t - 1, "started_at": t - 100,
        },
        "watch/samples.jsonl": {
            "t": t - 20, "host": "h", "gpus": [{"index": 0, "util_gpu": 50, "mem_used_mb": 1, "mem_total_mb": 2}],
            "workers": {"drafter-0": {"state": "computing", "step": 5, "alive": True, "gpu_index": 0}},
        },
        "registry": {
            "run_id": "r1", "name": "r1", "backend": "foreground", "created_at": t - 100, "config": "c.toml",
            "hosts": [{"node_rank": 0, "host": None, "run_dir": str(run_dir)}], "argv": {"0": ["python"]}, "plan": {},
        },
        "baseline": {"fingerprint_key": "a" * 64, "config_hash": "b" * 64, "tok_s": 10.0, "runs": [], "updated_at": t},
    }  # fmt: skip


SCHEMAS = {
    "run.json": sc.RUN_JSON,
    "metrics.jsonl": sc.METRICS,
    "events.jsonl": sc.EVENTS,
    "workers/drafter-0.json": sc.HEARTBEAT,
    "watch/samples.jsonl": sc.SAMPLE,
    "registry": sc.REGISTRY_ENTRY,
    "baseline": sc.BASELINE,
}


def _write(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)


def _layout(
    root: Path, damaged: str, text: str | bytes, valid: dict[str, dict[str, Any]]
) -> tuple[Path, Path]:
    run_dir, state = root / "runs" / "r1", root / "state"
    for name, rec in valid.items():
        data: str | bytes = json.dumps(rec)
        if name.endswith(".jsonl"):  # a good record on each side of the damaged line
            data = (
                data
                + "\n"
                + (text if name == damaged and isinstance(text, str) else data)
                + "\n"
                + data
                + "\n"
            )
            if name == damaged and isinstance(text, bytes):
                good = json.dumps(rec).encode()
                data = good + b"\n" + text + b"\n" + good + b"\n"
        elif name == damaged:
            data = text
        path = {
            "registry": state / "runs" / "r1.json",
            "baseline": root / "baselines" / ("a" * 64) / f"{'b' * 64}.json",
        }.get(name, run_dir / name)
        _write(path, data)
    good = dict(valid["registry"], run_id="r2", name="r2")
    _write(state / "runs" / "r2.json", json.dumps(good))
    return run_dir, state


def _read_everything(run_dir: Path, state: Path, root: Path) -> dict[str, Any]:
    """Every runner-side reader over the layout; each must return, never raise."""
    view = read_run(RunLocation(str(run_dir)))
    registry = Registry(state)
    runs = registry.all()
    data = load_run(run_dir)
    summary = summarize(data, root / "r.png")
    sampler = SamplerState(run_dir)
    hb_damage: list[str] = []
    read_heartbeats(run_dir / "workers", hb_damage)
    sample = sample_once(sampler)
    watcher = Watcher(None, history=History())
    watcher.feed(dumps(sample))
    snap, findings = watcher.refresh()
    list_baselines(root / "baselines")
    return {
        "view": view, "runs": runs, "registry": registry, "summary": summary, "sample": sample,
        "findings": findings, "snap": snap,
    }  # fmt: skip


def test_loads_names_each_hostile_class_in_words():
    for what, text in HOSTILE_TEXTS.items():
        if what in ("a list", "a string", "a number", "null"):
            assert (
                sc.problem(sc.HEARTBEAT, sc.loads(text))
                == f"{sc.describe(sc.loads(text))} where a heartbeat belongs"
            )
            continue
        with pytest.raises(sc.Damaged) as e:
            sc.loads(text)
        assert str(e.value) and "Traceback" not in str(e.value), what
    assert sc.problem(sc.EVENTS, {"event": "x", "phases": [{"phase": 1}]}) == (
        "`phases` is a list, not a list, each a phase"
    )
    assert sc.problem(sc.REGISTRY_ENTRY, {"run_id": "a"}) == "no `name`"
    assert sc.problem(sc.METRICS, {"t": 1, "step": True}) == "`step` is true, not an integer"
    # What the job writes passes: a real record of each kind is of its shape (the job's own tests
    # write them; these are the documented examples).
    assert sc.problem(sc.METRICS, {"t": 1.5, "step": 3, "acc_per_pos": [None, 0.5], "q_pre": [2]}) is None


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_random_and_hostile_json_in_each_file_never_raises(tmp_path, name):
    rng = random.Random(f"hostile-{name}")
    fields = list(SCHEMAS[name].fields) or ["x"]
    for i in range(40):
        root = tmp_path / str(i)
        valid = _valid(time.time(), root / "runs" / "r1")
        text = _hostile_text(rng, fields, valid[name])
        run_dir, state = _layout(root, name, text, valid)
        got = _read_everything(run_dir, state, root)
        # The good registry entry is listed whatever happened to the other.
        assert "r2" in [r.run_id for r in got["runs"]], (name, text)
        try:
            value = sc.loads(text)
            ok = sc.problem(SCHEMAS[name], value) is None
        except sc.Damaged:
            ok = False
        if name == "registry":
            listed = "r1" in [r.run_id for r in got["runs"]]
            assert listed == ok or (not listed and got["registry"].damaged), text
            assert ok or any("r1.json is damaged" in d for d in got["registry"].damaged), text
        elif name == "run.json" and not ok and text != "":
            assert any("run.json is damaged" in d for d in got["view"].damage), text
            assert any("run.json is damaged" in d for d in got["sample"]["damage"]), text
        elif name == "workers/drafter-0.json" and not ok:
            assert "drafter-0" not in got["view"].heartbeats
            assert any("drafter-0.json is damaged" in d for d in got["view"].damage), text
        elif name == "metrics.jsonl" and not ok and text != "":
            assert len(got["view"].metrics) == 2  # the good records on each side
            assert any("metrics.jsonl: 1 damaged record skipped" in d for d in got["view"].damage), text
            assert any("metrics.jsonl" in d for d in got["summary"].damage), text
        elif name == "events.jsonl" and not ok and text != "":
            assert any("events.jsonl: 1 damaged record skipped" in d for d in got["view"].damage), text
            assert any(f.kind == "damaged_files" for f in got["findings"]), text


def test_one_damaged_registry_entry_hides_no_other_run_in_ps_and_logs(tmp_path):
    cli = Cli(tmp_path)
    valid = _valid(time.time(), tmp_path / "runs" / "r1")
    _layout(tmp_path, "registry", "[" * 5000, valid)
    (tmp_path / "runs" / "r1" / "logs").mkdir()
    (tmp_path / "runs" / "r1" / "logs" / "supervisor.log").write_text("hello from r1\n")
    ps = cli("ps", "--all", check=False)
    assert ps.returncode == 0 and "Traceback" not in ps.stderr
    assert "r2" in ps.stdout
    assert "r1.json is damaged (nested deeper than 64 levels); remove that file" in " ".join(
        ps.stderr.split()
    )
    logs = cli("logs", "r2", check=False)  # r2's record names the same run directory
    assert logs.returncode == 0 and "hello from r1" in logs.stdout, logs.stderr
    missing = cli("logs", "r1", check=False)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert "1 damaged entries skipped" in " ".join(missing.stderr.split())
