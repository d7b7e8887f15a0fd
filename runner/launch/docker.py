"""docker backend: `docker run -d` per host through the docker CLI (local or over ssh, the same
argv either way; the SDK would need the engine's socket forwarded to the launching machine).

Containers carry labels (run id, role, host, node) that find them again, run as the invoking user
so files in the run directory are theirs, get the GPUs when the host has them, a /dev/shm sized
from the hidden-state queue, the host network (the drafter group's rendezvous and NCCL), an init
process that reaps torchrun's children, and no restart policy: restarts belong to the job's drafter
group and to `dflashctl watch`. Containers are kept after they exit, so `docker logs` still answers.
"""

from __future__ import annotations

from typing import Any

from runner.errors import RunnerError
from runner.exec import docker as docker_cli
from runner.exec import remote
from runner.launch.backend import Backend
from runner.launch.plan import HostFacts, HostPlan, Mount
from runner.launch.registry import backend_name

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


def mounts(hp: HostPlan, cfg: dict[str, Any], f: HostFacts) -> list[Mount]:
    """Paths keep their names inside the container, so run.json, logs and the job agree on them."""
    found = [
        Mount(source=hp.runs_root, target=hp.runs_root),
        Mount(source=hp.cache_dir, target=hp.cache_dir),
    ]
    for value in (cfg.get("target", {}).get("path"), cfg.get("data", {}).get("path")):
        if isinstance(value, str) and value.startswith("/"):
            found.append(Mount(source=value, target=value, read_only=True))
    seen = {m.target for m in found}
    return found + [m for m in f.extra_mounts if m.target not in seen]


def labels(run_id: str, hp: HostPlan) -> dict[str, str]:
    """The labels a run's containers carry: find_by_label finds them by the run id."""
    return {
        "io.dflash.run": run_id,
        "io.dflash.role": "supervisor",
        "io.dflash.host": hp.host or "local",
        "io.dflash.node": str(hp.node_rank),
    }


class DockerBackend(Backend):
    """`docker run -d` per host; the container is the handle, its labels find it again."""

    name = "docker"
    in_container = True
    relaunchable = True

    def require(self, host: str | None, req: Any, facts: Any) -> None:
        assert req.image
        require(host, req.image)
        facts.image_id = docker_cli.image_id(host, req.image)

    def name_host(self, hp: Any, *, run_id: str, facts: Any, config: dict[str, Any]) -> None:
        hp.container = f"{backend_name(run_id)}-node{hp.node_rank}"
        hp.labels = labels(run_id, hp)
        hp.mounts = mounts(hp, config, facts)

    def start(self, hp: Any, plan: Any) -> None:
        assert plan.image
        start(hp, plan.image)

    def alive(self, h: Any) -> bool | None:
        return state(h.host, h.container) in ("running", "created") if h.container else None

    def signal(self, h: Any, sig: str) -> bool:
        if not h.container:
            return False
        signal(h.host, h.container, sig)
        return True

    def kill(self, h: Any) -> None:
        self.signal(h, "KILL")

    def remove(self, h: Any) -> None:
        if h.container:
            remote.run(h.host, ["docker", "rm", "-f", h.container], check=False, timeout=60)

    def logs_argv(self, h: Any, *, lines: int, follow: bool) -> list[str] | None:
        return logs_argv(h.host, h.container, lines=lines, follow=follow) if h.container else None

    def attach_argv(self, run_id: str, h: Any) -> list[str]:
        if not h.container:
            return super().attach_argv(run_id, h)
        return attach_argv(h.host, h.container)

    def relaunch(self, run_id: str, hp: Any) -> None:
        assert hp.container
        remote.run(hp.host, ["docker", "start", hp.container], timeout=120)

    def describe(self, hp: Any) -> list[tuple[str, str]]:
        tags = " ".join(f"{k}={v}" for k, v in hp.labels.items())
        return [("container", f"{hp.container} (shm {hp.shm_bytes}) {tags}")] + [
            ("mount", m.arg()) for m in hp.mounts
        ]


BACKEND = DockerBackend()
