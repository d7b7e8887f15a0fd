"""`dflashctl logs RUN`: a run's supervisor output, or one worker's log, here or on its host."""

from __future__ import annotations

import os
import subprocess
from typing import Annotated

import typer

from runner.console import cli_errors, console
from runner.errors import BadInput, RunnerError
from runner.launch.control import log_argv, log_names
from runner.launch.registry import Registry


def register(app: typer.Typer) -> None:
    @app.command("logs")
    def logs_cmd(
        run: Annotated[str, typer.Argument(help="Run id, id prefix or name.")],
        worker: Annotated[
            str | None,
            typer.Option(help="drafter-0, target-1, drafter-group-node0, data (default: supervisor)."),
        ] = None,
        follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")] = False,
        lines: Annotated[int, typer.Option("--lines", "-n", help="Lines to show from the end.")] = 50,
        node: Annotated[int, typer.Option(help="Node rank (several hosts).")] = 0,
        list_logs: Annotated[bool, typer.Option("--list", help="List the run's log names.")] = False,
    ) -> None:
        """Print (and follow) a run's logs."""
        with cli_errors():
            rec = Registry().find(run)
            hosts = [h for h in rec.hosts if h.node_rank == node]
            if not hosts:
                raise RunnerError(f"{rec.run_id} has no node {node} (nodes 0..{len(rec.hosts) - 1})")
            if lines < 0:
                raise BadInput("--lines must be >= 0")
            if list_logs:
                for n in ["supervisor", *[x for x in log_names(hosts[0]) if x != "supervisor"]]:
                    console.print(n, highlight=False)
                return
            argv = log_argv(rec, hosts[0], worker, lines=lines, follow=follow)
        if follow:
            os.execvp(argv[0], argv)  # Ctrl-C ends tail, not a Python traceback
        raise typer.Exit(subprocess.run(argv).returncode)
