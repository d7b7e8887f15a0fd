"""Apply a launch plan: run directories with the runner's run.json, compile caches in place, the
registry entry, then the backends. A failure before the last host starts removes what this launch
made (run directories, sessions, containers, the registry entry): nothing is left half-launched."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from runner import __version__
from runner.cache.restore import restore
from runner.cache.signing import load_keyring
from runner.cache.store import Store
from runner.cache.warmrun import warm_cache
from runner.errors import RunnerError
from runner.exec import remote
from runner.launch import backend
from runner.launch.plan import HostPlan, Request, RunPlan
from runner.launch.preflight import job_env
from runner.launch.registry import HostRecord, Registry, RunRecord
from runner.rundir import RUN_FORMAT, layout


def runner_manifest(plan: RunPlan, hp: HostPlan) -> dict[str, object]:
    """run.json as the runner creates it; the job fills in its own fields when it starts."""
    return {
        "format": RUN_FORMAT,
        "run_id": plan.run_id,
        "runner": {
            "dflashctl": __version__,
            "name": plan.name,
            "backend": plan.backend,
            "node_rank": hp.node_rank,
            "nnodes": plan.nnodes,
            "hosts": [h.host or "local" for h in plan.hosts],
            "rdzv_endpoint": plan.rdzv_endpoint,
            "image": plan.image,
            "image_digest": plan.image_id,
            "lock_sha256": plan.lock_sha256,
            "cache_key": hp.cache_key,
            "cache_action": hp.cache_action,
            "cache_dir": hp.cache_dir,
            "argv": {str(h.node_rank): h.argv for h in plan.hosts},
            "env": hp.env,
            "tmux": [hp.tmux_session, hp.tmux_window] if hp.tmux_session else None,
            "container": hp.container,
            "created_at": plan.created_at,
        },
    }


def record_for(plan: RunPlan) -> RunRecord:
    return RunRecord(
        run_id=plan.run_id,
        name=plan.name,
        backend=plan.backend,
        created_at=plan.created_at,
        config=str(Path(plan.config).resolve()),
        hosts=[
            HostRecord(
                node_rank=h.node_rank,
                host=h.host,
                run_dir=h.run_dir,
                tmux_session=h.tmux_session,
                tmux_window=h.tmux_window,
                container=h.container,
            )
            for h in plan.hosts
        ],
        argv={str(h.node_rank): h.argv for h in plan.hosts},
        plan=plan.to_dict(),
    )


def _make_run_dir(plan: RunPlan, hp: HostPlan, config: Path) -> None:
    probe = remote.run(hp.host, ["test", "-e", hp.run_dir], check=False)
    if probe.returncode == 0:
        raise RunnerError(f"{hp.run_dir} already exists on {hp.host or 'this machine'}; pick another --name")
    remote.run(hp.host, ["mkdir", "-p", f"{hp.run_dir}/logs", f"{hp.run_dir}/workers"], timeout=60)
    manifest = json.dumps(runner_manifest(plan, hp), indent=2, sort_keys=True) + "\n"
    remote.write_file(hp.host, f"{hp.run_dir}/{layout.RUN_JSON}", manifest.encode())
    remote.write_file(hp.host, hp.config_path, config.read_bytes())
    remote.write_file(hp.host, f"{hp.run_dir}/{layout.SUPERVISOR_LOG}", b"")


def _place_cache(req: Request, hp: HostPlan, store: Store, progress: Callable[[str], None]) -> None:
    """Make hp.cache_dir on its host hold the artifact for hp.cache_key (restore, or warm first)."""
    remote.run(hp.host, ["sh", "-c", 'mkdir -p "$1" && chmod 700 "$1"', "sh", hp.cache_dir], timeout=60)
    if hp.cache_action not in ("restore", "warm") or hp.cache_key is None:
        return
    if hp.cache_action == "warm" and hp.cache_key not in store.artifact_keys():
        progress(f"warming the compile cache on {hp.host or 'this machine'} (--warm)")
        env = job_env(req, hp.host, gpus=hp.gpus, mounts=[m for m in hp.mounts if m.read_only])
        result = warm_cache(Path(req.config), env=env, store=store, sets=req.sets, ring=load_keyring())
        if result.artifact.key != hp.cache_key:
            raise RunnerError(
                f"the warm run made artifact {result.artifact.key[:16]}, not the planned "
                f"{hp.cache_key[:16]}: the environment changed during the launch; run again"
            )
    with store.reading(hp.cache_key) as art:
        if hp.host is None:
            restore(art, Path(hp.cache_dir), dest_fingerprint=None, ring=load_keyring())
        else:
            with tempfile.TemporaryDirectory(prefix="dflash-restore-") as tmp:
                staged = Path(tmp, "cache")
                restore(art, staged, dest_fingerprint=None, ring=load_keyring())
                remote.run(hp.host, ["rm", "-rf", hp.cache_dir], timeout=120)
                remote.copy_to(hp.host, str(staged), hp.cache_dir)
                remote.run(hp.host, ["chmod", "-R", "go-rwx", hp.cache_dir], timeout=120)
    progress(f"compile cache {hp.cache_key[:16]} in place at {hp.cache_dir} on {hp.host or 'this machine'}")


def _cleanup(plan: RunPlan, made: list[HostPlan], started: list[HostPlan], registry: Registry) -> None:
    for hp in started:
        backend.get(plan.backend).remove(hp)
    for hp in made:
        remote.run(hp.host, ["rm", "-rf", hp.run_dir], check=False, timeout=60)
    registry.remove(plan.run_id)


def apply(
    plan: RunPlan,
    req: Request,
    *,
    store: Store,
    registry: Registry,
    progress: Callable[[str], None],
) -> RunRecord:
    """Prepare every host, then start every host. Foreground runs are started by the caller (they
    hold this terminal): for them this prepares and registers only."""
    made: list[HostPlan] = []
    started: list[HostPlan] = []
    record = record_for(plan)
    try:
        for hp in plan.hosts:
            _make_run_dir(plan, hp, Path(req.config))
            made.append(hp)
            _place_cache(req, hp, store, progress)
        registry.save(record)
        runs_in = backend.get(plan.backend)
        if runs_in.runs_here:
            return record
        for hp in plan.hosts:
            runs_in.start(hp, plan)
            started.append(hp)
            progress(f"started node {hp.node_rank} on {hp.host or 'this machine'}: {hp.run_dir}")
    except BaseException:
        _cleanup(plan, made, started, registry)
        raise
    return record


def wait_started(plan: RunPlan, *, timeout: float = 20.0) -> list[str]:
    """Give the backends a moment, and report hosts whose supervisor is already gone (a bad
    interpreter, a missing module): the run would otherwise look launched while nothing runs."""
    from runner.rundir import RunLocation, read_run

    deadline = time.monotonic() + timeout
    dead: list[str] = []
    pending = list(plan.hosts)
    while pending and time.monotonic() < deadline:
        time.sleep(1.0)
        still = []
        for hp in pending:
            view = read_run(RunLocation(hp.run_dir, hp.host))
            if view.running or view.stop_reason() is not None:
                continue
            if backend.get(plan.backend).alive(hp) is False:
                dead.append(f"node {hp.node_rank} on {hp.host or 'this machine'}")
            else:
                still.append(hp)
        pending = still
    return dead


def host_plan(rec: RunRecord, node_rank: int) -> HostPlan:
    """One host's plan back from the registry (what relaunching needs: argv, env, cwd, names)."""
    from runner.launch.plan import Mount

    for d in rec.plan.get("hosts", []):
        if d["node_rank"] == node_rank:
            return HostPlan(**{**d, "mounts": [Mount(**m) for m in d.get("mounts", [])]})
    raise RunnerError(f"{rec.run_id} was launched by an older dflashctl: its registry entry has no plan")


def relaunch(rec: RunRecord, node_rank: int) -> None:
    """Start a stopped run's supervisor again through its backend, on the same run directory: the
    job resumes from its newest checkpoint (the data position of each target included)."""
    backend.of(rec.backend).relaunch(rec.run_id, host_plan(rec, node_rank))
