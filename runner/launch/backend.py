"""The one interface every launch backend implements: where a run's supervisors start, and how
ps, logs, stop, attach and relaunch reach them again.

A backend is one module under runner/launch/ named as its --backend value, holding `BACKEND`, an
instance of a Backend subclass; NAMES lists them. The rest of the runner asks `get(name)` and never
spells a backend's name. `h` below is a host's plan (launch.plan.HostPlan) or its registry record
(launch.registry.HostRecord): both carry `host` and the backend's handles (`tmux_session` and
`tmux_window`, `container`), which the backend itself sets in `name_host` at planning time and the
registry keeps for every later verb.
"""

from __future__ import annotations

import importlib
from typing import Any

from runner.errors import BadInput, RunnerError

NAMES = ("tmux", "docker", "foreground")
"""Every backend, as --backend spells it; each is runner/launch/<name>.py."""


class Backend:
    """The defaults are a backend that holds no handle on its supervisor: the run directory and the
    recorded pids decide whether it is alive, signals go to those pids, and there is nothing to
    attach to or relaunch."""

    name = ""
    in_container = False
    """The job runs in a container: the host's paths are mounted in, --image is its image, and the
    job's pids are in the container's namespace (signals go through the backend)."""
    runs_here = False
    """The supervisor runs in the launching terminal: `run` starts it itself (foreground.run), so
    apply prepares and registers only."""
    relaunchable = False
    """`relaunch` starts a stopped host's supervisor again (watch's relaunch action needs it)."""

    def require(self, host: str | None, req: Any, facts: Any) -> None:
        """Refuse, in one line naming the fix, a host that lacks what this backend needs; record in
        `facts` (launch.plan.HostFacts) what planning needs from the host."""

    def name_host(self, hp: Any, *, run_id: str, facts: Any, config: dict[str, Any]) -> None:
        """Set the handles (and what else this backend needs in the plan) on a host's plan."""

    def start(self, hp: Any, plan: Any) -> None:
        raise RunnerError(f"--backend {self.name} starts in the launching terminal, not through apply")

    def alive(self, h: Any) -> bool | None:
        """Whether the backend's handle on the supervisor is still running; None: no handle, the
        run directory decides."""
        return None

    def signal(self, h: Any, sig: str) -> bool:
        """Send SIG (TERM, KILL) to the supervisor through the backend; False: the backend cannot,
        and the caller signals the recorded pids."""
        return False

    def kill(self, h: Any) -> None:
        """Remove what still runs of the host's supervisor after the recorded pids were killed."""

    def remove(self, h: Any) -> None:
        """Undo a start (a launch failed on a later host): nothing of it may be left."""
        self.kill(h)

    def launcher_pids(self, h: Any) -> list[int]:
        """Pids of what the backend started around the supervisor (a tmux pane's shell): what a stop
        can still reach before the supervisor has recorded anything."""
        return []

    def logs_argv(self, h: Any, *, lines: int, follow: bool) -> list[str] | None:
        """argv printing the supervisor's output; None: logs/supervisor.log in the run directory."""
        return None

    def attach_argv(self, run_id: str, h: Any) -> list[str]:
        raise RunnerError(
            f"{run_id} runs in the foreground of the terminal that started it: nothing to attach to; "
            f"`dflashctl logs {run_id} --follow` shows its output"
        )

    def locate(self, run_id: str, h: Any) -> Any:
        """`h` (a host's record) with the handles the backend finds now for this run and node by
        its own tags, where they differ from the recorded ones; `h` itself where it tags nothing."""
        return h

    def found(self, host: str | None, registry: str) -> list[tuple[str, str]]:
        """(handle, run id) of everything this backend started on host from the registry whose
        ident is `registry` (launch.registry.Registry.ident), found by its own tags whatever the
        registry holds now: what `ps` matches against its entries."""
        return []

    def stray(self, where: str, handle: str, run_id: str) -> str:
        """The line `ps` prints for a found handle of a run the registry no longer lists."""
        return f"{self.name} {handle} on {where} belongs to run {run_id}, which the registry no longer lists"

    def relaunch(self, run_id: str, hp: Any) -> None:
        raise RunnerError(f"{run_id} ran in the foreground of another terminal: relaunch it there")

    def describe(self, hp: Any) -> list[tuple[str, str]]:
        """(label, value) lines `dflashctl run` prints for a host's plan."""
        return []


def get(name: str) -> Backend:
    """The backend --backend NAME names (runner/launch/NAME.py's BACKEND)."""
    if name not in NAMES:
        raise BadInput(f"--backend {name!r}: use one of {', '.join(NAMES)}")
    backend = importlib.import_module(f"runner.launch.{name}").BACKEND
    assert isinstance(backend, Backend) and backend.name == name, name
    return backend


def of(name: str) -> Backend:
    """The backend a run record names; a record of none this runner knows (a run directory watched
    by its path, recorded as "unknown") gets the handle-less defaults: its run directory and
    recorded pids answer."""
    return get(name) if name in NAMES else Backend()
