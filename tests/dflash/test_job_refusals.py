"""The job's refusals reach the user as one `error: ...` line that says what to do, with exit code 2,
never a traceback: run directories that cannot be used (a file, under a file, not writable even by
root, a name too long), bad config values and a mostly bad data file, through the real entry points."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo-cpu.toml")
UNWRITABLE = Path("/sys/dflash-refusal-test")
"""sysfs refuses mkdir to root too (chmod does not stop root)."""


def _run(module: str, *args: str, runs: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, DEMO, "--set", f"run.runs_root={runs}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _refused(out: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The one error line (stderr for the job, stdout for dflash.check), checked for each needle."""
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    errors = [ln for ln in (out.stderr + out.stdout).splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, out.stdout + out.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def _run_dir_cases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """{case: (run dir, what the message must say)}"""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    return {
        "is a file": (a_file, f"{a_file} is a file, not a directory"),
        "under a file": (a_file / "run", f"{a_file} is a file, not a directory"),
        "not writable": (UNWRITABLE / "run", "is not writable by this user"),
        "name too long": (tmp_path / ("r" * 300), "longer than the 255 a name may have"),
    }


CASES = ["is a file", "under a file", "not writable", "name too long"]


def _skip_unless_unwritable(case: str) -> None:
    if case != "not writable":
        return
    try:
        os.makedirs(UNWRITABLE / "run")
    except OSError:
        return
    os.removedirs(UNWRITABLE / "run")
    pytest.skip(f"{UNWRITABLE} is writable here")


@pytest.mark.parametrize("module", ["dflash.train", "dflash.launch"])
@pytest.mark.parametrize("case", CASES)
def test_unusable_run_dir_is_refused_by_the_job(tmp_path, module, case):
    _skip_unless_unwritable(case)
    run_dir, says = _run_dir_cases(tmp_path)[case]
    out = _run(module, "--run-dir", str(run_dir), runs=tmp_path / "runs")
    _refused(out, says, "pass another --run-dir", "run directory")
    assert not (tmp_path / "runs").exists(), "refused before anything (tiny target, data) was made"


@pytest.mark.parametrize("case", CASES)
def test_unusable_run_dir_is_refused_by_the_check(tmp_path, case):
    _skip_unless_unwritable(case)
    run_dir, says = _run_dir_cases(tmp_path)[case]
    out = _run("dflash.check", "--run-dir", str(run_dir), runs=tmp_path / "runs")
    _refused(out, "--run-dir", says, "pass another --run-dir")
    assert not list(tmp_path.glob(".dflash-probe-*")), "the check's write probe leaves nothing"


def test_unusable_runs_root_and_cache_dir_are_named(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    out = _run("dflash.train", runs=a_file / "runs")
    _refused(out, f"{a_file} is a file, not a directory", "run.runs_root")
    out = _run(
        "dflash.train", "--run-dir", str(tmp_path / "r"), "--set", f"data.cache_dir={a_file}", runs=tmp_path
    )
    _refused(out, "responses dataset", f"{a_file} is a file", "set data.cache_dir")
    out = _run("dflash.train", "--run-dir", str(tmp_path / "r2"), "--set", f"data.cache_dir={a_file}",
               "--set", "data.responses=false", runs=tmp_path)  # fmt: skip
    _refused(out, "tokenized-data cache", f"{a_file} is a file", "set data.cache_dir")


@pytest.mark.parametrize("module", ["dflash.train", "dflash.launch", "dflash.check"])
def test_bad_config_values_are_refused_by_every_entry_point(tmp_path, module):
    out = _run(module, "--run-dir", str(tmp_path / "r"), "--set", "train.gamma=nan", runs=tmp_path)
    _refused(out, "train.gamma: must be a positive number (finite), got nan")
    assert not (tmp_path / "r").exists(), "refused before the run directory was created"


def test_a_mostly_bad_data_file_is_refused_by_the_job(tmp_path):
    data = tmp_path / "wrong.jsonl"
    data.write_text("a,b,c\n" * 9 + '{"text": "one good record, long enough to train on"}\n')
    out = _run("dflash.train", "--run-dir", str(tmp_path / "r"), "--set", f"data.path={data}", runs=tmp_path)
    _refused(out, str(data), "9 of its 10 records are bad", "data.max_bad_fraction")
    assert "9 of its 10 records are bad" in (tmp_path / "r" / "logs" / "data.log").read_text()


BAD_ENDPOINTS = {
    "-oProxyCommand=x:29500": "starts with '-'",
    "gpu0:99999": "port '99999' is not a number in 1..65535",
    "gpu0:0": "port '0' is not a number in 1..65535",
    "gpu0": "no :PORT",
    "gpu0:": "port '' is not",
    ":29500": "no HOST",
    "10.0.0.300:29500": "not an IPv4 address",
    "fd00::1:29500": "write an IPv6 address in brackets",
    "[fd00::zz]:29500": "is not an IPv6 address",
    "gpu0;touch x:29500": "is not a hostname",
}


@pytest.mark.parametrize("endpoint", list(BAD_ENDPOINTS))
def test_bad_rendezvous_endpoints_are_refused_by_the_check(tmp_path, endpoint):
    """From the config key and from --rdzv-endpoint at once: one error for each, naming its source."""
    sets = ["--set", f"pipeline.rdzv_endpoint={endpoint!r}", "--set", "train.keep_last=2"]
    out = _run("dflash.check", *sets, "--nnodes", "2", f"--rdzv-endpoint={endpoint}", runs=tmp_path / "r")
    assert "Traceback" not in out.stderr and out.returncode == 2, (out.stdout, out.stderr)
    errors = [ln for ln in out.stdout.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 2, out.stdout
    for line, named in zip(errors, ("--rdzv-endpoint", "pipeline.rdzv_endpoint"), strict=True):
        assert f"{named} {endpoint!r} is not HOST:PORT" in line, line
        assert BAD_ENDPOINTS[endpoint] in line and "e.g. 10.0.0.1:29400" in line, line


def test_bad_rendezvous_endpoint_is_refused_before_the_job_starts(tmp_path):
    out = _run(
        "dflash.launch",
        *("--run-dir", str(tmp_path / "r"), "--nnodes", "2", "--set", "train.keep_last=2"),
        "--rdzv-endpoint=-oProxyCommand=x:29500",
        runs=tmp_path,
    )
    _refused(out, "--rdzv-endpoint '-oProxyCommand=x:29500' is not HOST:PORT", "starts with '-'")
    assert not (tmp_path / "r").exists(), "refused before the run directory was created"
