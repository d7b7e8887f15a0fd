"""`dflashctl attach RUN`: the run's tmux window (or its container's output), here or on its host."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from runner.console import cli_errors
from runner.errors import RunnerError
from runner.launch.control import attach_argv
from runner.launch.registry import Registry


def register(app: typer.Typer) -> None:
    @app.command("attach")
    def attach_cmd(
        run: Annotated[str, typer.Argument(help="Run id, id prefix or name.")],
        node: Annotated[int, typer.Option(help="Node rank (several hosts).")] = 0,
    ) -> None:
        """Attach this terminal to the run (tmux: detach with Ctrl-b d; docker: Ctrl-C detaches)."""
        with cli_errors():
            rec = Registry().find(run)
            hosts = [h for h in rec.hosts if h.node_rank == node]
            if not hosts:
                raise RunnerError(f"{rec.run_id} has no node {node}")
            argv = attach_argv(rec, hosts[0])
        os.execvp(argv[0], argv)
