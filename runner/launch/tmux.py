"""tmux backend: one session per run on each host (named from the run id), a window per host's
supervisor; the supervisor's output also goes to logs/supervisor.log in the run directory."""

from __future__ import annotations

from typing import Any

from runner.errors import RunnerError
from runner.exec import remote
from runner.launch.backend import Backend
from runner.launch.plan import HostPlan, shell_line
from runner.launch.registry import backend_name


def require(host: str | None) -> None:
    proc = remote.run(host, ["sh", "-c", "command -v tmux"], check=False, timeout=60)
    if proc.returncode != 0:
        raise RunnerError(
            f"tmux is not installed on {host or 'this machine'}: install it (apt-get install tmux), "
            "or use --backend foreground or --backend docker"
        )


def session_exists(host: str | None, session: str) -> bool:
    return remote.run(host, ["tmux", "has-session", "-t", f"={session}"], check=False).returncode == 0


def start_argv(hp: HostPlan, *, new_session: bool) -> list[str]:
    """The tmux command (as the host runs it). With several hosts on one machine the second window
    joins the session the first one made."""
    assert hp.tmux_session and hp.tmux_window
    cmd = ["sh", "-c", shell_line(hp, log=True)]
    if new_session:
        return ["tmux", "new-session", "-d", "-s", hp.tmux_session, "-n", hp.tmux_window, *cmd]
    return ["tmux", "new-window", "-d", "-t", f"={hp.tmux_session}:", "-n", hp.tmux_window, *cmd]


def start(hp: HostPlan) -> None:
    assert hp.tmux_session
    new = not session_exists(hp.host, hp.tmux_session)
    remote.run(hp.host, start_argv(hp, new_session=new), timeout=60)


def attach_argv(host: str | None, session: str, window: str | None) -> list[str]:
    target = f"={session}" + (f":{window}" if window else "")
    return remote.remote_argv(host, ["tmux", "attach-session", "-t", target], tty=True)


def kill(host: str | None, session: str) -> None:
    remote.run(host, ["tmux", "kill-session", "-t", f"={session}"], check=False, timeout=60)


def window_alive(host: str | None, session: str, window: str | None) -> bool:
    proc = remote.run(
        host, ["tmux", "list-windows", "-t", f"={session}", "-F", "#{window_name}"], check=False, timeout=60
    )
    return proc.returncode == 0 and (window is None or window in proc.stdout.decode().split())


class TmuxBackend(Backend):
    """One tmux session per run on each host, a window per host's supervisor."""

    name = "tmux"
    relaunchable = True

    def require(self, host: str | None, req: Any, facts: Any) -> None:
        require(host)

    def name_host(self, hp: Any, *, run_id: str, facts: Any, config: dict[str, Any]) -> None:
        hp.tmux_session, hp.tmux_window = backend_name(run_id), f"node{hp.node_rank}"

    def start(self, hp: Any, plan: Any) -> None:
        start(hp)

    def alive(self, h: Any) -> bool | None:
        return window_alive(h.host, h.tmux_session, h.tmux_window) if h.tmux_session else None

    def kill(self, h: Any) -> None:
        if h.tmux_session:
            kill(h.host, h.tmux_session)

    def launcher_pids(self, h: Any) -> list[int]:
        if not h.tmux_session:
            return []
        target = f"={h.tmux_session}" + (f":{h.tmux_window}" if h.tmux_window else "")
        proc = remote.run(
            h.host, ["tmux", "list-panes", "-t", target, "-F", "#{pane_pid}"], check=False, timeout=60
        )
        return [int(p) for p in proc.stdout.decode().split() if p.isdigit()] if proc.returncode == 0 else []

    def attach_argv(self, run_id: str, h: Any) -> list[str]:
        if not h.tmux_session:
            return super().attach_argv(run_id, h)
        return attach_argv(h.host, h.tmux_session, h.tmux_window)

    def relaunch(self, run_id: str, hp: Any) -> None:
        start(hp)

    def describe(self, hp: Any) -> list[tuple[str, str]]:
        return [("tmux", f"{hp.tmux_session}:{hp.tmux_window}")]


BACKEND = TmuxBackend()
