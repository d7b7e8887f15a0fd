"""Every config in configs/, through the verbs a user types: `dflashctl run CONFIG --dry-run --json`
and `dflashctl warm-cache CONFIG --dry-run --json` (the real CLI, a subprocess), with only the paths
a user must set: target.path unless it is the demo's `tiny`, data.path unless it is the built-in
`demo` corpus, each pointed at a small directory or file made here. The runs root is the test's own
(--runs-root; run.runs_root for warm-cache), so nothing is written under the checkout.

The outcome is decided from the config and the GPUs this machine has (as the job counts them): the
plan must build where the config's devices are here; where they are not, the refusal must be the
placement check's alone (exit 2, one message, every problem a device problem, each missing device
named, none that is here). Anything else (a name, path or config error) fails the test: a shipped
config whose plan cannot be built is a failure, never a skip.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from qwen3_sizes import QWEN3_8B
from run_cli import REPO, Cli, refused

from runner.envs import tomllib

CONFIGS = sorted((REPO / "configs").glob("*.toml"))
DEVICE_LISTS = ("pipeline.target_devices", "pipeline.drafter_devices")
RUN_ID = r"-\d{8}-\d{6}-[0-9a-f]{4}"


def test_configs_are_found() -> None:
    assert {c.stem for c in CONFIGS} >= {"demo-cpu", "qwen3-8b", "qwen3.6-27b-5t3d"}


@pytest.fixture(scope="module")
def gpus() -> int:
    """CUDA devices as the job sees them (its interpreter is this one)."""
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def _config(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text())


def _model_dir(tmp: Path, cli: Cli) -> Path:
    """A Hugging Face model directory for a config's own target: Qwen3-8B's config.json, with the
    demo's tiny Qwen3 tokenizer and weights file. dflash.check reads config.json and file names
    only, the fingerprint config.json and the tokenizer; no weights are loaded before a launch."""
    tiny = cli.runs / ".tiny-target-l8-h64-s0"
    model = tmp / "model"
    model.mkdir()
    for f in tiny.iterdir():
        if f.name not in ("config.json", "dflash_tiny.json"):  # the tokenizer's files and the weights
            shutil.copy(f, model / f.name)
    config = json.loads((tiny / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **QWEN3_8B}))
    return model


def _user_sets(config: dict[str, Any], tmp: Path, cli: Cli) -> list[str]:
    sets = []
    if config.get("target", {}).get("path", "tiny") != "tiny":
        sets.append(f"target.path={_model_dir(tmp, cli)}")
    if config.get("data", {}).get("path", "demo") != "demo":
        data = tmp / "train.jsonl"
        data.write_text(
            "".join(json.dumps({"text": f"record {i} of the shipped-config test"}) + "\n" for i in range(8))
        )
        sets.append(f"data.path={data}")
    return sets


def _args(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def _missing(config: dict[str, Any], gpus: int) -> dict[str, list[str]]:
    """Per config key, the devices the config names that this machine lacks (what the job's
    placement check must name): run.device = cuda without any GPU, each listed cuda:N with N >= gpus."""
    missing: dict[str, list[str]] = {}
    if config.get("run", {}).get("device") == "cuda" and gpus == 0:
        missing["run.device"] = ["cuda"]
    for key in DEVICE_LISTS:
        section, _, name = key.partition(".")
        listed = config.get(section, {}).get(name, [])
        gone = [d for d in listed if d.startswith("cuda") and int(d.partition(":")[2] or 0) >= gpus]
        if gone:
            missing[key] = gone
    return missing


def _problems(text: str) -> dict[str, str]:
    """The refusal's lines `  KEY: MESSAGE`, by key."""
    return dict(m.groups() for m in re.finditer(r"^  ([a-z_]+\.[a-z_]+): (.*)$", text, re.M))


def _assert_placement_refusal(text: str, missing: dict[str, list[str]]) -> None:
    problems = _problems(text)
    assert set(problems) == set(missing), f"not the placement check alone:\n{text}"
    if "run.device" in missing:
        assert "no CUDA device is visible" in problems["run.device"], text
    for key in DEVICE_LISTS:
        if key in missing:
            named = problems[key].split(": not on this host")[0].split(", ")
            assert named == missing[key], f"{key} names {named}, missing here: {missing[key]}\n{text}"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_run_dry_run_plans_or_names_the_missing_devices(tmp_path: Path, config: Path, gpus: int) -> None:
    cli = Cli(tmp_path)
    cli.seed_runs_root()  # the demo's tiny target: what target.path = "tiny" builds in the runs root
    data = _config(config)
    sets = _user_sets(data, tmp_path, cli)
    backend = "tmux" if shutil.which("tmux") else "foreground"  # tmux: what a user gets by default
    args = ["run", str(config.relative_to(REPO)), *_args(sets), "--runs-root", str(cli.runs)]
    args += ["--backend", backend, "--dry-run", "--json"]
    missing = _missing(data, gpus)
    if missing:
        _assert_placement_refusal(refused(cli, *args, want="the job refused the config"), missing)
    else:
        out = cli(*args)
        plan = json.loads(out.stdout)
        name = data["run"]["name"]
        run_id = plan["run_id"]
        assert plan["name"] == name and re.fullmatch(re.escape(name) + RUN_ID, run_id), plan
        assert plan["backend"] == backend and plan["config"] == str(config.relative_to(REPO))
        (hp,) = plan["hosts"]
        assert hp["run_dir"] == f"{cli.runs}/{run_id}"
        argv = hp["argv"]
        assert argv[1:4] == ["-m", "dflash.launch", f"{hp['run_dir']}/config.toml"], argv
        for s in [*sets, f"run.name={name}", f"run.runs_root={cli.runs}"]:
            assert argv[argv.index(s) - 1] == "--set", (s, argv)
        if backend == "tmux":
            assert hp["tmux_session"] == "dflash-" + run_id.replace(".", "_")
            assert re.fullmatch(r"[A-Za-z0-9_-]+", hp["tmux_session"]), hp["tmux_session"]
        assert not Path(hp["run_dir"]).exists(), "a dry run starts nothing"
    assert cli.ps() == [], "a dry run registers nothing"


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_warm_cache_up_to_its_first_check(tmp_path: Path, config: Path, gpus: int) -> None:
    """The warm run's first check is the job's config load (dflash.config.load_config, the device
    included); --dry-run runs it through the fingerprint, and a refused config is refused alike by
    the warm run itself, with the job's own line (not the interpreter's noise after it)."""
    cli = Cli(tmp_path)
    cli.seed_runs_root()
    data = _config(config)
    sets = [*_user_sets(data, tmp_path, cli), f"run.runs_root={cli.runs}"]
    args = ["warm-cache", str(config.relative_to(REPO)), *_args(sets)]
    if data.get("run", {}).get("device") == "cuda" and gpus == 0:
        for extra in (["--dry-run", "--json"], []):
            text = refused(cli, *args, *extra, want="refused the config")
            assert "run.device: is cuda but no CUDA device is visible" in text, text
            assert "leaked" not in text, "the job's refusal, not the interpreter's exit noise"
    else:
        plan = json.loads(cli(*args, "--dry-run", "--json").stdout)
        assert re.fullmatch(r"[0-9a-f]{64}", plan["key"]) and plan["in_store"] is False, plan
        assert plan["module_args"][:2] == ["dflash.warm", str(config.relative_to(REPO))]
        assert plan["sets"] == sets and plan["environment"] == sys.executable
    assert not any(Path(cli.env["DFLASH_CACHE_STORE"]).glob("[0-9a-f]*")), "nothing was compiled"
