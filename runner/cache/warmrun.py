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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.cache.signing import Keyring
from runner.cache.snapshot import snapshot
from runner.cache.store import Artifact, Store
from runner.canonical import fingerprint_key
from runner.errors import RunnerError
from runner.exec import remote
from runner.exec.jobenv import JobEnv
from runner.exec.stream import stream
from runner.fsutil import make_private_dir

WARM_STATS = "warm.json"
_CONTAINER_OUT = "/dflash-warm"
_CONTAINER_CFG = "/dflash-warm-config.toml"


@dataclass(kw_only=True, slots=True)
class WarmResult:
    artifact: Artifact
    events: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


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
        args = ["dflash.warm", job_cfg, "--out", job_out]
        for s in sets or []:
            args += ["--set", s]
        _stream(env, args, events, on_event)
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
