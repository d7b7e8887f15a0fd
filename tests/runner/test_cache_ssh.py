"""push / pull over a real sshd on loopback (its own host key, config and authorized key)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cache_helpers import make_artifact
from typer.testing import CliRunner

from runner.cache.store import Store
from runner.cli import app

pytestmark = pytest.mark.ssh


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("sshd")
    os.chmod(d, 0o700)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "client_key")], check=True)
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    os.chmod(d / "authorized_keys", 0o600)
    port = _free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nPidFile {d / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\nPasswordAuthentication no\n"
        "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\nSubsystem sftp internal-sftp\n"
    )
    os.makedirs("/run/sshd", exist_ok=True)  # privilege-separation dir sshd insists on
    with open(d / "sshd.log", "wb") as log:
        proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(d / "sshd_config")], stderr=log)
    opts = f"-p {port} -i {d / 'client_key'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
    old = os.environ.get("DFLASH_SSH_OPTS")
    os.environ["DFLASH_SSH_OPTS"] = opts
    user = os.environ.get("USER") or "root"
    host = f"{user}@127.0.0.1"
    deadline = time.monotonic() + 60  # a loaded CI machine can take a while to start sshd
    while True:
        ok = subprocess.run(
            ["ssh", "-o", "BatchMode=yes", *opts.split(), host, "true"], capture_output=True, timeout=30
        )
        if ok.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if ok.returncode != 0:
        proc.kill()
        pytest.fail("sshd did not accept the test key: " + (d / "sshd.log").read_text()[-2000:])
    yield host
    proc.terminate()
    proc.wait(timeout=10)
    if old is None:
        os.environ.pop("DFLASH_SSH_OPTS", None)
    else:
        os.environ["DFLASH_SSH_OPTS"] = old


def test_push_then_pull_marks_remote_origin(sshd: str, tmp_path: Path) -> None:
    runner = CliRunner()
    local = Store(tmp_path / "local").ensure()
    art = make_artifact(local, tmp_path, tag="p")
    remote_dir = tmp_path / "remote store"  # a space: quoting must hold over ssh
    res = runner.invoke(
        app, ["cache", "push", art.key[:12], "--remote", f"{sshd}:{remote_dir}", "--store", str(local.root)]
    )
    assert res.exit_code == 0, res.output
    assert (remote_dir / art.key / "cache.tar.zst").read_bytes() == art.archive.read_bytes()
    assert [p.name for p in remote_dir.iterdir()] == [art.key], "no temp dirs left on the remote"
    # Push again (replace in place) still leaves exactly one artifact.
    assert (
        runner.invoke(
            app, ["cache", "push", art.key, "--remote", f"{sshd}:{remote_dir}", "--store", str(local.root)]
        ).exit_code
        == 0
    )
    other = Store(tmp_path / "other")
    res = runner.invoke(
        app, ["cache", "pull", art.key[:8], "--remote", f"{sshd}:{remote_dir}", "--store", str(other.root)]
    )
    assert res.exit_code == 0, res.output
    assert "--trust" in res.output, "an unsigned pulled artifact announces that restore needs --trust"
    pulled = other.root / art.key
    assert json.loads((pulled / "origin.json").read_text())["origin"] == "remote"
    res = runner.invoke(app, ["cache", "list", "--json", "--store", str(other.root)])
    assert json.loads(res.output)["artifacts"][0]["origin"] == "remote"
    # Restore of the unsigned remote artifact is refused without --trust (before any probe result matters).
    res = runner.invoke(
        app,
        [
            "cache",
            "restore",
            art.key,
            "--dest",
            str(tmp_path / "dest"),
            "--force",
            "--python",
            "/nonexistent/python",
            "--store",
            str(other.root),
        ],
    )
    assert res.exit_code == 1 and "--trust" in res.output, res.output
    assert not (tmp_path / "dest").exists()
    res = runner.invoke(
        app,
        [
            "cache",
            "restore",
            art.key,
            "--dest",
            str(tmp_path / "dest"),
            "--force",
            "--trust",
            "--python",
            "/nonexistent/python",
            "--store",
            str(other.root),
        ],
    )
    assert res.exit_code == 0, res.output
    assert (tmp_path / "dest" / "inductor" / "g4" / "cg4f.main.so").is_file()


def test_pull_detects_corruption_in_transit(sshd: str, tmp_path: Path) -> None:
    local = Store(tmp_path / "local").ensure()
    art = make_artifact(local, tmp_path, tag="c")
    remote_dir = tmp_path / "remote"
    runner = CliRunner()
    assert (
        runner.invoke(
            app, ["cache", "push", art.key, "--remote", f"{sshd}:{remote_dir}", "--store", str(local.root)]
        ).exit_code
        == 0
    )
    archive = remote_dir / art.key / "cache.tar.zst"
    raw = bytearray(archive.read_bytes())
    raw[5] ^= 0xFF
    archive.write_bytes(bytes(raw))
    res = runner.invoke(
        app,
        ["cache", "pull", art.key, "--remote", f"{sshd}:{remote_dir}", "--store", str(tmp_path / "other")],
    )
    assert res.exit_code == 1 and "does not match" in res.output, res.output
    assert not (tmp_path / "other" / art.key).exists()
