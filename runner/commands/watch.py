"""`dflashctl watch RUN`: live health of a run (GPUs by worker, pipeline, findings), acting on it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.live import Live
from rich.rule import Rule

from runner.cache.signing import config_path
from runner.console import cli_errors, console, err_console
from runner.envs import tomllib
from runner.errors import RunnerError
from runner.exec import remote
from runner.launch.registry import HostRecord, Registry, RunRecord
from runner.watch.actions import Policy
from runner.watch.dashboard import render_dashboard, snapshot_json
from runner.watch.session import WatchSession, wait_first
from runner.watch.thresholds import Thresholds


def thresholds_from(overrides: list[str]) -> Thresholds:
    """`[watch]` of dflashctl's config file, then --threshold key=value (CLI > file > defaults)."""
    table: dict[str, Any] = {}
    path = config_path()
    if path.is_file():
        try:
            table = dict(tomllib.loads(path.read_text()).get("watch", {}))
        except tomllib.TOMLDecodeError as e:
            raise RunnerError(f"{path}: {e}") from None
    for o in overrides:
        key, sep, value = o.partition("=")
        if not sep:
            raise RunnerError(f"--threshold {o!r}: use key=value, e.g. --threshold hung_s=60")
        try:
            table[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            raise RunnerError(f"--threshold {o!r}: {value!r} is not a number") from None
    return Thresholds.from_table(table, where=f"[watch] ({path}) / --threshold")


def find_run(ref: str) -> RunRecord:
    """A registered run, or a local run directory given by path."""
    p = Path(ref)
    if (p / "run.json").is_file():
        return RunRecord(
            run_id=p.resolve().name, name=p.resolve().name, backend="unknown", created_at=p.stat().st_mtime,
            config="", hosts=[HostRecord(node_rank=0, host=None, run_dir=str(p.resolve()))],
        )  # fmt: skip
    return Registry().find(ref)


def _view(session: WatchSession) -> Group:
    parts: list[Any] = []
    for hw in session.hosts:
        if hw.snap is None:
            continue
        title = f"{session.rec.run_id} node {hw.host.node_rank} on {hw.host.host or 'this machine'}"
        if hw.snap.job.get("watch_lock") == "other":
            title += "  (read-only: another watch acts on this run)"
        parts += [Rule(title), render_dashboard(hw.snap, hw.findings, stale_s=session.thresholds.stale_s)]
        for a in hw.actor.done[-3:]:
            parts.append(f"action {time.strftime('%H:%M:%S', time.localtime(a['t']))} {a['action']} "
                         f"{a['subject']}: {a['detail']}" + ("" if a["ok"] else f" FAILED: {a.get('error')}"))  # fmt: skip
    return Group(*parts)


def register(app: typer.Typer) -> None:
    @app.command("watch")
    def watch_cmd(
        run: Annotated[str, typer.Argument(help="Run id, id prefix, name, or a local run directory.")],
        interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 1.0,
        restart: Annotated[
            bool, typer.Option("--restart/--no-restart", help="Kill hung drafters, relaunch a stopped job.")
        ] = True,
        restart_targets: Annotated[bool, typer.Option(help="Also act on hung targets.")] = False,
        once: Annotated[
            bool, typer.Option(help="One snapshot, then exit 0 healthy / 1 warnings / 2 critical.")
        ] = False,
        as_json: Annotated[bool, typer.Option("--json", help="With --once: the snapshot as JSON.")] = False,
        prometheus: Annotated[
            str | None,
            typer.Option(help="Serve the snapshot as Prometheus gauges on [HOST:]PORT (127.0.0.1)."),
        ] = None,
        threshold: Annotated[
            list[str] | None,
            typer.Option("--threshold", help="Detector threshold key=value (see docs/watch.md)."),
        ] = None,
        grace: Annotated[
            float, typer.Option(help="Seconds between SIGTERM and SIGKILL of a hung drafter.")
        ] = 15.0,
        fake_nvml: Annotated[
            str | None,
            typer.Option(help="A FakeNVML JSON spec on the host (tests, GPU-less demos).", hidden=True),
        ] = None,
    ) -> None:
        """Watch a run: NVML per GPU and worker, queues and throughput, findings in plain words; act on them."""
        code = 0
        with cli_errors(), remote.connections():
            if interval <= 0:
                raise RunnerError("--interval must be > 0")
            rec = find_run(run)
            thresholds = thresholds_from(threshold or [])
            policy = Policy(restart=restart and not once, restart_targets=restart_targets, grace_s=grace)
            exporter = None
            if prometheus:
                from runner.watch.prometheus import PrometheusExporter, parse_bind

                host, port = parse_bind(prometheus)
                exporter = PrometheusExporter(host=host, port=port)
            session = WatchSession(
                rec, interval_s=interval, thresholds=thresholds, policy=policy, once=once, fake_nvml=fake_nvml
            )
            try:
                if once:
                    wait_first(session, timeout=30)
                    code = session.exit_code()
                    if as_json:
                        out = [
                            {"node_rank": hw.host.node_rank, "host": hw.host.host or "local",
                             **snapshot_json(hw.snap, hw.findings)}
                            for hw in session.hosts if hw.snap is not None
                        ]  # fmt: skip
                        typer.echo(
                            json.dumps({"run_id": rec.run_id, "exit_code": code, "hosts": out}, default=str)
                        )
                    else:
                        console.print(_view(session))
                else:
                    code = _live(session, exporter)
            finally:
                session.close()
        raise typer.Exit(code)


def _live(session: WatchSession, exporter: Any) -> int:
    tty = sys.stdout.isatty()
    screen: _LiveAdapter | _Plain = (
        _LiveAdapter(Live(console=console, auto_refresh=False)) if tty else _Plain()
    )
    with screen as live:
        try:
            while True:
                session.refresh(timeout=session.interval_s)
                if exporter is not None:
                    for hw in session.hosts:
                        if hw.snap is not None:
                            exporter.update(hw.snap, hw.findings)
                changed = _signature(session)
                live.update(_view(session), refresh=True, changed=changed)
                if session.finished():
                    break
        except KeyboardInterrupt:
            pass
    for b in session.record_baseline():
        err_console.print(
            f"baseline updated: {b.tok_s:,.0f} tok/s for this fingerprint and config", highlight=False
        )
    return session.exit_code()


def _signature(session: WatchSession) -> object:
    return tuple((tuple(sorted(f.key for f in hw.findings)), len(hw.actor.done)) for hw in session.hosts)


class _LiveAdapter:
    def __init__(self, live: Live) -> None:
        self.live = live

    def __enter__(self) -> _LiveAdapter:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.live.__exit__(*exc)

    def update(self, renderable: Any, refresh: bool = True, changed: object = None) -> None:
        self.live.update(renderable, refresh=refresh)


class _Plain:
    """Off a tty: the dashboard printed once every 30 s (a log, not a screen)."""

    def __init__(self) -> None:
        self.last = 0.0
        self.seen: object = None

    def __enter__(self) -> _Plain:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, renderable: Any, refresh: bool = True, changed: object = None) -> None:
        """Printed when the findings or actions change, and every 30 s."""
        if changed != self.seen or time.monotonic() - self.last >= 30:
            console.print(renderable)
            self.last, self.seen = time.monotonic(), changed
