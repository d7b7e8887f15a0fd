"""Running commands and copying files on a host: locally when host is None, else over OpenSSH.

Extra ssh options (port, identity, known-hosts file) come from DFLASH_SSH_OPTS, e.g.
`-p 2222 -i ~/.ssh/id_lab -o UserKnownHostsFile=~/.ssh/lab_known_hosts`; they apply to scp too.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections.abc import Sequence
from typing import Any

from runner.errors import RunnerError

# A host that stops answering must fail the command, not hang it: ssh otherwise waits for a dead TCP
# peer indefinitely. ssh keeps the first value given for an option, so these come after the user's.
_LIVENESS = ["-o", "ConnectTimeout=20", "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4"]


def ssh_opts() -> list[str]:
    return [*shlex.split(os.environ.get("DFLASH_SSH_OPTS", "")), *_LIVENESS]


def _scp_opts() -> list[str]:
    # scp spells the port -P; every other option is shared with ssh.
    opts = ssh_opts()
    return ["-P" if o == "-p" else o for o in opts]


def remote_argv(host: str | None, argv: Sequence[str]) -> list[str]:
    """The argv that runs `argv` on host (itself when host is None)."""
    if host is None:
        return list(argv)
    return ["ssh", "-o", "BatchMode=yes", *ssh_opts(), host, "--", shlex.join(argv)]


def run(
    host: str | None,
    argv: Sequence[str],
    *,
    input: bytes | None = None,
    check: bool = True,
    capture: bool = True,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """Run argv on host. With check, a non-zero exit raises RunnerError quoting stderr's tail."""
    full = remote_argv(host, argv)
    try:
        proc = subprocess.run(
            full,
            input=input,
            capture_output=capture,
            timeout=timeout,
        )
    except FileNotFoundError as e:
        raise RunnerError(f"cannot run {full[0]!r}: {e.strerror}; is it installed and on PATH?") from e
    except subprocess.TimeoutExpired as e:
        raise RunnerError(
            f"{shlex.join(argv)} on {host or 'this machine'} did not finish within {timeout} s"
        ) from e
    if check and proc.returncode != 0:
        where = host or "this machine"
        tail = (proc.stderr or b"").decode(errors="replace").strip().splitlines()[-15:]
        hint = ""
        if host is not None and proc.returncode == 255:
            hint = " (ssh could not connect: check the host, your key, and DFLASH_SSH_OPTS)"
        raise RunnerError(
            f"`{shlex.join(argv)}` failed on {where} with exit code {proc.returncode}{hint}\n"
            + "\n".join(tail)
        )
    return proc


def copy_to(host: str | None, local: str, remote: str) -> None:
    """Copy a local file or directory to host:remote (a plain copy when host is None)."""
    argv = (
        ["cp", "-a", local, remote]
        if host is None
        else ["scp", "-q", "-r", "-o", "BatchMode=yes", *_scp_opts(), local, f"{host}:{remote}"]
    )
    run(None, argv)


def copy_from(host: str | None, remote: str, local: str) -> None:
    argv = (
        ["cp", "-a", remote, local]
        if host is None
        else ["scp", "-q", "-r", "-o", "BatchMode=yes", *_scp_opts(), f"{host}:{remote}", local]
    )
    run(None, argv)


def parse_json_tail(stdout: bytes, what: str, hint: str) -> dict[str, Any]:
    """The last stdout line that is a JSON object (libraries may print before it)."""
    for line in reversed(stdout.decode(errors="replace").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    raise RunnerError(f"{what} printed no JSON result; {hint}")
