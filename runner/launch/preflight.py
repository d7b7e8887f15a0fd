"""Preflight: everything about every host is checked before anything starts on any of them.

Per host: it can be reached and logged in to; the backend's tool is there (tmux, a Docker engine
and the image); the job's own `dflash.check` accepts the config in that host's environment (every
error, by key); doctor finds no drift from the variant (unless --allow-drift); the fingerprint
names the compile-cache artifact to use. Nothing is written on any host here, except a temporary
copy of the config that is removed again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner.cache.store import Store
from runner.doctor import collect, diagnose
from runner.envs import load_variant, project_root
from runner.errors import BadInput, RunnerError
from runner.exec import docker as docker_cli
from runner.exec import remote
from runner.exec.jobenv import JobEnv, config_in_env, job_fingerprint
from runner.launch import backend
from runner.launch.plan import HostFacts, Mount, Request, managed_cache_dir
from runner.lock import read_lock
from runner.tomlfile import read_toml, table

_CONTAINER_CFG = "/dflash-preflight/config.toml"


def config_value(config: Path, sets: list[str], dotted: str, default: Any) -> Any:
    """One value of the job config as the job will see it (--set beats the file, file beats default),
    read here without dflash: only for what the runner itself must know (runs_root, name, device).
    The file is read with the job's checks (runner.tomlfile); a value that is not a string (these
    keys all are strings) is BadInput naming it."""
    section, _, key = dotted.partition(".")
    value = table(read_toml(config), section, f"config {config}").get(key, default)
    for s in sets:
        k, _, v = s.partition("=")
        if k.strip() == dotted:
            value = v.strip().strip("\"'")
    if not isinstance(value, str):
        raise BadInput(
            f"config {config}: {dotted} must be a string, got {type(value).__name__} {str(value)[:40]!r}"
        )
    return value


def job_env(req: Request, host: str | None, *, gpus: bool, mounts: list[Mount]) -> JobEnv:
    """Where job entry points (check, fingerprint, warm) run for this host: its python, or the image."""
    local = host is None and req.image is None
    python = req.python or (sys.executable if local else "python3")
    env = JobEnv(python=python, host=host, image=req.image)
    if req.image:
        env.gpus = gpus
        env.mounts = [(m.source, m.target, m.read_only) for m in mounts]
    return env


def _host_basics(host: str | None) -> HostFacts:
    script = 'echo "$HOME"; id -u; id -g; command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo nogpu'
    out = remote.run(host, ["sh", "-c", script], timeout=120).stdout.decode().split("\n")
    try:
        home, uid, gid, gpu = out[0].strip(), int(out[1]), int(out[2]), out[3].strip()
    except (IndexError, ValueError):
        raise RunnerError(f"{host or 'this machine'} answered the login probe oddly: {out[:4]}") from None
    return HostFacts(
        host=host,
        home=home,
        uid=uid,
        gid=gid,
        cwd=os.getcwd() if host is None else None,
        has_gpus=gpu == "gpu",
    )


def job_check(env: JobEnv, cfg: str, sets: list[str], extra: list[str]) -> dict[str, Any]:
    args = ["dflash.check", cfg, *[a for s in sets for a in ("--set", s)], *extra, "--json"]
    proc = remote.run(env.host, env.argv(args), check=False, timeout=600)
    try:
        result = remote.parse_json_tail(proc.stdout, f"`{shlex.join(env.argv(args))}`", "")
    except RunnerError:
        tail = (proc.stderr or b"").decode(errors="replace").strip().splitlines()[-12:]
        raise RunnerError(
            f"the job's config check could not run in {env.describe()} (exit code {proc.returncode}); "
            "is dflash installed in that environment?\n" + "\n".join(tail)
        ) from None
    return result


def _variant_for(req: Request, env: JobEnv) -> tuple[str | None, str | None]:
    """(variant, lock kind) to check drift against: --variant, else what the venv or image records."""
    if req.variant:
        return req.variant, None
    if req.image:
        labels = docker_cli.image_labels(env.host, req.image)
        return labels.get("io.dflash.variant"), labels.get("io.dflash.lock")
    if req.python:
        marker = str(Path(req.python).parent.parent / "dflash-env.json")
        proc = remote.run(env.host, ["cat", marker], check=False)
        if proc.returncode == 0:
            try:
                return json.loads(proc.stdout).get("variant"), None
            except ValueError:
                pass
    return None, None


def drift_check(req: Request, env: JobEnv, warn: Callable[[str], None]) -> str | None:
    """Refuse (unless --allow-drift) an environment that differs from its variant; the lock sha."""
    variant, lock_file = _variant_for(req, env)
    if variant is None and req.own_env:
        return None
    if variant is None:
        warn(
            f"{env.describe()}: no variant to check against (pass --variant, or run an image or venv "
            "that `dflashctl build` made); environment drift is not checked"
        )
        return None
    v = load_variant(variant, project_root())
    kind = "runner" if lock_file and "runner" in lock_file else "full"
    lock = read_lock(v.lock_path(kind))
    python = None if req.image else env.python
    fp = collect(python=python, image=req.image, host=env.host, warn=warn)
    report = diagnose(fp, target=env.describe(), variant=v, lock=lock)
    if not report.ok:
        failed = [f"{c.name}: {c.detail}" for c in report.checks if c.status == "fail"]
        message = f"{env.describe()} differs from variant {variant}:\n  " + "\n  ".join(failed)
        if not req.allow_drift:
            raise RunnerError(
                message + f"\nRebuild the environment (`dflashctl build --variant {variant}`), or pass "
                "--allow-drift to launch anyway"
            )
        warn(message + "\n(launching anyway: --allow-drift)")
    return lock.sha256


def _venv_mounts(env: JobEnv) -> list[Mount]:
    """--venv in --backend docker: the venv, the interpreter it was made from and the project
    source of an editable install, read-only at their own paths."""
    src = (
        "import sys, os, dflash; print(sys.prefix); print(sys.base_prefix); "
        "print(os.path.dirname(os.path.dirname(os.path.abspath(dflash.__file__))))"
    )
    out = remote.run(env.host, [env.python, "-c", src], timeout=120).stdout.decode().split()
    paths: list[str] = []
    for p in out[:3]:
        if p and not any(p == q or p.startswith(q + "/") for q in paths):
            paths.append(p)
    return [Mount(source=p, target=p, read_only=True) for p in paths]


def cache_action(facts: HostFacts, store: Store, *, warm: bool, config_name: str) -> str:
    if facts.cache_key is None:
        return "none"
    d = managed_cache_dir(facts.home, facts.cache_key, config_name)
    proc = remote.run(facts.host, ["cat", f"{d}/artifact.json"], check=False)
    if proc.returncode == 0:
        with contextlib.suppress(ValueError):
            if json.loads(proc.stdout).get("key") == facts.cache_key:
                return "reuse"
    if facts.cache_key in store.artifact_keys():
        return "restore"
    return "warm" if warm else "none"


def _runs_root_set(req: Request, facts: HostFacts) -> list[str]:
    """--runs-root as the job check on this host must see it (the path build_plan gives the job), so
    a runs root the host cannot write is refused here, not at the job's mkdir after launch. Not with
    docker: the check runs in a container that has no mount of it yet, and the runs root there is
    the host's directory, mounted at launch."""
    if req.runs_root is None or backend.get(req.backend).in_container:
        return []
    base = facts.cwd if facts.host is None and facts.cwd else facts.home  # as build_plan resolves it
    root = req.runs_root if req.runs_root.startswith("/") else f"{base.rstrip('/')}/{req.runs_root}"
    return [f"run.runs_root={root}"]


def preflight(
    req: Request, *, run_id: str, name: str, store: Store, warn: Callable[[str], None]
) -> list[HostFacts]:
    config = Path(req.config)
    if not config.is_file():
        raise RunnerError(f"config {config} not found; pass a TOML file such as configs/demo-cpu.toml")
    facts_all: list[HostFacts] = []
    nnodes = len(req.hosts)
    sets = [*req.sets, f"run.name={name}"]
    endpoint = None
    per_node: dict[int, list[str]] = {}
    for rank, host in enumerate(req.hosts):
        where = host or "this machine"
        if host is not None:
            remote.parse_host(host)
        facts = _host_basics(host)
        runs_in = backend.get(req.backend)
        runs_in.require(host, req, facts)
        if runs_in.in_container and req.python:
            facts.extra_mounts = _venv_mounts(JobEnv(python=req.python, host=host))
        env = job_env(req, host, gpus=facts.has_gpus, mounts=facts.extra_mounts)
        facts.python = env.python
        if req.python and remote.run(host, ["test", "-x", req.python], check=False).returncode != 0:
            raise RunnerError(f"{req.python} is not an executable python on {where}; check --venv")
        if rank == 0 and nnodes > 1:
            facts.rdzv_host = remote.parse_host(host).hostname if host else "127.0.0.1"
        if endpoint is None and nnodes > 1:
            from runner.launch.plan import rdzv_port

            endpoint = f"{facts.rdzv_host}:{req.rdzv_port or rdzv_port(run_id)}"
        extra = (
            ["--nnodes", str(nnodes), "--node-rank", str(rank), "--rdzv-endpoint", endpoint]
            if endpoint
            else []
        )
        with config_in_env(config, env, _CONTAINER_CFG) as cfg:
            checked_sets = [*sets, *_runs_root_set(req, facts)]
            facts.check = job_check(env, cfg, checked_sets, extra)
            if not facts.check.get("ok"):
                errors = facts.check.get("errors") or [{"key": "", "message": "the check failed"}]
                lines = [f"  {e.get('key') or '(config)'}: {e.get('message')}" for e in errors]
                raise BadInput(
                    f"the job refused the config {config} on {where} ({len(errors)} problem(s)):\n"
                    + "\n".join(lines)
                )
            facts.lock_sha256 = drift_check(req, env, warn)
            # The runs root too: with `target.path = "tiny"` the fingerprint builds the tiny target
            # there (the runs root the job will use, not the config's default under this cwd).
            fp = job_fingerprint(env, config=cfg, sets=checked_sets, shown_as=config, read_only=req.dry_run)
            facts.cache_key = fp.get("key")
            if rank == 0 and nnodes > 1:
                base = f"/dflash-plan/{run_id}"  # replaced by each host's own run dir in build_plan
                args = ["dflash.launch", cfg, *[a for s in sets for a in ("--set", s)], "--plan", "--json"]
                args += ["--nnodes", str(nnodes), "--rdzv-endpoint", str(endpoint), "--run-dir", base]
                planned = remote.parse_json_tail(
                    remote.run(host, env.argv(args), timeout=300).stdout, "dflash.launch --plan --json", ""
                )
                per_node = {h["node_rank"]: h["module_args"] for h in planned.get("hosts", [])}
        facts.cache_action = cache_action(facts, store, warm=req.warm, config_name=config.stem)
        if facts.cache_action == "none":
            warn(
                f"{where}: no compile-cache artifact for fingerprint {str(facts.cache_key)[:16]}: the job "
                "compiles cold (minutes on a GPU). `dflashctl warm-cache` first, or pass --warm"
            )
        facts_all.append(facts)
    if nnodes > 1:
        for rank, f in enumerate(facts_all):
            f.plan_args = per_node[rank]
    return facts_all
