"""`dflashctl stop RUN`: graceful stop (SIGTERM, final checkpoint), then force."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from runner.console import cli_errors, console
from runner.errors import BadInput, RunnerError
from runner.exec import remote
from runner.launch.control import StopResult, stop
from runner.launch.registry import Registry


def register(app: typer.Typer) -> None:
    @app.command("stop")
    def stop_cmd(
        run: Annotated[str, typer.Argument(help="Run id, id prefix or name.")],
        force: Annotated[bool, typer.Option(help="SIGKILL every process of the run at once.")] = False,
        timeout: Annotated[
            float, typer.Option(help="Seconds to wait for the graceful stop before killing.")
        ] = 240.0,
        as_json: Annotated[bool, typer.Option("--json")] = False,
    ) -> None:
        """Stop a run: the drafters agree on a step and checkpoint, every process exits; then force."""
        with cli_errors(), remote.connections():
            if timeout < 0:
                raise BadInput("--timeout must be >= 0")
            rec = Registry().find(run)
            say = (lambda m: None) if as_json else (lambda m: console.print(m, highlight=False))
            result = stop(rec, force=force, timeout=timeout, progress=say)
            if result.left and result.forced:
                raise RunnerError(
                    f"{rec.run_id}: processes still alive after the stop: {result.left}; they did not "
                    "die from SIGKILL (uninterruptible I/O or a GPU fault): check the host"
                )
        if as_json:
            typer.echo(json.dumps({"run_id": rec.run_id, **result.to_dict()}))
        else:
            console.print(_summary(rec.run_id, result), highlight=False)
        if result.left or (result.missed and result.state == "running"):
            raise typer.Exit(1)


def _summary(run_id: str, r: StopResult) -> str:
    """One honest line: a clean stop only when every supervisor got SIGTERM and the run ended so."""
    state = r.state + (f" ({r.reason})" if r.reason else "")
    if r.graceful:
        return f"[green]stopped[/] {run_id} in {r.seconds:.1f} s: {state}"
    if r.forced:
        return f"[yellow]killed[/] {run_id} in {r.seconds:.1f} s: {state}"
    if r.missed and r.state == "running":
        return (
            f"[red]not stopped[/] {run_id}: the process holding its run directory on "
            f"{', '.join(r.missed)} is not the one the run recorded (a reused pid?): nothing was signalled"
        )
    if r.missed:
        return f"[yellow]was not running[/] {run_id} on {', '.join(r.missed)}: {state}"
    return f"[yellow]stopped, not cleanly[/] {run_id} in {r.seconds:.1f} s: {state}"
