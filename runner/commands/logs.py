"""`dflashctl logs RUN`: a run's supervisor output, or one worker's log, here or on its host."""

from __future__ import annotations

import subprocess
import sys
from typing import Annotated

import typer

from runner.console import cli_errors, console
from runner.errors import BadInput, RunnerError
from runner.exec import remote
from runner.launch.control import follow_end, log_argv, log_names
from runner.launch.registry import HostRecord, Registry, RunRecord

POLL_S = 1.0
"""How often a follow checks that the run is still there and still running."""


def follow(rec: RunRecord, h: HostRecord, argv: list[str]) -> int:
    """Run the following `tail` (here or over ssh) until the run ends or its directory goes away:
    tail -F --pid returns by itself when the supervisor exits; a run followed before it held its
    lock, one whose directory is removed, or whose files say it ended, is noticed here."""
    proc = subprocess.Popen(argv)
    try:
        while True:
            try:
                return proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            end = follow_end(rec, h)
            if end is not None:
                try:  # the lines written last: tail reads its file once a second
                    proc.wait(timeout=1.5)
                except subprocess.TimeoutExpired:
                    proc.terminate()
                    proc.wait()
                print(end[1], file=sys.stderr, flush=True)
                return end[0]
    except KeyboardInterrupt:  # Ctrl-C: tail got it too (one process group)
        proc.terminate()
        proc.wait()
        return 130


def register(app: typer.Typer) -> None:
    @app.command("logs")
    def logs_cmd(
        run: Annotated[str, typer.Argument(help="Run id, id prefix or name.")],
        worker: Annotated[
            str | None,
            typer.Option(help="drafter-0, target-1, drafter-group-node0, data (default: supervisor)."),
        ] = None,
        follow_: Annotated[
            bool, typer.Option("--follow", "-f", help="Keep printing new lines until the run ends.")
        ] = False,
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
            argv = log_argv(rec, hosts[0], worker, lines=lines, follow=follow_)
            if follow_:
                with remote.connections():  # one ssh connection for the tail and the checks
                    code = follow(rec, hosts[0], argv)
        raise typer.Exit(code if follow_ else subprocess.run(argv).returncode)
