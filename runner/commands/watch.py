"""`dflashctl watch RUN`: live health of a run (GPUs by worker, pipeline, findings), acting on it."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Annotated

import typer

from runner.cache.settings import config_path, config_table
from runner.console import cli_errors, console
from runner.envs import tomllib
from runner.errors import BadInput
from runner.exec import remote
from runner.launch.registry import HostRecord, Registry, RunRecord
from runner.rundir import layout
from runner.watch.actions import Policy
from runner.watch.dashboard import snapshot_json
from runner.watch.live import run_live, view
from runner.watch.session import WatchSession, wait_first
from runner.watch.thresholds import Thresholds


def thresholds_from(overrides: list[str]) -> Thresholds:
    """`[watch]` of dflashctl's config file, then --threshold key=value (CLI > file > defaults)."""
    table = config_table("watch")
    for o in overrides:
        key, sep, value = o.partition("=")
        if not sep:
            raise BadInput(f"--threshold {o!r}: use key=value, e.g. --threshold hung_s=60")
        try:
            table[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            raise BadInput(f"--threshold {o!r}: {value!r} is not a number") from None
    return Thresholds.from_table(table, where=f"[watch] ({config_path()}) / --threshold")


def find_run(ref: str) -> RunRecord:
    """A registered run, or a local run directory given by path."""
    p = Path(ref)
    if (p / layout.RUN_JSON).is_file():
        return RunRecord(
            run_id=p.resolve().name, name=p.resolve().name, backend="unknown", created_at=p.stat().st_mtime,
            config="", hosts=[HostRecord(node_rank=0, host=None, run_dir=str(p.resolve()))],
        )  # fmt: skip
    return Registry().find(ref)


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
        max_restarts: Annotated[
            int,
            typer.Option(
                help="Kills and relaunches allowed per --restart-window; beyond that watch only reports."
            ),
        ] = Policy().max_actions,
        restart_window: Annotated[
            float, typer.Option(help="Seconds over which --max-restarts is counted.")
        ] = Policy().window_s,
        fake_nvml: Annotated[
            str | None,
            typer.Option(help="A FakeNVML JSON spec on the host (tests, GPU-less demos).", hidden=True),
        ] = None,
    ) -> None:
        """Watch a run: NVML per GPU and worker, queues and throughput, findings in plain words; act on them."""
        code = 0
        with cli_errors(), remote.connections():
            if not math.isfinite(interval) or interval <= 0:
                raise BadInput(f"--interval must be a number of seconds above 0 (got {interval})")
            if not math.isfinite(grace) or grace < 0:
                raise BadInput(f"--grace must be a number of seconds, 0 or more (got {grace})")
            if max_restarts < 0 or not math.isfinite(restart_window) or restart_window <= 0:
                raise BadInput("--max-restarts must be >= 0 and --restart-window > 0 (seconds)")
            if as_json and not once:
                raise BadInput(
                    "--json prints one snapshot: use it with --once; for a live feed use --prometheus"
                )
            if prometheus and once:
                raise BadInput(
                    "--prometheus serves the live snapshot while watch runs: drop --once, "
                    "or use --once --json for one snapshot"
                )
            rec = find_run(run)
            thresholds = thresholds_from(threshold or [])
            policy = Policy(restart=restart and not once, restart_targets=restart_targets, grace_s=grace,
                            max_actions=max_restarts, window_s=restart_window)  # fmt: skip
            with contextlib.ExitStack() as stack:
                exporter = None
                if prometheus:
                    from runner.watch.prometheus import PrometheusExporter, parse_bind

                    host, port = parse_bind(prometheus)
                    exporter = stack.enter_context(PrometheusExporter(host=host, port=port))
                session = WatchSession(rec, interval_s=interval, thresholds=thresholds, policy=policy,
                                       once=once, fake_nvml=fake_nvml)  # fmt: skip
                stack.callback(session.close)
                if once:
                    wait_first(session, timeout=30)
                    code = session.exit_code()
                    if as_json:
                        out = [
                            {**snapshot_json(hw.snap, hw.findings), "node_rank": hw.host.node_rank,
                             "ssh_host": hw.host.host}
                            for hw in session.hosts if hw.snap is not None
                        ]  # fmt: skip
                        typer.echo(
                            json.dumps({"run_id": rec.run_id, "exit_code": code, "hosts": out}, default=str)
                        )
                    else:
                        console.print(view(session))
                else:
                    code = run_live(session, exporter)
        raise typer.Exit(code)
