"""`dflashctl run CONFIG.toml`: check every host, restore the compile cache, launch, record."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Annotated

import typer

from runner.cache.paths import unusable_reason
from runner.cache.store import Store
from runner.commands.cache import StoreOpt
from runner.console import cli_errors, console, err_console, warn
from runner.errors import BadInput, RunnerError
from runner.exec import remote
from runner.exec.jobenv import job_image
from runner.launch import foreground
from runner.launch.apply import apply, wait_started
from runner.launch.backend import get as get_backend
from runner.launch.plan import BACKENDS, Request, RunPlan, build_plan, new_run_id, shell_line
from runner.launch.preflight import config_value, preflight
from runner.launch.registry import Registry, check_name


def _render(plan: RunPlan) -> None:
    console.print(
        f"[bold]run[/] {plan.run_id}  name {plan.name}  backend {plan.backend}  nodes {plan.nnodes}",
        highlight=False,
    )
    if plan.rdzv_endpoint:
        console.print(f"  rendezvous {plan.rdzv_endpoint}", highlight=False)
    for hp in plan.hosts:
        console.print(f"[bold]node {hp.node_rank}[/] on {hp.host or 'this machine'}", highlight=False)
        console.print(f"  run dir   {hp.run_dir}", highlight=False)
        console.print(
            f"  cache     {hp.cache_action} {str(hp.cache_key)[:16]} at {hp.cache_dir}", highlight=False
        )
        for label, value in get_backend(plan.backend).describe(hp):
            console.print(f"  {label:<9} {value}", highlight=False)
        console.print(f"  command   {shell_line(hp, log=False)}", highlight=False, soft_wrap=True)


def _check_local_runs_root(runs_root: str) -> None:
    """The runs root on this machine must be, or be creatable as, a directory we can write: refused
    here, in one message, instead of at mkdir after every check has run."""
    probe = Path(runs_root).absolute()
    while not os.path.lexists(probe):  # the deepest part that exists decides
        probe = probe.parent
    if not probe.is_dir():
        raise BadInput(
            f"runs root {runs_root}: {probe} is not a directory; pass --runs-root DIR (a directory, "
            "or a path that can be created)"
        )
    # A real mkdir, not access(): that says yes to root everywhere, also under /sys, where
    # mkdir fails all the same (and the job then fails after every check has passed).
    reason = unusable_reason(runs_root)
    if reason is not None:
        raise BadInput(f"runs root {runs_root}: {reason}; pass --runs-root DIR you can write")


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run_cmd(
        config: Annotated[Path, typer.Argument(help="Job config TOML (e.g. configs/demo-cpu.toml).")],
        backend: Annotated[str, typer.Option(help=f"Where the job runs: {' | '.join(BACKENDS)}.")] = "tmux",
        hosts: Annotated[
            list[str] | None,
            typer.Option(
                "--host", help="USER@HOST[:PORT], once per host (node ranks in order); default here."
            ),
        ] = None,
        variant: Annotated[
            str | None, typer.Option(help="Variant (envs/V): its image with docker, drift check always.")
        ] = None,
        image: Annotated[str | None, typer.Option(help="Container image to run (--backend docker).")] = None,
        venv: Annotated[
            str | None, typer.Option(help="Job environment: this venv on the host (mounted into --image).")
        ] = None,
        name: Annotated[str | None, typer.Option(help="Run name (default: the config's run.name).")] = None,
        sets: Annotated[list[str] | None, typer.Option("--set", help="Config override key=value.")] = None,
        warm: Annotated[
            bool, typer.Option(help="No cache artifact for this fingerprint: warm one first.")
        ] = False,
        allow_drift: Annotated[bool, typer.Option(help="Launch even if doctor finds drift.")] = False,
        runs_root: Annotated[
            str | None, typer.Option(help="Runs root on every host (default: the config's run.runs_root).")
        ] = None,
        rdzv_port: Annotated[
            int | None, typer.Option(help="Port of host 0's rendezvous (several hosts).")
        ] = None,
        dry_run: Annotated[bool, typer.Option(help="Check and print the plan; start nothing.")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
        store: StoreOpt = None,
    ) -> None:
        """Check the environment on every host, put the compile cache in place, launch, record."""
        code = 0
        with cli_errors(), remote.connections():
            sets = sets or []
            if not config.is_file():
                raise BadInput(f"config {config} not found; pass a TOML file such as configs/demo-cpu.toml")
            for h in hosts or []:
                remote.parse_host(h)  # every host refused here, before any probe of the first
            if not hosts:
                _check_local_runs_root(runs_root or str(config_value(config, sets, "run.runs_root", "runs")))
            img = job_image(image, variant) if get_backend(backend).in_container else image
            req = Request(
                config=str(config),
                backend=backend,
                hosts=list(hosts) if hosts else [None],
                name=name,
                sets=sets,
                python=f"{venv.rstrip('/')}/bin/python" if venv else None,
                image=img,
                variant=variant,
                runs_root=runs_root,
                dry_run=dry_run,
                warm=warm,
                allow_drift=allow_drift,
                rdzv_port=rdzv_port,
            )
            if name is not None:
                req.name = check_name(name)
            else:
                req.name = check_name(
                    str(config_value(config, sets, "run.name", "dflash")), origin=f"run.name of {config}"
                )
            run_id = new_run_id(req.name)
            st = Store(store)
            facts = preflight(req, run_id=run_id, name=req.name, store=st, warn=warn)
            plan = build_plan(req, facts, run_id=run_id, config_name=config.stem)
            for w in plan.warnings:
                warn(w)
            if dry_run:
                if as_json:
                    typer.echo(json.dumps(plan.to_dict(), indent=2, sort_keys=True))
                else:
                    _render(plan)
                return
            say = (
                (lambda m: err_console.print(m, highlight=False))
                if as_json
                else (lambda m: console.print(m, highlight=False))
            )
            apply(plan, req, store=st, registry=Registry(), progress=say)
            if as_json:
                typer.echo(json.dumps(plan.to_dict(), sort_keys=True))
            if get_backend(backend).runs_here:
                say(f"run {plan.run_id}: running in this terminal (Ctrl-C stops it with a checkpoint)")
                code = foreground.run(plan.hosts)
            else:
                dead = wait_started(plan, timeout=8.0)
                if dead:
                    raise RunnerError(
                        f"run {plan.run_id}: the supervisor exited at once on {', '.join(dead)}; see "
                        f"`dflashctl logs {plan.run_id}`"
                    )
                if not as_json:
                    console.print(f"[green]started[/] {plan.run_id}", highlight=False)
                    rid = shlex.quote(plan.run_id)
                    # One command a line, never wrapped: each is copied as it is.
                    for verb in ("ps", f"logs {rid} --follow", f"attach {rid}", f"stop {rid}"):
                        console.print(f"  dflashctl {verb}", highlight=False, soft_wrap=True)
        if code:
            raise typer.Exit(code)
