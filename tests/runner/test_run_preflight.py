"""Refusals before anything starts: a clear error, and nothing left behind (no run dir, no registry
entry, no tmux session)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from run_cli import DEMO, Cli

PREPARED = (".tiny-target-", "..tiny-target-")
"""The demo's tiny target (and its build lock): the fingerprint builds it in the runs root the job
will use, as the job would; an input, not a run."""


def _nothing_left(cli: Cli, tmp_path: Path) -> None:
    left = (
        [p.name for p in cli.runs.iterdir() if not p.name.startswith(PREPARED)] if cli.runs.exists() else []
    )
    assert left == [], left
    assert cli.ps() == []
    tmux = (
        subprocess.run(["tmux", "ls"], capture_output=True, text=True).stdout if shutil.which("tmux") else ""
    )
    assert "dflash-bad" not in tmux


def test_bad_config_lists_every_error_by_key(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    sets = ["train.lr=-1", "run.status_interval_s=0", "pipeline.targets=0"]
    out = cli(
        "run",
        DEMO,
        "--runs-root",
        str(cli.runs),
        "--name",
        "bad",
        *[a for s in sets for a in ("--set", s)],
        check=False,
    )
    assert out.returncode == 2
    for key in ("train.lr", "run.status_interval_s", "pipeline.targets"):
        assert key in out.stderr, out.stderr
    _nothing_left(cli, tmp_path)


def test_missing_config_file(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    out = cli("run", str(tmp_path / "nope.toml"), "--runs-root", str(cli.runs), check=False)
    assert out.returncode == 2 and "not found" in out.stderr  # bad input


def test_missing_tmux_is_named(tmp_path: Path) -> None:
    # A PATH with every tool the launch uses except tmux.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in (
        "sh",
        "id",
        "cat",
        "test",
        "mkdir",
        "mv",
        "rm",
        "chmod",
        "stat",
        "tail",
        "ls",
        "kill",
        "dirname",
        "env",
        "mktemp",
        "git",
    ):
        path = shutil.which(tool)
        if path:
            os.symlink(path, bin_dir / tool)
    cli = Cli(tmp_path, PATH=str(bin_dir))
    out = cli("run", DEMO, "--runs-root", str(cli.runs), "--name", "bad", check=False)
    assert out.returncode == 1 and "tmux is not installed on this machine" in out.stderr, out.stderr
    _nothing_left(cli, tmp_path)


@pytest.mark.parametrize(
    "host,message,code",
    [
        ("root@127.0.0.1:1", "cannot log in to root@127.0.0.1:1", 1),
        ("-oProxyCommand=touch /tmp/dflash-pwned", "is not USER@HOST", 2),  # bad input
        ("root@no-such-host.invalid", "cannot log in", 1),
    ],
)
def test_unreachable_or_bad_hosts(tmp_path: Path, host: str, message: str, code: int) -> None:
    cli = Cli(
        tmp_path,
        DFLASH_SSH_OPTS="-o ConnectTimeout=5 -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null",
    )
    out = cli("run", DEMO, "--host", host, "--name", "bad", "--runs-root", str(cli.runs), check=False)
    assert out.returncode == code and message in out.stderr, out.stderr
    assert not Path("/tmp/dflash-pwned").exists()
    _nothing_left(cli, tmp_path)


def test_unreachable_docker_daemon(tmp_path: Path) -> None:
    if not shutil.which("docker"):
        pytest.skip("no docker CLI")
    cli = Cli(tmp_path, DOCKER_HOST=f"unix://{tmp_path}/no-docker.sock")
    out = cli(
        "run",
        DEMO,
        "--backend",
        "docker",
        "--image",
        "dflash:cu130",
        "--runs-root",
        str(cli.runs),
        check=False,
    )
    assert out.returncode == 1 and "no Docker engine reachable" in out.stderr, out.stderr
    _nothing_left(cli, tmp_path)


def test_image_needs_docker_backend(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    out = cli("run", DEMO, "--image", "x", "--runs-root", str(cli.runs), check=False)
    assert out.returncode == 2 and "--backend docker" in out.stderr


def test_dry_run_starts_nothing(tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    cli = Cli(tmp_path, HOME=str(tmp_path / "home"))  # its own compile caches: none restored yet
    out = cli("run", DEMO, "--runs-root", str(cli.runs), "--dry-run", "--json")
    import json

    plan = json.loads(out.stdout)
    assert plan["hosts"][0]["argv"][:3] == [sys.executable, "-m", "dflash.launch"]
    assert "no compile-cache artifact" in out.stderr
    _nothing_left(cli, tmp_path)


def _path_without(tmp_path: Path, missing: str) -> str:
    """A PATH holding every program of the current PATH except `missing`."""
    bin_dir = tmp_path / f"bin-without-{missing}"
    bin_dir.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        for p in Path(d).glob("*") if Path(d).is_dir() else []:
            if p.name != missing and not (bin_dir / p.name).exists() and os.access(p, os.X_OK):
                os.symlink(p, bin_dir / p.name)
    return str(bin_dir)


def test_missing_docker_cli_is_named(tmp_path: Path) -> None:
    cli = Cli(tmp_path, PATH=_path_without(tmp_path, "docker"))
    out = cli(
        "run", DEMO, "--backend", "docker", "--image", "dflash:cu130", "--name", "bad",
        "--runs-root", str(cli.runs), check=False,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "the docker CLI is not installed on this machine" in out.stderr, out.stderr
    _nothing_left(cli, tmp_path)


@pytest.mark.ssh
def test_ssh_login_refused_for_a_wrong_key(tmp_path: Path, sshd_server) -> None:  # type: ignore[no-untyped-def]
    """The test sshd accepts only its own client key: another key is a failed login, named."""
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    opts = sshd_server.opts.replace(sshd_server.key, str(other)) + " -o IdentitiesOnly=yes"
    cli = Cli(tmp_path, DFLASH_SSH_OPTS=opts, SSH_AUTH_SOCK="")
    out = cli(
        "run", DEMO, "--host", sshd_server.host, "--name", "bad", "--runs-root", str(cli.runs), check=False
    )
    assert out.returncode == 1, out.stderr
    assert f"cannot log in to {sshd_server.host} over ssh" in out.stderr, out.stderr
    assert "Permission denied" in out.stderr and "your key" in out.stderr, out.stderr
    _nothing_left(cli, tmp_path)


def test_the_demos_own_environment_asks_for_no_variant(tmp_path: Path) -> None:
    """The demo runs the job in dflashctl's own interpreter: no warning about a variant it cannot
    name. Another environment without a variant still gets the warning, with what to pass."""
    from runner.exec.jobenv import JobEnv
    from runner.launch.plan import Request
    from runner.launch.preflight import drift_check

    python = str(tmp_path / "venv" / "bin" / "python")  # no dflash-env.json beside it: no variant
    env = JobEnv(python=python)
    warnings: list[str] = []
    own = Request(config=DEMO, backend="foreground", python=python, own_env=True)
    assert drift_check(own, env, warnings.append) is None
    assert warnings == []
    other = Request(config=DEMO, backend="foreground", python=python)
    assert drift_check(other, env, warnings.append) is None
    assert len(warnings) == 1 and "no variant to check against (pass --variant" in warnings[0]
