"""The launch plan: plain data, built from the request and what preflight found on each host.

build_plan is pure: tests compare whole plans without touching tmux, ssh or Docker, and
`dflashctl run --dry-run` prints exactly what apply would do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import shlex
import time
from dataclasses import dataclass, field
from typing import Any

from runner.errors import BadInput
from runner.launch import backend
from runner.launch.registry import check_name
from runner.rundir import layout

BACKENDS = backend.NAMES
CONFIG_NAME = "config.toml"
"""The config as launched, copied into each host's run directory: the job reads this copy."""
SHM_MARGIN = 256 << 20
"""Beyond the hidden-state queue: torch's own shared memory (DataLoader, gloo) needs some too."""


@dataclass(kw_only=True, slots=True)
class Mount:
    source: str
    target: str
    read_only: bool = False

    def arg(self) -> str:
        return f"{self.source}:{self.target}" + (":ro" if self.read_only else "")


@dataclass(kw_only=True, slots=True)
class HostFacts:
    """What preflight learned about one host: everything build_plan needs that is not in the request."""

    host: str | None
    home: str
    """The login directory: relative paths on a host resolve against it (as in an ssh session)."""
    python: str = "python3"
    """The job's interpreter as the backend runs it (on the host, or inside the image)."""
    uid: int
    gid: int
    cwd: str | None = None
    """Local host only: where dflashctl runs; relative config paths resolve against it."""
    has_gpus: bool = False
    check: dict[str, Any] = field(default_factory=dict)
    """The job's own `python -m dflash.check --json` answer in this host's environment."""
    cache_key: str | None = None
    cache_action: str = "none"
    """reuse (the managed dir holds that key), restore, warm, none (cold compile)."""
    image_id: str | None = None
    lock_sha256: str | None = None
    rdzv_host: str | None = None
    """The address of this host other hosts reach (host 0 only, several hosts)."""
    plan_args: list[str] | None = None
    """dflash.launch --plan --json's module_args for this node (several hosts)."""
    extra_mounts: list[Mount] = field(default_factory=list)
    """--venv inside --backend docker: the venv, its base interpreter and the project source."""


@dataclass(kw_only=True, slots=True)
class Request:
    config: str
    """Local path of the config TOML."""
    backend: str = "tmux"
    hosts: list[str | None] = field(default_factory=lambda: [None])
    name: str | None = None
    sets: list[str] = field(default_factory=list)
    python: str | None = None
    """Interpreter of the job environment (a venv's bin/python, or python3 on a host)."""
    image: str | None = None
    variant: str | None = None
    runs_root: str | None = None
    dry_run: bool = False
    """`run --dry-run`: the checks write nothing on any host."""
    warm: bool = False
    allow_drift: bool = False
    own_env: bool = False
    """The job runs in dflashctl's own interpreter (the demo, from this checkout's venv): no other
    environment to drift from it, so no variant is asked for."""
    rdzv_port: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise BadInput(f"--backend {self.backend!r}: use one of {', '.join(BACKENDS)}")
        in_container = backend.get(self.backend).in_container
        if in_container and not self.image:
            raise BadInput(f"--backend {self.backend} needs --image REF or --variant V (an image to run)")
        if self.image and not in_container:
            boxed = " or ".join(n for n in BACKENDS if backend.get(n).in_container)
            raise BadInput(f"--image runs in a container: use --backend {boxed}, not {self.backend}")
        for s in self.sets:
            if "=" not in s:
                raise BadInput(f"--set {s!r}: use key=value, e.g. --set train.lr=1e-4")


@dataclass(kw_only=True, slots=True)
class HostPlan:
    node_rank: int
    host: str | None
    run_dir: str
    runs_root: str
    cwd: str
    config_path: str
    argv: list[str]
    """The job's command line (`python -m dflash.launch ...`), as the job's environment runs it."""
    env: dict[str, str]
    cache_dir: str
    cache_key: str | None
    cache_action: str
    shm_bytes: int | None
    gpus: bool
    mounts: list[Mount] = field(default_factory=list)
    tmux_session: str | None = None
    tmux_window: str | None = None
    container: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    uid: int = 0
    gid: int = 0


@dataclass(kw_only=True, slots=True)
class RunPlan:
    run_id: str
    name: str
    backend: str
    config: str
    sets: list[str]
    image: str | None
    image_id: str | None
    lock_sha256: str | None
    nnodes: int
    rdzv_endpoint: str | None
    hosts: list[HostPlan]
    warnings: list[str] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def new_run_id(name: str, now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return f"{name}-{stamp}-{secrets.token_hex(2)}"


def rdzv_port(run_id: str) -> int:
    """A port for host 0's rendezvous, spread by run id so two runs on one host rarely meet."""
    return 29400 + int(hashlib.sha256(run_id.encode()).hexdigest(), 16) % 500


def managed_cache_dir(home: str, key: str | None, config_name: str) -> str:
    """Inductor + triton caches live here on each host, one directory per fingerprint key: never
    /tmp, where one `rm -rf` cost the field 80% of its throughput."""
    return f"{home.rstrip('/')}/.cache/dflashctl/compile/{key or 'unkeyed-' + config_name}"


def _abs(path: str, base: str) -> str:
    return path if path.startswith("/") else f"{base.rstrip('/')}/{path}"


def build_plan(req: Request, facts: list[HostFacts], *, run_id: str, config_name: str) -> RunPlan:
    name = check_name(req.name or run_id.rsplit("-", 3)[0])
    nnodes = len(facts)
    first = facts[0].check.get("config") or {}
    endpoint = None
    if nnodes > 1:
        endpoint = f"{facts[0].rdzv_host}:{req.rdzv_port or rdzv_port(run_id)}"
    hosts: list[HostPlan] = []
    for rank, f in enumerate(facts):
        base = f.cwd if f.host is None and f.cwd else f.home
        runs_root = _abs(req.runs_root or str(first.get("run", {}).get("runs_root", "runs")), base)
        run_dir = f"{runs_root}/{run_id}" + (f"-node{rank}" if nnodes > 1 else "")
        config_path = f"{run_dir}/{CONFIG_NAME}"
        python = f.python
        sets = [*req.sets, f"run.name={name}", f"run.runs_root={runs_root}"]
        if f.plan_args is not None:
            # The job computed node rank, endpoint and nnodes; only the paths are this host's.
            module_args = list(f.plan_args)
            module_args[1] = config_path
            i = module_args.index("--run-dir")
            module_args[i + 1] = run_dir
            extra = [a for s in [f"run.runs_root={runs_root}"] for a in ("--set", s)]
            module_args[2:2] = extra
        else:
            module_args = ["dflash.launch", config_path]
            for s in sets:
                module_args += ["--set", s]
            module_args += ["--run-dir", run_dir]
        argv = [python, "-m", *module_args]
        cache_dir = managed_cache_dir(f.home, f.cache_key, config_name)
        env = {"DFLASH_CACHE_DIR": cache_dir, "PYTHONUNBUFFERED": "1", "DFLASH_RUN_BACKEND": req.backend}
        if f.cache_action in ("reuse", "restore", "warm") and f.cache_key:
            env["DFLASH_CACHE_ARTIFACT"] = f.cache_key
            env["DFLASH_EXPECT_WARM_CACHE"] = "1"
        if f.lock_sha256:
            env["DFLASH_LOCK_SHA256"] = f.lock_sha256
        if f.image_id:
            env["DFLASH_IMAGE_DIGEST"] = f.image_id
        shm = f.check.get("shm_bytes")
        hp = HostPlan(
            node_rank=rank,
            host=f.host,
            run_dir=run_dir,
            runs_root=runs_root,
            cwd=base,
            config_path=config_path,
            argv=argv,
            env=env,
            cache_dir=cache_dir,
            cache_key=f.cache_key,
            cache_action=f.cache_action,
            shm_bytes=int(shm) + SHM_MARGIN if isinstance(shm, int) else None,
            gpus=f.has_gpus,
            uid=f.uid,
            gid=f.gid,
        )
        backend.get(req.backend).name_host(hp, run_id=run_id, facts=f, config=first)
        hosts.append(hp)
    warnings = [w["message"] for f in facts for w in f.check.get("warnings", []) if "message" in w]
    return RunPlan(
        run_id=run_id,
        name=name,
        backend=req.backend,
        config=req.config,
        sets=list(req.sets),
        image=req.image,
        image_id=facts[0].image_id,
        lock_sha256=facts[0].lock_sha256,
        nnodes=nnodes,
        rdzv_endpoint=endpoint,
        hosts=hosts,
        warnings=warnings,
    )


def shell_line(hp: HostPlan, *, log: bool) -> str:
    """The one shell command a tmux window or foreground ssh session runs: every value quoted once."""
    envs = [f"{k}={v}" for k, v in sorted(hp.env.items())]
    line = f"cd {shlex.quote(hp.cwd)} && {shlex.join(['env', *envs, *hp.argv])}"
    if log:
        line += f" 2>&1 | tee -a {shlex.quote(hp.run_dir + '/' + layout.SUPERVISOR_LOG)}"
    return line
