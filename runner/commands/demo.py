"""`dflashctl demo`: the whole product on this machine's CPU, end to end, in one command.

    dflashctl demo [--steps N] [--backend tmux|foreground] [--no-fault]

1. `run` the CPU demo config (configs/demo-cpu.toml): preflight, --warm (the compile cache is warmed
   into the store and restored into its managed directory), launch in tmux when it is installed,
   else in the foreground of this process.
2. Midway, freeze one drafter (SIGSTOP), as the field's stuck drafters froze.
3. `watch` until the demo finishes: it finds the hung drafter, turns it into a dead one (SIGTERM,
   then SIGKILL), the job's drafter group restarts from its checkpoint with the targets kept, and
   watch checks the recovery.
4. The summary and the path of the report PNG.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from runner.cache.store import Store
from runner.console import cli_errors, console, warn
from runner.envs import project_root
from runner.errors import BadInput, RunnerError
from runner.exec import remote
from runner.launch import foreground
from runner.launch.apply import apply, wait_started
from runner.launch.plan import HostPlan, Request, build_plan, new_run_id
from runner.launch.preflight import preflight
from runner.launch.registry import Registry
from runner.rundir import RunLocation, append_event, layout
from runner.watch.actions import Policy
from runner.watch.live import run_live
from runner.watch.report import build_report, read_jsonl
from runner.watch.session import WatchSession


class FaultInjector:
    """Freezes drafter-0 once it is past `at_step` (its heartbeat names the pid), and records it."""

    def __init__(self, run_dir: str, at_step: int) -> None:
        self.run_dir = Path(run_dir)
        self.at_step = at_step
        self.done = False

    def tick(self) -> None:
        if self.done:
            return
        try:
            hb = json.loads((self.run_dir / "workers" / "drafter-0.json").read_text())
        except (OSError, ValueError):
            return
        if hb.get("step", 0) >= self.at_step and hb.get("state") in ("computing", "waiting_input"):
            os.kill(int(hb["pid"]), signal.SIGSTOP)
            self.done = True
            append_event(
                RunLocation(str(self.run_dir)), "injected", source="demo", subject="drafter-0",
                detail=f"SIGSTOP to pid {hb['pid']} at step {hb['step']}: a frozen drafter, as in the field",
            )  # fmt: skip
            console.print(
                f"[yellow]demo:[/] froze drafter-0 (pid {hb['pid']}) at step {hb['step']}", highlight=False
            )


def foreground_with_watch(
    hosts: list[HostPlan], session: WatchSession, on_tick: Callable[[], None] | None
) -> int:
    """The foreground job in this thread, the main one: foreground.run installs its signal handlers
    there (Python allows them nowhere else), so Ctrl-C reaches the job from the terminal and a
    SIGTERM to dflashctl is forwarded to it. watch runs beside it in a thread, until it saw the job
    finish, or shortly after the job exited (a Ctrl-C also ends the sampler, which then cannot see
    the stop). The exit code is watch's."""
    stop = threading.Event()
    result: dict[str, Any] = {}

    def watch() -> None:
        try:
            # From the job's start: before it, watch would call the run "not running" (and record that).
            if session.wait_running(stop):
                result["code"] = run_live(session, on_tick=on_tick, stop=stop)
        except BaseException as e:  # handed to the main thread below
            result["error"] = e

    thread = threading.Thread(target=watch, name="demo-watch", daemon=True)
    thread.start()
    try:
        # The job's output goes to its log only, not over the dashboard.
        foreground.run(hosts, on_line=lambda prefix, line: None)
    finally:
        thread.join(timeout=30)  # time for watch to read the job's last records and its stop
        stop.set()
        thread.join(timeout=30)
    if "error" in result:
        raise result["error"]
    return int(result.get("code", 0))


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo_cmd(
        steps: Annotated[int, typer.Option(help="Optimizer steps of the demo job.")] = 300,
        backend: Annotated[
            str | None, typer.Option(help="tmux (default when installed) or foreground.")
        ] = None,
        fault: Annotated[bool, typer.Option("--fault/--no-fault", help="Freeze a drafter midway.")] = True,
        runs_root: Annotated[str, typer.Option(help="Where the demo's run directory goes.")] = "runs",
    ) -> None:
        """The CPU demo end to end: warm the cache, run, freeze a drafter midway, watch it recover, report."""
        with cli_errors(), remote.connections():
            if steps < 10:
                raise BadInput("--steps must be >= 10 (the fault comes at half way)")
            backend = backend or ("tmux" if shutil.which("tmux") else "foreground")
            if backend not in ("tmux", "foreground"):
                raise BadInput("--backend: the demo runs in tmux or in the foreground")
            config = project_root() / "configs" / "demo-cpu.toml"
            sets = [f"train.total_steps={steps}", f"train.checkpoint_every={max(5, steps // 6)}",
                    "run.status_interval_s=2"]  # fmt: skip
            req = Request(config=str(config), backend=backend, name="demo", sets=sets, warm=True,
                          runs_root=runs_root, python=sys.executable, own_env=True)  # fmt: skip
            run_id = new_run_id("demo")
            store = Store()
            console.print(f"[bold]1. run[/] {run_id}: checks, compile cache (--warm), launch in {backend}")
            facts = preflight(req, run_id=run_id, name="demo", store=store, warn=warn)
            plan = build_plan(req, facts, run_id=run_id, config_name=config.stem)
            rec = apply(
                plan, req, store=store, registry=Registry(), progress=lambda m: console.print(f"   {m}")
            )
            hp = plan.hosts[0]
            if backend == "tmux" and wait_started(plan, timeout=8.0):
                raise RunnerError(f"the demo job exited at once; see `dflashctl logs {run_id}`")
            console.print(
                f"[bold]2. watch[/] {'(drafter-0 freezes at step ' + str(steps // 2) + ')' if fault else ''}"
            )
            injector = FaultInjector(hp.run_dir, steps // 2) if fault else None
            session = WatchSession(rec, interval_s=1.0, policy=Policy())
            try:
                on_tick = injector.tick if injector else None
                if backend == "foreground":
                    code = foreground_with_watch(plan.hosts, session, on_tick)
                else:
                    code = run_live(session, on_tick=on_tick)
            finally:
                session.close()
            out = Path(hp.run_dir) / "report.png"
            summary = build_report(Path(hp.run_dir), out)
            console.print("[bold]3. report[/]")
            for line in summary.lines:
                console.print(f"   {line}", highlight=False)
            if summary.taus and summary.taus[-1].get("drafter"):
                console.print(
                    f"   tau again: {sys.executable} -m dflash.eval {summary.taus[-1]['drafter']}",
                    highlight=False,
                )
            console.print(f"   report: {out}", highlight=False)
            console.print(f"   run directory: {hp.run_dir}   (dflashctl ps --all; dflashctl report {run_id})")
            recovered = any(
                e.get("event") == "recovered" for e in read_jsonl(Path(hp.run_dir) / layout.EVENTS)
            )
            if summary.stop_reason != "completed":
                raise RunnerError(
                    f"the demo job did not complete ({summary.stop_reason}); see dflashctl logs {run_id}"
                )
            if fault and not recovered:
                raise RunnerError(
                    "the frozen drafter was not recovered; see the findings above and events.jsonl"
                )
            console.print(
                f"[green]demo done[/]: trained {summary.steps} steps"
                + (
                    ", survived a frozen drafter (watch killed it, the group restarted, training went on)"
                    if fault
                    else ""
                )
                + f"; watch's last exit code {code}",
                highlight=False,
            )
