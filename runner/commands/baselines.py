"""`dflashctl baselines`: the throughput baselines watch compares runs against (one per environment
fingerprint and compile-relevant config, kept beside the cache artifacts, set from healthy runs)."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer
from rich.table import Table

from runner.console import cli_errors, console
from runner.watch.baseline import list_baselines
from runner.watch.session import baselines_dir


def register(app: typer.Typer) -> None:
    @app.command("baselines")
    def baselines_cmd(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
        """List the tok/s baselines: fingerprint, config hash, tok/s, the runs it came from."""
        with cli_errors():
            found = list_baselines(baselines_dir())
        if as_json:
            typer.echo(json.dumps([b.to_dict() for b in found], indent=2))
            return
        if not found:
            console.print(f"no baselines in {baselines_dir()}: a run that completes healthy under "
                          "`dflashctl watch` sets one")  # fmt: skip
            return
        table = Table(box=None, pad_edge=False)
        for col in ("FINGERPRINT", "CONFIG", "TOK/S", "RUNS", "UPDATED"):
            table.add_column(col, no_wrap=True)
        for b in found:
            table.add_row(
                b.fingerprint_key[:16], b.config_hash[:12], f"{b.tok_s:,.0f}",
                ", ".join(str(r.get("run_id")) for r in b.runs[-3:]),
                time.strftime("%Y-%m-%d %H:%M", time.localtime(b.updated_at)),
            )  # fmt: skip
        console.print(table)
