"""docker backend: `docker run -d` per host through the docker CLI (local or over ssh, the same
argv either way; the SDK would need the engine's socket forwarded to the launching machine).

Containers carry labels (run id, role, host, node) that find them again, run as the invoking user
so files in the run directory are theirs, get the GPUs when the host has them, a /dev/shm sized
from the hidden-state queue, the host network (the drafter group's rendezvous and NCCL), an init
process that reaps torchrun's children, and no restart policy: restarts belong to the job's drafter
group and to `dflashctl watch`. Containers are kept after they exit, so `docker logs` still answers.
"""

from __future__ import annotations

from runner.errors import RunnerError
from runner.exec import docker as docker_cli
from runner.exec import remote
from runner.launch.plan import HostPlan

DEFAULT_SHM = 1 << 30


def require(host: str | None, image: str) -> None:
    docker_cli.ensure_engine(host)
    if not docker_cli.image_exists(host, image):
        raise RunnerError(
            f"image {image} is not on {host or 'this machine'}: build it there "
            "(`dflashctl build --variant V`) or load it (docker load)"
        )


def run_argv(hp: HostPlan, image: str) -> list[str]:
    assert hp.container
    argv = [
        "docker", "run", "-d", "--init",
        "--name", hp.container,
        "--user", f"{hp.uid}:{hp.gid}",
        "--network", "host",
        "--shm-size", str(hp.shm_bytes or DEFAULT_SHM),
        "--workdir", hp.cwd if any(m.target == hp.cwd for m in hp.mounts) else hp.runs_root,
        "-e", "HOME=/tmp",
    ]  # fmt: skip
    if hp.gpus:
        argv += ["--gpus", "all"]
    for k, v in sorted(hp.labels.items()):
        argv += ["--label", f"{k}={v}"]
    for m in hp.mounts:
        argv += ["-v", m.arg()]
    for k, v in sorted(hp.env.items()):
        argv += ["-e", f"{k}={v}"]
    return [*argv, image, *hp.argv]


def start(hp: HostPlan, image: str) -> str:
    return remote.run(hp.host, run_argv(hp, image), timeout=120).stdout.decode().strip()


def state(host: str | None, container: str) -> str | None:
    """running | exited | created | ... , or None when the container is gone."""
    proc = remote.run(
        host, ["docker", "inspect", "--format", "{{.State.Status}}", container], check=False, timeout=60
    )
    return proc.stdout.decode().strip() if proc.returncode == 0 else None


def signal(host: str | None, container: str, sig: str) -> None:
    remote.run(host, ["docker", "kill", "--signal", sig, container], check=False, timeout=60)


def find_by_label(host: str | None, run_id: str) -> list[str]:
    proc = remote.run(
        host,
        ["docker", "ps", "-a", "--filter", f"label=io.dflash.run={run_id}", "--format", "{{.Names}}"],
        timeout=60,
    )
    return proc.stdout.decode().split()


def logs_argv(host: str | None, container: str, *, lines: int, follow: bool) -> list[str]:
    return remote.remote_argv(
        host, ["docker", "logs", "--tail", str(lines), *(["--follow"] if follow else []), container]
    )


def attach_argv(host: str | None, container: str) -> list[str]:
    # Output only, Ctrl-C detaches: a stray keystroke must not signal the job.
    return remote.remote_argv(
        host, ["docker", "attach", "--no-stdin", "--sig-proxy=false", container], tty=True
    )
