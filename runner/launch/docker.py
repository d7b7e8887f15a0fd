"""docker backend: `docker run -d` per host through the docker CLI (local or over ssh, the same
argv either way; the SDK would need the engine's socket forwarded to the launching machine).

Containers carry labels (run id, role, host, node) that find them again, run as the invoking user
so files in the run directory are theirs, get the GPUs when the host has them, a /dev/shm sized
from the hidden-state queue, the host network (the drafter group's rendezvous and NCCL), an init
process that reaps torchrun's children, and no restart policy: restarts belong to the job's drafter
group and to `dflashctl watch`. Containers are kept after they exit, so `docker logs` still answers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from runner.errors import RunnerError
from runner.exec import docker as docker_cli
from runner.exec import remote
from runner.launch.backend import Backend
from runner.launch.plan import HostFacts, HostPlan, Mount
from runner.launch.registry import Registry, backend_name

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


RUN_LABEL = "io.dflash.run"
NODE_LABEL = "io.dflash.node"
REGISTRY_LABEL = "io.dflash.registry"
"""The launching registry's ident (launch.registry.Registry.ident)."""


def find_by_label(host: str | None, **wanted: str) -> list[dict[str, str]]:
    """The labels (and `name`) of every container on host that carries a run label, running or
    not, narrowed to those with each `wanted` label (run=, node=, registry=); [] where docker does
    not answer."""
    keys = {"run": RUN_LABEL, "node": NODE_LABEL, "registry": REGISTRY_LABEL}
    filters = ["--filter", f"label={RUN_LABEL}"]
    for key, value in wanted.items():
        filters += ["--filter", f"label={keys[key]}={value}"]
    fmt = "{{.Names}}" + "".join(f'\t{{{{.Label "{label}"}}}}' for label in keys.values())
    try:
        proc = remote.run(host, ["docker", "ps", "-a", *filters, "--format", fmt], check=False, timeout=60)
    except RunnerError:  # no docker CLI there, or no answer in time
        return []
    if proc.returncode != 0:
        return []
    found = []
    for line in proc.stdout.decode(errors="replace").splitlines():
        name, *values = line.split("\t")
        if name and len(values) == len(keys):
            found.append({"name": name, **dict(zip(keys, values, strict=True))})
    return found


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
    """The labels a run's containers carry: find_by_label finds them by the run id, its node and
    the registry that launched it."""
    return {
        RUN_LABEL: run_id,
        "io.dflash.role": "supervisor",
        "io.dflash.host": hp.host or "local",
        NODE_LABEL: str(hp.node_rank),
        REGISTRY_LABEL: Registry().ident,
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

    def locate(self, run_id: str, h: Any) -> Any:
        """The host's record with the container that carries this run's and node's labels: the
        recorded name while that container exists, else the labelled one (renamed by hand, or
        recorded without its name)."""
        mine = [c["name"] for c in find_by_label(h.host, run=run_id, node=str(h.node_rank))]
        if not mine or h.container in mine:
            return h
        return dataclasses.replace(h, container=mine[0])

    def found(self, host: str | None, registry: str) -> list[tuple[str, str]]:
        return [(c["name"], c["run"]) for c in find_by_label(host, registry=registry)]

    def stray(self, where: str, handle: str, run_id: str) -> str:
        return (
            f"container {handle} on {where} belongs to run {run_id}, which this machine launched but "
            f"no longer lists (its registry entry is gone): `docker logs {handle}` shows it, "
            f"`docker rm -f {handle}` removes it"
        )

    def relaunch(self, run_id: str, hp: Any) -> None:
        assert hp.container
        remote.run(hp.host, ["docker", "start", hp.container], timeout=120)

    def describe(self, hp: Any) -> list[tuple[str, str]]:
        tags = " ".join(f"{k}={v}" for k, v in hp.labels.items())
        return [("container", f"{hp.container} (shm {hp.shm_bytes}) {tags}")] + [
            ("mount", m.arg()) for m in hp.mounts
        ]


BACKEND = DockerBackend()
