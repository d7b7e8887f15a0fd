"""`dflashctl report RUN`: a PNG of the run over time (tok/s, loss, acc, streak, queues, GPUs) with
restarts, watch's findings and actions marked, and a short text summary."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from runner.console import cli_errors, console
from runner.errors import RunnerError
from runner.exec import remote
from runner.launch.registry import Registry
from runner.rundir import layout
from runner.watch.report import ReportSummary, build_report

_LIST = 'cd "$1" || exit 3; shift; for f in "$@"; do [ -f "$f" ] && echo "$f"; done; exit 0'


def _fetch(host: str, run_dir: str, into: Path) -> None:
    """Copy the files a report reads from host:run_dir into `into`; those absent there stay absent."""
    listed = remote.run(host, ["sh", "-c", _LIST, "sh", run_dir, *layout.REPORTED], check=False, timeout=120)
    if listed.returncode == 3:
        raise RunnerError(f"{host}:{run_dir} does not exist; `dflashctl ps --all` shows where the run lives")
    if listed.returncode != 0:
        err = (listed.stderr or b"").decode(errors="replace").strip()[-400:]
        raise RunnerError(f"cannot read {host}:{run_dir} (exit code {listed.returncode}): {err}")
    for rel in listed.stdout.decode().split():
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        remote.copy_from(host, f"{run_dir.rstrip('/')}/{rel}", str(into / rel))


def _report(run: str, out: Path | None, node: int) -> ReportSummary:
    given = Path(run).expanduser()
    if given.is_dir() and (given / layout.RUN_JSON).is_file():
        return build_report(given, out or given / "report.png")
    try:
        rec = Registry().find(run)
    except RunnerError:
        if given.is_dir():
            raise RunnerError(
                f"{given} has no {layout.RUN_JSON}: not a run directory (nor a known run id)"
            ) from None
        raise
    hosts = [h for h in rec.hosts if h.node_rank == node]
    if not hosts:
        raise RunnerError(f"{rec.run_id} has no node {node} (nodes 0..{len(rec.hosts) - 1})")
    h = hosts[0]
    if h.host is None:
        return build_report(Path(h.run_dir), out or Path(h.run_dir) / "report.png")
    target = out or Path.cwd() / f"{rec.run_id}-report.png"
    with tempfile.TemporaryDirectory(prefix="dflashctl-report-") as tmp, remote.connections():
        local = Path(tmp) / rec.run_id
        local.mkdir()
        _fetch(h.host, h.run_dir, local)
        summary = build_report(local, target)
    summary.run_dir = f"{h.host}:{h.run_dir}"
    summary.lines[0] = f"run {summary.run_id} ({summary.run_dir})"
    return summary


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report_cmd(
        run: Annotated[str, typer.Argument(help="Run id, id prefix, name, or a run directory.")],
        out: Annotated[
            Path | None,
            typer.Option(
                "--out",
                "-o",
                help="PNG to write (default: <run dir>/report.png; ./<run id>-report.png for a remote run).",
            ),
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
        node: Annotated[int, typer.Option(help="Node rank whose run directory to read (several hosts).")] = 0,
    ) -> None:
        """Plot a run over time (tok/s, loss, acc, streak, queues, GPU use) with restarts, findings and
        actions marked, and print a short summary."""
        with cli_errors():
            summary = _report(run, out, node)
        if as_json:
            typer.echo(json.dumps(summary.to_dict(), indent=2))
            return
        for line in summary.lines:
            console.print(line, highlight=False, markup=False, soft_wrap=True)
