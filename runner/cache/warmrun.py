"""warm-cache: run the job's warm entry point in the target environment, then snapshot its cache.

The job (`python -m dflash.warm CONFIG --out DIR`) compiles every shape the config can produce in
one process and one thread, printing one JSON object per line on stdout:

    {"event": "fingerprint", "key": ..., "fingerprint": {...}}
    {"event": "plan", "shapes": [...]}                       # what it is about to compile
    {"event": "shape", "index": i, "total": n, "shape": {...}, "seconds": s, "counters": {...}}
    {"event": "done", "seconds": s, "counters": {...}}

and leaves DIR/inductor, DIR/triton and DIR/warm.json ({fingerprint, key, stats}).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runner.cache.signing import Keyring
from runner.cache.snapshot import snapshot
from runner.cache.store import Artifact, Store
from runner.canonical import fingerprint_key
from runner.errors import RunnerError
from runner.exec import remote
from runner.exec.jobenv import JobEnv, config_in_env, job_fingerprint, job_refusal, refused
from runner.exec.stream import StreamFailed, stream
from runner.fsutil import make_private_dir

WARM_STATS = "warm.json"
_CONTAINER_OUT = "/dflash-warm"
_CONTAINER_CFG = "/dflash-warm-config.toml"
OUT_PLACEHOLDER = "<staging>/out"
"""In a plan's command line: the staging directory of the store the warm run fills (made at run time)."""


@dataclass(kw_only=True, slots=True)
class WarmResult:
    artifact: Artifact
    events: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(kw_only=True, slots=True)
class WarmPlan:
    """What `warm-cache` would do, as data (`warm-cache --dry-run`): the job's first check (its
    config and fingerprint, in the environment that will compile) has passed."""

    config: str
    sets: list[str]
    environment: str
    """Where the warm run compiles: JobEnv.describe()."""
    host: str | None
    image: str | None
    gpus: bool
    module_args: list[str]
    """`python -m` arguments of the warm run: the job reads a private copy of `config`, and writes
    OUT_PLACEHOLDER, a staging directory of the store."""
    key: str
    """The fingerprint key the artifact will have."""
    in_store: bool
    """The store holds an artifact of that key already (the warm run would make it again)."""
    store: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _module_args(config: str, out: str, sets: list[str] | None) -> list[str]:
    args = ["dflash.warm", config, "--out", out]
    for s in sets or []:
        args += ["--set", s]
    return args


def plan_warm(config: Path, *, env: JobEnv, store: Store, sets: list[str] | None = None) -> WarmPlan:
    """The job's fingerprint of the config in env: the job loads and checks the config as the warm
    run's first step does (dflash.config.load_config), so a config it refuses is refused here too."""
    if not config.is_file():
        raise RunnerError(f"config {config} not found; pass a TOML file such as configs/demo-cpu.toml")
    with config_in_env(config, env, _CONTAINER_CFG) as cfg:
        fp = job_fingerprint(env, config=cfg, sets=sets, shown_as=config)
    key = str(fp.get("key"))
    return WarmPlan(
        config=str(config),
        sets=list(sets or []),
        environment=env.describe(),
        host=env.host,
        image=env.image,
        gpus=env.gpus,
        module_args=_module_args(str(config), OUT_PLACEHOLDER, sets),
        key=key,
        in_store=key in store.artifact_keys(),
        store=str(store.root),
    )


@contextlib.contextmanager
def _work_dir(store: Store, env: JobEnv) -> Iterator[tuple[Path, str, str]]:
    """(local dir that ends up holding the cache, out dir as the job sees it, config dir as the job sees it)."""
    with store.staging() as local:
        if env.host is None:
            yield local, str(local / "out"), str(local)
            return
        # A random name made here: the remote needs nothing but a POSIX shell.
        name = f"$HOME/.cache/dflashctl/warm-{secrets.token_hex(8)}"
        script = f'umask 077 && mkdir -p "{name}" && cd "{name}" && pwd'
        rdir = remote.run(env.host, ["sh", "-c", script]).stdout.decode().strip()
        try:
            yield local, f"{rdir}/out", rdir
        finally:
            remote.run(env.host, ["rm", "-rf", rdir], check=False)


def warm_cache(
    config: Path,
    *,
    env: JobEnv,
    store: Store,
    sets: list[str] | None = None,
    ring: Keyring | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> WarmResult:
    if not config.is_file():
        raise RunnerError(f"config {config} not found; pass a TOML file such as configs/demo-cpu.toml")
    store.ensure()
    events: list[dict[str, Any]] = []
    started = time.monotonic()
    with _work_dir(store, env) as (local, out_dir, cfg_dir):
        cfg_arg = f"{cfg_dir}/{secrets.token_hex(4)}-{config.name}"
        if env.host is None:
            shutil.copyfile(config, cfg_arg)
        else:
            remote.copy_to(env.host, str(config), cfg_arg)
        if env.image is not None:
            make_private_dir(Path(out_dir)) if env.host is None else remote.run(
                env.host, ["mkdir", "-p", out_dir]
            )
            env.mounts = [*env.mounts, (out_dir, _CONTAINER_OUT, False), (cfg_arg, _CONTAINER_CFG, True)]
            job_out, job_cfg = _CONTAINER_OUT, _CONTAINER_CFG
        else:
            job_out, job_cfg = out_dir, cfg_arg
        try:
            _stream(env, _module_args(job_cfg, job_out, sets), events, on_event)
        except StreamFailed as e:
            problems = job_refusal(e.returncode, e.stderr)
            if problems:
                raise refused("dflash.warm", env, config, problems) from None
            raise
        if env.host is not None:
            remote.copy_from(env.host, out_dir, str(local / "out"))
        out = local / "out"
        try:
            stats = json.loads((out / WARM_STATS).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RunnerError(
                f"the warm run finished but left no readable {WARM_STATS} ({e}); see its output"
            ) from None
        fingerprint = stats.get("fingerprint")
        if not isinstance(fingerprint, dict):
            raise RunnerError(
                f"{WARM_STATS} has no fingerprint; dflash in {env.describe()} is too old or broken"
            )
        key = fingerprint_key(fingerprint)
        if stats.get("key") not in (None, key):
            raise RunnerError(
                f"the job's key {stats['key'][:16]} differs from sha256 of its fingerprint "
                f"{key[:16]}: dflash and dflashctl disagree on canonical JSON; upgrade both"
            )
        with store.lock(key):
            art = snapshot(
                store,
                out,
                fingerprint=fingerprint,
                config_name=config.stem,
                warm={k: v for k, v in stats.items() if k not in ("fingerprint", "key")},
                ring=ring,
                locked=True,
            )
    return WarmResult(artifact=art, events=events, seconds=time.monotonic() - started)


def _stream(
    env: JobEnv,
    args: list[str],
    events: list[dict[str, Any]],
    on_event: Callable[[dict[str, Any]], None] | None,
) -> None:
    def on_line(line: str) -> None:
        line = line.strip()
        if not line.startswith("{"):
            return
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            return
        if isinstance(event, dict) and "event" in event:
            events.append(event)
            if on_event is not None:
                on_event(event)

    stream(
        remote.remote_argv(env.host, env.argv(args)),
        on_line=on_line,
        merge_stderr=False,
        what=f"the warm run in {env.describe()}",
    )
