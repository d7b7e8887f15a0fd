"""`dflashctl warm-cache CONFIG.toml`: compile every shape once, save the cache as an artifact."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from runner.cache.signing import load_keyring
from runner.cache.store import Store
from runner.cache.warmrun import WarmPlan, plan_warm, warm_cache
from runner.commands.cache import StoreOpt
from runner.console import cli_errors, console
from runner.exec import remote
from runner.exec.docker import host_has_nvidia
from runner.exec.jobenv import JobEnv, job_image
from runner.tomlfile import read_toml, table


def _wants_gpu(config: Path, host: str | None, sets: list[str]) -> bool:
    device = table(read_toml(config), "run", f"config {config}").get("device", "auto")
    for override in sets:  # the job applies --set after the file; the last one wins
        key, _, value = override.partition("=")
        if key.strip() == "run.device":
            device = value.strip().strip("\"'")
    if device == "auto":
        return host_has_nvidia(host)
    return device == "cuda"


def _progress(event: dict[str, Any]) -> None:
    kind = event.get("event")
    if kind == "fingerprint":
        console.print(f"fingerprint {str(event.get('key'))[:16]}", highlight=False)
    elif kind == "plan":
        console.print(f"compiling {len(event.get('shapes', []))} shape(s) in one process, one thread")
    elif kind == "shape":
        c = event.get("counters", {})
        mem = event.get("memory")
        peak = mem.get("peak_reserved") if isinstance(mem, dict) else None
        console.print(
            f"  {event.get('part', 'drafter')} [{event.get('index')}/{event.get('total')}] "
            f"{json.dumps(event.get('shape'))}: "
            f"{event.get('seconds', 0):.1f} s, fxgraph hits {c.get('fxgraph_hits', 0)} misses "
            f"{c.get('fxgraph_misses', 0)}"
            + (f", peak {peak / 2**30:.1f} GiB" if isinstance(peak, int) else ""),
            highlight=False,
        )
    elif kind == "done":
        console.print(f"compiled in {event.get('seconds', 0):.1f} s")


def _render(plan: WarmPlan) -> None:
    console.print(f"[bold]warm[/] {plan.config} in {plan.environment}", highlight=False)
    have = "in the store already: a warm run makes it again" if plan.in_store else "not in the store"
    console.print(f"  fingerprint {plan.key} ({have})", highlight=False, soft_wrap=True)
    console.print(f"  store       {plan.store}", highlight=False)
    console.print(f"  command     python -m {shlex.join(plan.module_args)}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    @app.command("warm-cache")
    def warm_cache_cmd(
        config: Annotated[Path, typer.Argument(help="Job config TOML (e.g. configs/demo-cpu.toml).")],
        python: Annotated[
            str | None,
            typer.Option(
                help="Interpreter of the job environment (default: dflashctl's own here; python3 on --host or in --image)."
            ),
        ] = None,
        image: Annotated[str | None, typer.Option(help="Run in this container image.")] = None,
        variant: Annotated[
            str | None, typer.Option(help="Run in the image built for this variant (envs/V).")
        ] = None,
        host: Annotated[
            str | None, typer.Option(help="Run on USER@HOST over ssh (DFLASH_SSH_OPTS applies).")
        ] = None,
        sets: Annotated[list[str] | None, typer.Option("--set", help="Config override key=value.")] = None,
        store: StoreOpt = None,
        dry_run: Annotated[
            bool,
            typer.Option(
                help="Check the config and fingerprint in the environment, print the plan; compile nothing."
            ),
        ] = False,
        as_json: Annotated[
            bool, typer.Option("--json", help="Print the result (or the plan) as JSON (no progress).")
        ] = False,
    ) -> None:
        """Compile the job's real code paths for every shape the config can produce; save the cache."""
        with cli_errors():
            if host is not None:
                remote.parse_host(host)  # refused here, before any probe
            image = job_image(image, variant)
            # Locally the default job environment is dflashctl's own; on a host or in an image, python3.
            local = host is None and image is None
            env = JobEnv(python=python or (sys.executable if local else "python3"), host=host, image=image)
            if image:
                env.gpus = _wants_gpu(config, host, sets or [])
            if dry_run:
                plan = plan_warm(config, env=env, store=Store(store), sets=sets)
                if as_json:
                    typer.echo(json.dumps(plan.to_dict(), indent=2, sort_keys=True))
                else:
                    _render(plan)
                return
            result = warm_cache(
                config,
                env=env,
                store=Store(store),
                sets=sets,
                ring=load_keyring(),
                on_event=None if as_json else _progress,
            )
            art = result.artifact
            if as_json:
                typer.echo(
                    json.dumps(
                        {
                            "key": art.key,
                            "path": str(art.path),
                            "size": art.manifest.archive.size,
                            "files": len(art.manifest.files),
                            "seconds": round(result.seconds, 2),
                            "signed": art.manifest.signature is not None,
                            "warm": art.manifest.warm,
                        }
                    )
                )
                return
            console.print(f"[green]artifact[/] {art.key}", highlight=False)
            console.print(
                f"  {len(art.manifest.files)} files, archive {art.manifest.archive.size} bytes, "
                f"{'signed' if art.manifest.signature else 'unsigned'}, at {art.path}",
                highlight=False,
            )
            typer.echo(art.key)
