"""Every class of bad input, through the real `dflashctl` (a subprocess, as users run it): one message
that says what to do, exit code 2 (runner/errors.py), never a traceback, nothing executed.

Host strings: a host such as `-oProxyCommand=...` must never reach ssh as an option, whether it comes
as --host or inside a `cache push|pull --remote USER@HOST:DIR` spec.
"""

from __future__ import annotations

import os
import stat
import tarfile
from pathlib import Path

import pytest
from cache_helpers import make_artifact, write_hostile
from run_cli import DEMO, Cli, refused

from runner.cache.manifest import MANIFEST_NAME
from runner.cache.store import Store

NO_PROBE = ["--force", "--python", "/nonexistent/python"]
"""restore without probing the destination environment (the checks under test come first)."""


@pytest.fixture()
def hostile_bin(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A `pwn` command on PATH that leaves a marker: a space-free ProxyCommand for ssh to run."""
    marker = tmp_path / "pwned"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pwn = bin_dir / "pwn"
    pwn.write_text(f"#!/bin/sh\ntouch {marker}\n")
    pwn.chmod(pwn.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, marker


def _hosts(marker: Path) -> list[str]:
    return [f"-oProxyCommand=touch {marker}", "-oProxyCommand=pwn", "root@gpu1 -oProxyCommand=pwn", "-l"]


def test_hostile_host_options(tmp_path: Path, hostile_bin: tuple[dict[str, str], Path]) -> None:
    env, marker = hostile_bin
    cli = Cli(tmp_path, **env)
    for host in _hosts(marker):
        for args in (
            ["doctor", "--host", host],
            ["build", "--variant", "cu130", "--host", host, "--dry-run"],
            ["warm-cache", DEMO, "--host", host],
            ["run", DEMO, "--host", host, "--runs-root", str(cli.runs), "--dry-run"],
            ["run", DEMO, "--host", "root@127.0.0.1", "--host", host, "--runs-root", str(cli.runs)],
        ):
            refused(cli, *args, want="is not USER@HOST[:PORT]")
    assert not marker.exists()


def test_hostile_remote_specs(tmp_path: Path, hostile_bin: tuple[dict[str, str], Path]) -> None:
    env, marker = hostile_bin
    cli = Cli(tmp_path, **env)
    art = make_artifact(Store(Path(cli.env["DFLASH_CACHE_STORE"])).ensure(), tmp_path, tag="r")
    for host in _hosts(marker):
        for verb in ("push", "pull"):
            spec = f"{host}:/srv/cache"
            refused(cli, "cache", verb, art.key, "--remote", spec, want="must look like USER@HOST:DIR")
    refused(cli, "cache", "push", art.key, "--remote", "root@gpu1:-rf", want="starts with '-'")
    refused(cli, "cache", "pull", art.key, "--remote", "gpu1", want="must look like USER@HOST:DIR")
    assert not marker.exists()


def test_archive_member_name_too_long(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    art = write_hostile(tmp_path / "art", [(tarfile.TarInfo("inductor/" + "n" * 300), b"x")])
    dest = tmp_path / "dest"
    for extra in ([], ["--trust"]):
        refused(cli, "cache", "restore", str(art), "--dest", str(dest), *NO_PROBE, *extra, want="too long")
    assert not dest.exists()


def test_directory_where_a_manifest_should_be(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    store = Store(Path(cli.env["DFLASH_CACHE_STORE"])).ensure()
    good = make_artifact(store, tmp_path, tag="g")
    bad = make_artifact(store, tmp_path, tag="b")
    (bad.path / MANIFEST_NAME).unlink()
    (bad.path / MANIFEST_NAME).mkdir()
    listed = cli("cache", "list")
    assert good.key[:16] in listed.stdout and "is a directory" in " ".join(listed.stderr.split())
    assert "Traceback" not in listed.stderr
    for args in (
        ["cache", "show", bad.key],
        ["cache", "verify", bad.key],
        ["cache", "restore", bad.key, "--dest", str(tmp_path / "dest"), *NO_PROBE],
        ["cache", "push", bad.key, "--remote", "root@gpu1:/srv/cache"],
    ):
        refused(cli, *args, want="is a directory, not a file")
    assert "removed 0 artifact(s)" in cli("cache", "prune").stdout


def test_run_directory_that_is_a_file(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    a_file = tmp_path / "runs-file"
    a_file.write_text("")
    for runs_root in (a_file, a_file / "below"):
        for extra in ([], ["--dry-run"], ["--backend", "foreground"]):
            refused(cli, "run", DEMO, "--runs-root", str(runs_root), *extra, want="is not a directory")
    refused(cli, "run", DEMO, "--set", f"run.runs_root={a_file}", want="is not a directory")
    assert a_file.read_text() == "" and cli.ps() == []


def test_run_directory_that_is_read_only(tmp_path: Path) -> None:
    """Paths no user can write, root included (CI runs as root, who writes through mode bits)."""
    cli = Cli(tmp_path)
    for runs_root in ("/sys/kernel/dflash-runs", "/proc/dflash-runs/deeper"):
        for extra in ([], ["--dry-run"]):
            refused(cli, "run", DEMO, "--runs-root", runs_root, *extra, want="is not writable by this user")
    if os.geteuid() != 0:  # mode bits stop everyone else
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        refused(cli, "run", DEMO, "--runs-root", str(ro / "runs"), want="is not writable by this user")
    refused(cli, "run", DEMO, "--runs-root", str(tmp_path / ("r" * 300)), want="longer than the 255")
    assert cli.ps() == []


def test_bad_arguments_and_config_files(tmp_path: Path) -> None:
    cli = Cli(tmp_path, XDG_CONFIG_HOME=str(tmp_path / "cfg"))
    (tmp_path / "cfg" / "dflashctl").mkdir(parents=True)
    refused(cli, "run", str(tmp_path / "nope.toml"), want="not found")
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[run\n")
    refused(cli, "run", str(bad_toml), "--runs-root", str(cli.runs), want="is not valid TOML")
    refused(cli, "cache", "show", "zz-not-hex", want="not an artifact key")
    refused(cli, "cache", "prune", "--older-than", "soon", want="not understood")
    refused(cli, "doctor", "--python", "x", "--image", "y", want="not both")
    art = make_artifact(Store(Path(cli.env["DFLASH_CACHE_STORE"])).ensure(), tmp_path, tag="c")
    (tmp_path / "cfg" / "dflashctl" / "config.toml").write_text("[cache]\nkeep_previous = -3\n")
    refused(
        cli,
        "cache",
        "restore",
        art.key,
        "--dest",
        str(tmp_path / "dest"),
        *NO_PROBE,
        want="keep_previous = -3",
    )
    assert not (tmp_path / "dest").exists()
    (tmp_path / "cfg" / "dflashctl" / "config.toml").write_text("[cache\n")
    refused(cli, "cache", "list", want="is not valid TOML")
    # Not bad input: a lookup that finds nothing is exit code 1.
    (tmp_path / "cfg" / "dflashctl" / "config.toml").write_text("")
    refused(cli, "cache", "show", "abcdef", want="no artifact", code=1)


BAD_CONFIGS: dict[str, tuple[bytes, str]] = {
    "not UTF-8": (b"\xff\xfe[run]\n", "is not UTF-8 text (byte 0xff at offset 0); save it as UTF-8"),
    "nested 100,000 deep": (b"a = " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "is nested too deeply"),
    "a 5,000-digit integer": (b"a = " + b"9" * 5000 + b"\n", "has an integer too long to read"),
    "a section that is a number": (b"run = 5\n", "[run] must be a table, got int"),
    "run.name a number": (b"[run]\nname = 7\n", "run.name must be a string, got int"),
    "run.runs_root a list": (b'[run]\nruns_root = ["x"]\n', "run.runs_root must be a string, got list"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_run_reads_a_damaged_config_as_the_job_does(tmp_path: Path, case: str) -> None:
    """`run` reads run.runs_root and run.name itself before the job's check: a config the job would
    refuse is one line from the runner too, exit 2, and nothing starts."""
    text, says = BAD_CONFIGS[case]
    config = tmp_path / "bad.toml"
    config.write_bytes(text)
    cli = Cli(tmp_path)
    for extra in ([], ["--dry-run"]):
        refused(cli, "run", str(config), "--backend", "foreground", *extra, want=says)
    assert not (tmp_path / "state").exists(), "nothing registered"
