"""A real OpenSSH server on loopback for the tests: its own port, host key, config and authorized
key. .ci/run (through ./dev test) starts one and exports DFLASH_TEST_SSHD=<port>:<client key>;
without it a test session starts its own."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Sshd:
    user: str
    port: int
    key: str

    @property
    def host(self) -> str:
        """USER@127.0.0.1:PORT, the form dflashctl --host takes."""
        return f"{self.user}@127.0.0.1:{self.port}"

    @property
    def opts(self) -> str:
        """DFLASH_SSH_OPTS without the port (the host string carries it)."""
        return f"-i {self.key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_login(sshd: Sshd, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout  # a loaded CI machine can take a while to start sshd
    while True:
        ok = subprocess.run(
            [
                "ssh",
                "-o",
                "BatchMode=yes",
                *sshd.opts.split(),
                "-p",
                str(sshd.port),
                f"{sshd.user}@127.0.0.1",
                "true",
            ],
            capture_output=True,
            timeout=30,
        )
        if ok.returncode == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def start_sshd(d: Path) -> tuple[Sshd, subprocess.Popen[bytes]]:
    os.chmod(d, 0o700)
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    os.chmod(d / "authorized_keys", 0o600)
    port = _free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nPidFile {d / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\nPasswordAuthentication no\n"
        "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\nSubsystem sftp internal-sftp\n"
        "MaxStartups 100\nMaxSessions 100\n"
    )
    os.makedirs("/run/sshd", exist_ok=True)  # privilege-separation dir sshd insists on
    with open(d / "sshd.log", "wb") as log:
        proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(d / "sshd_config")], stderr=log)
    return Sshd(os.environ.get("USER") or "root", port, str(d / "client_key")), proc


@pytest.fixture(scope="session")
def sshd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    given = os.environ.get("DFLASH_TEST_SSHD")
    if given:
        port, _, key = given.partition(":")
        server = Sshd(os.environ.get("USER") or "root", int(port), key)
        if not _wait_login(server, timeout=10):
            pytest.fail(f"the sshd .ci/run started (DFLASH_TEST_SSHD={given}) refuses the test key")
        yield server
        return
    server, proc = start_sshd(tmp_path_factory.mktemp("sshd"))
    if not _wait_login(server):
        proc.kill()
        pytest.fail("sshd did not accept the test key")
    yield server
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def sshd(sshd_server: Sshd, monkeypatch: pytest.MonkeyPatch) -> str:
    """USER@127.0.0.1 with DFLASH_SSH_OPTS carrying key and port (the cache transfer tests' form)."""
    monkeypatch.setenv("DFLASH_SSH_OPTS", f"-p {sshd_server.port} {sshd_server.opts}")
    return f"{sshd_server.user}@127.0.0.1"
