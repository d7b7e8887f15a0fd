"""The docker CLI, locally or on a host over ssh: inspect images, stream a build, run a probe.

Builds use the classic builder (DOCKER_BUILDKIT=0) and read their context as a tar on stdin, so the
same command works on this machine and through ssh, and only the files the plan lists are sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from runner.errors import RunnerError
from runner.exec import remote
from runner.exec.stream import stream as run_streamed


def ensure_engine(host: str | None) -> None:
    """The docker CLI is installed on host and its engine answers; else a RunnerError saying which."""
    where = host or "this machine"
    if remote.run(host, ["sh", "-c", "command -v docker"], check=False, timeout=60).returncode != 0:
        raise RunnerError(
            f"the docker CLI is not installed on {where} (no `docker` on its PATH): install Docker "
            "(apt-get install docker.io), or go without containers: `dflashctl build --venv PATH`, "
            "`dflashctl run --backend tmux`"
        )
    proc = remote.run(host, ["docker", "info", "--format", "{{.ServerVersion}}"], check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or b"").decode(errors="replace").strip()[-400:]
        raise RunnerError(
            f"no Docker engine reachable on {where} ({tail}); start dockerd, "
            "or build a venv instead with `dflashctl build --venv PATH`"
        )


def image_exists(host: str | None, ref: str) -> bool:
    return (
        remote.run(host, ["docker", "image", "inspect", "--format", "{{.Id}}", ref], check=False).returncode
        == 0
    )


def image_labels(host: str | None, ref: str) -> dict[str, str]:
    proc = remote.run(host, ["docker", "image", "inspect", "--format", "{{json .Config.Labels}}", ref])
    return json.loads(proc.stdout.decode() or "null") or {}


def image_id(host: str | None, ref: str) -> str:
    return (
        remote.run(host, ["docker", "image", "inspect", "--format", "{{.Id}}", ref]).stdout.decode().strip()
    )


def stream(
    host: str | None, argv: Sequence[str], *, stdin_path: Path | None, on_line: Callable[[str], None]
) -> None:
    """Run argv (on host), feeding stdin_path, handing each output line to on_line as it arrives."""
    run_streamed(
        remote.remote_argv(host, argv),
        on_line=on_line,
        stdin_path=stdin_path,
        what=f"`{' '.join(argv[:4])} ...` on {host or 'this machine'}",
    )


def host_has_nvidia(host: str | None) -> bool:
    return remote.run(host, ["sh", "-c", "command -v nvidia-smi"], check=False).returncode == 0


def run_python_source(
    host: str | None,
    image: str,
    source: str,
    *,
    timeout: float = 300,
    warn: Callable[[str], None] | None = None,
) -> bytes:
    """stdout of `python -` fed `source`, inside a fresh container of image (no network). On a host
    with an NVIDIA driver the container gets the GPUs, so what it reports (CUDA, driver, GPU names)
    is what a job in it would see."""
    base = ["docker", "run", "--rm", "-i", "--network", "none"]
    tail = [image, "python3", "-"]
    if host_has_nvidia(host):
        try:
            return remote.run(
                host, [*base, "--gpus", "all", *tail], input=source.encode(), timeout=timeout
            ).stdout
        except RunnerError as e:
            if "could not select device driver" not in str(e):
                raise
            # A driver but no NVIDIA container toolkit: docker cannot pass GPUs at all. Say so, and
            # report what a container does see.
            if warn is not None:
                warn(
                    f"{host or 'this machine'} has an NVIDIA driver but docker cannot give containers "
                    "GPUs (install the NVIDIA container toolkit); probing without GPUs"
                )
    return remote.run(host, [*base, *tail], input=source.encode(), timeout=timeout).stdout
