"""`dflashctl stop RUN`: graceful stop (SIGTERM, final checkpoint), then force."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from runner.console import cli_errors, console
from runner.errors import BadInput, RunnerError
from runner.exec import remote
from runner.launch.control import status, stop
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
            final = status(rec)
            if result.left:
                raise RunnerError(
                    f"{rec.run_id}: processes still alive after the stop: {result.left}; they did not "
                    "die from SIGKILL (uninterruptible I/O or a GPU fault): check the host"
                )
        if as_json:
            typer.echo(
                json.dumps(
                    {
                        "run_id": rec.run_id,
                        "graceful": result.graceful,
                        "forced": result.forced,
                        "seconds": round(result.seconds, 1),
                        "state": final.state,
                        "reason": final.reason,
                    }
                )  # fmt: skip
            )
            return
        how = "killed" if result.forced else "stopped"
        console.print(
            f"[green]{how}[/] {rec.run_id} in {result.seconds:.1f} s: {final.state}"
            + (f" ({final.reason})" if final.reason else ""),
            highlight=False,
        )
