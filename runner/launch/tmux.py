"""tmux backend: one session per run on each host (named from the run id), a window per host's
supervisor; the supervisor's output also goes to logs/supervisor.log in the run directory."""

from __future__ import annotations

from runner.errors import RunnerError
from runner.exec import remote
from runner.launch.plan import HostPlan, shell_line


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
