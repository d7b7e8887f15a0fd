"""Running commands and copying files on a host: locally when host is None, else over OpenSSH.

A host is `[USER@]HOST[:PORT]` (IPv6 as `[addr]:port`), checked by parse_host before it reaches
ssh, and always placed after `--`, so no host string can be read as an ssh option. Extra ssh options
(identity, known-hosts file) come from DFLASH_SSH_OPTS, e.g.
`-i ~/.ssh/id_lab -o UserKnownHostsFile=~/.ssh/lab_known_hosts`; they apply to scp too.

Inside `connections()`, every host gets one ssh ControlMaster connection, opened on first use and
closed when the block ends: a launch makes tens of ssh calls per host, and each would otherwise log
in again (seconds each over a WAN, and a burst that some sshd MaxStartups settings refuse).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.errors import BadInput, RunnerError

# A host that stops answering must fail the command, not hang it: ssh otherwise waits for a dead TCP
# peer indefinitely. ssh keeps the first value given for an option, so these come after the user's.
_LIVENESS = ["-o", "ConnectTimeout=20", "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4"]


def ssh_opts() -> list[str]:
    return [*shlex.split(os.environ.get("DFLASH_SSH_OPTS", "")), *_LIVENESS]


_HOST_RE = re.compile(
    r"^(?:(?P<user>[A-Za-z0-9_][A-Za-z0-9_.-]*)@)?"
    r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9_][A-Za-z0-9_.-]*))"
    r"(?::(?P<port>[0-9]{1,5}))?$"
)


@dataclass(frozen=True, slots=True)
class Host:
    spec: str
    user: str | None
    hostname: str
    port: int | None

    @property
    def destination(self) -> str:
        return f"{self.user}@{self.hostname}" if self.user else self.hostname


def parse_host(spec: str) -> Host:
    """`[USER@]HOST[:PORT]`, refusing anything else (a leading `-`, spaces, shell characters)."""
    m = _HOST_RE.fullmatch(spec)
    port = int(m.group("port")) if m and m.group("port") else None
    if not m or (port is not None and not 0 < port < 65536):
        raise BadInput(
            f"host {spec!r} is not USER@HOST[:PORT] (letters, digits, '.', '_' and '-'; IPv6 as "
            "[addr]:port); give a host such as root@10.0.0.5 or gpu1:2222"
        )
    return Host(spec, m.group("user"), m.group("v6") or m.group("name"), port)


def _scp_opts() -> list[str]:
    # scp spells the port -P; every other option is shared with ssh.
    opts = ssh_opts()
    return ["-P" if o == "-p" else o for o in opts]


_control_dir: Path | None = None
_masters: dict[str, Path] = {}


@contextlib.contextmanager
def connections() -> Iterator[None]:
    """Reuse one ssh connection per host until the block ends; the masters are closed then."""
    global _control_dir
    if _control_dir is not None:  # nested: the outer block owns the masters
        yield
        return
    # Socket paths are limited to ~108 bytes: a short private dir, not under a long $TMPDIR.
    _control_dir = Path(
        tempfile.mkdtemp(prefix="dflashctl-ssh-", dir="/tmp" if os.path.isdir("/tmp") else None)
    )
    try:
        yield
    finally:
        for spec, sock in list(_masters.items()):
            h = parse_host(spec)
            subprocess.run(
                ["ssh", "-o", f"ControlPath={sock}", *_port(h), "-O", "exit", "--", h.destination],
                capture_output=True,
                timeout=30,
            )
        _masters.clear()
        shutil.rmtree(_control_dir, ignore_errors=True)
        _control_dir = None


def _port(h: Host, flag: str = "-p") -> list[str]:
    return [flag, str(h.port)] if h.port else []


def _master(h: Host) -> list[str]:
    """ssh options that route through this host's master, opening it on first use (inside
    connections() only). Opening it is also the login check: a refused key or an unknown host
    fails here with ssh's own message."""
    if _control_dir is None:
        return []
    sock = _masters.get(h.spec)
    if sock is None:
        sock = _control_dir / f"m{len(_masters)}"
        with tempfile.TemporaryFile() as err:
            proc = subprocess.run(
                [
                    "ssh", "-o", "BatchMode=yes", *ssh_opts(), *_port(h),
                    "-o", "ControlMaster=yes", "-o", f"ControlPath={sock}", "-o", "ControlPersist=yes",
                    "-N", "-f", "--", h.destination,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                timeout=120,
            )  # fmt: skip
            err.seek(0)
            message = err.read().decode(errors="replace").strip()
        if proc.returncode != 0:
            raise RunnerError(
                f"cannot log in to {h.spec} over ssh (exit code {proc.returncode}): {message[-400:]}\n"
                "Check the host name, that sshd runs there, your key (ssh-add -l) and DFLASH_SSH_OPTS"
            )
        _masters[h.spec] = sock
    return ["-o", f"ControlPath={sock}", "-o", "ControlMaster=no"]


def ssh_prefix(host: str, *, tty: bool = False) -> list[str]:
    """`ssh ... -- DEST`: append one shell command string to run it on host."""
    h = parse_host(host)
    return [
        "ssh",
        *(["-t"] if tty else ["-o", "BatchMode=yes"]),
        *ssh_opts(),
        *_port(h),
        *_master(h),
        "--",
        h.destination,
    ]


def remote_argv(host: str | None, argv: Sequence[str], *, tty: bool = False) -> list[str]:
    """The argv that runs `argv` on host (itself when host is None): quoted once, for the one shell
    sshd runs it in."""
    if host is None:
        return list(argv)
    return [*ssh_prefix(host, tty=tty), shlex.join(argv)]


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
        raise failure(host, argv, proc)
    return proc


def failure(host: str | None, argv: Sequence[str], proc: subprocess.CompletedProcess[bytes]) -> RunnerError:
    """What run(check=True) raises for a non-zero exit: the command, the exit code, stderr's tail."""
    where = host or "this machine"
    tail = (proc.stderr or b"").decode(errors="replace").strip().splitlines()[-15:]
    hint = ""
    if host is not None and proc.returncode == 255:
        hint = " (ssh could not connect: check the host, your key, and DFLASH_SSH_OPTS)"
    return RunnerError(
        f"`{shlex.join(argv)}` failed on {where} with exit code {proc.returncode}{hint}\n" + "\n".join(tail)
    )


def copy_to(host: str | None, local: str, remote: str) -> None:
    """Copy a local file or directory to host:remote (a plain copy when host is None)."""
    _copy(host, local, remote, upload=True)


def copy_from(host: str | None, remote: str, local: str) -> None:
    """Copy host:remote (a file or directory) to a local path (a plain copy when host is None)."""
    _copy(host, remote, local, upload=False)


def _copy(host: str | None, src: str, dst: str, *, upload: bool) -> None:
    if host is None:
        run(None, ["cp", "-a", src, dst])
        return
    h = parse_host(host)
    src, dst = (src, f"{_scp_dest(h)}:{dst}") if upload else (f"{_scp_dest(h)}:{src}", dst)
    opts = ["-q", "-r", "-o", "BatchMode=yes", *_scp_opts(), *_port(h, "-P"), *_master(h)]
    run(None, ["scp", *opts, "--", src, dst])


def _scp_dest(h: Host) -> str:
    return (
        f"{h.user}@[{h.hostname}]"
        if h.user and ":" in h.hostname
        else (f"[{h.hostname}]" if ":" in h.hostname else h.destination)
    )


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


def write_file(host: str | None, path: str, data: bytes) -> None:
    """Write a file on host atomically (temp file + rename in the same directory)."""
    script = 'mkdir -p "$(dirname "$1")" && cat > "$1.tmp.$$" && mv -f "$1.tmp.$$" "$1"'
    run(host, ["sh", "-c", script, "sh", path], input=data, timeout=120)
