"""`dflashctl ps`: the runs this machine launched, with their state read from each run directory."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer
from rich.table import Table

from runner.console import cli_errors, console, warn
from runner.exec import remote
from runner.launch.control import status, strays
from runner.launch.registry import Registry

_STYLE = {"running": "green", "starting": "cyan", "stopped": "", "failed": "bold red", "stale": "yellow"}


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def register(app: typer.Typer) -> None:
    @app.command("ps")
    def ps_cmd(
        as_json: Annotated[bool, typer.Option("--json", help="One JSON object per run, as a list.")] = False,
        show_all: Annotated[
            bool, typer.Option("--all", "-a", help="Also stopped, failed and stale runs.")
        ] = False,
    ) -> None:
        """List runs: id, name, state (running/starting/stopped/failed/stale), backend, hosts, step, tok/s, last tau, age."""
        registry = Registry()
        with cli_errors(), remote.connections():
            records = registry.all()
            rows = [status(r) for r in records]
            found = strays(records, registry.ident)
        if not show_all:
            rows = [r for r in rows if r.state in ("running", "starting")]
        # One line per damaged registry entry or run file: the others are listed all the same.
        notes = [
            *registry.damaged,
            *(f"{r.record.run_id}: {line}" for r in rows for line in r.damage),
            *found,
        ]
        if as_json:
            typer.echo(json.dumps([r.to_dict() for r in rows], indent=2))
            for line in [*registry.damaged, *found]:
                warn(line)
            return
        table = Table(box=None, pad_edge=False)
        for col in ("RUN ID", "NAME", "STATE", "BACKEND", "HOSTS", "STEP", "TOK/S", "TAU", "AGE"):
            table.add_column(col, no_wrap=col in ("RUN ID", "STATE"), overflow="fold")
        for r in rows:
            d = r.to_dict()
            style = _STYLE.get(r.state, "")
            table.add_row(
                r.record.run_id,
                r.record.name,
                f"[{style}]{r.state}[/]" if style else r.state,
                r.record.backend,
                ",".join(d["hosts"]),
                "-" if r.step is None else str(r.step),
                "-" if r.tok_s is None else f"{r.tok_s:,.0f}",
                "-" if r.tau is None else f"{r.tau:.2f}",
                _age(time.time() - r.record.created_at),
            )
        console.print(table)
        for line in notes:
            warn(line)
        if not rows:
            console.print("no runs" + ("" if show_all else " running (--all shows finished ones)"))
