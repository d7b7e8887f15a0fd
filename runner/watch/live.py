"""The live screen of `dflashctl watch` (and `dflashctl demo`): Rich Live on a terminal; off a tty,
the dashboard printed whenever the findings or actions change, and every 30 s (a log, not a screen)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.rule import Rule

from runner.console import console, err_console
from runner.watch.dashboard import render_dashboard
from runner.watch.session import WatchSession


def view(session: WatchSession) -> Group:
    parts: list[Any] = []
    for hw in session.hosts:
        if hw.snap is None:
            continue
        title = f"{session.rec.run_id} node {hw.host.node_rank} on {hw.host.host or 'this machine'}"
        if hw.snap.job.get("watch_lock") == "other":
            title += "  (read-only: another watch acts on this run)"
        parts += [Rule(title), render_dashboard(hw.snap, hw.findings, stale_s=session.thresholds.stale_s)]
        for a in hw.actor.done[-3:]:
            parts.append(done_line(a))
    return Group(*parts)


def done_line(a: dict[str, Any]) -> str:
    """One line of what watch did (an action) or saw come right (a recovery), for the dashboard."""
    when = time.strftime("%H:%M:%S", time.localtime(a["t"]))
    if a.get("event") == "recovered":
        return f"recovered {when} {a['subject']}: {a['detail']}"
    failed = "" if a["ok"] else f" FAILED: {a.get('error')}"
    return f"action {when} {a['action']} {a['subject']}: {a['detail']}{failed}"


def run_live(
    session: WatchSession,
    exporter: Any = None,
    *,
    on_tick: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Refresh until the run finished for good (or Ctrl-C, or `stop` is set: a caller running this
    in a thread); the exit code of the last findings."""
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
                live.update(lambda: view(session), changed=changed)
                if on_tick is not None:
                    on_tick()
                if session.finished() or (stop is not None and stop.is_set()):
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

    def update(self, build: Callable[[], Any], changed: object = None) -> None:
        self.live.update(build(), refresh=True)


class _Plain:
    """Off a tty: the dashboard printed once every 30 s (a log, not a screen)."""

    def __init__(self) -> None:
        self.last = 0.0
        self.seen: object = None

    def __enter__(self) -> _Plain:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, build: Callable[[], Any], changed: object = None) -> None:
        """Built and printed when the findings or actions change, and every 30 s."""
        if changed != self.seen or time.monotonic() - self.last >= 30:
            console.print(build())
            self.last, self.seen = time.monotonic(), changed
