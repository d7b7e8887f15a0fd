"""torchrun as the launcher starts it: `python -m torch.distributed.run`'s own main and command line,
leaving without the interpreter's last garbage collections like the job's other processes
(dflash.exiting): the supervisor sees the drafter group's end only once this process has exited.

    python -m dflash.pipeline.torchrun [torchrun options] -m dflash.pipeline.drafter_worker ...

While the job is stopping (the launcher's stop file exists), a failed drafter group is not restarted.
The agent also stamps its side of a restart into the environment its workers inherit: when it
noticed the failure, when the old workers were stopped, and when it spawned the new ones
(dflash.pipeline.timeline: the first phases of a generation's `generation_start` event).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.run import main

from dflash.exiting import without_final_gc
from dflash.pipeline import STOP_FILE_ENV
from dflash.pipeline.timeline import DETECTED_AT_ENV, SPAWNED_AT_ENV, STOPPED_AT_ENV


def _stamp_before(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def stamped(self: Any, *args: Any, **kwargs: Any) -> Any:
        os.environ[name] = repr(time.time())
        return fn(self, *args, **kwargs)

    return stamped


def _stamp_after(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def stamped(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = fn(self, *args, **kwargs)
        os.environ[name] = repr(time.time())
        return out

    return stamped


def _no_restart_while_stopping(fn: Callable[..., Any]) -> Callable[..., Any]:
    """While the job is stopping (the launcher's stop file exists), a failed group is not restarted:
    its restarts are set to none, so the agent's next look finds it failed, stops the other
    workers and exits non-zero. A drafter that died during the final checkpoint is a death."""

    @functools.wraps(fn)
    def restart(self: Any, *args: Any, **kwargs: Any) -> Any:
        stop_file = os.environ.get(STOP_FILE_ENV)
        if stop_file and os.path.exists(stop_file):
            print(
                f"dflash: the job is stopping ({stop_file}): the failed drafter group is not restarted",
                flush=True,
            )
            self._remaining_restarts = 0
            return None
        return fn(self, *args, **kwargs)

    return restart


def stamp_agent() -> None:
    """_restart_workers runs as soon as the monitor loop sees a failure; it stops the workers, meets
    the other agents (rendezvous) and starts the new workers (_start_workers), whose environment
    is a copy of this process's at that moment."""
    simple: Any = SimpleElasticAgent
    local: Any = LocalElasticAgent  # the agent torchrun runs; it implements stop and start
    simple._restart_workers = _stamp_before(
        DETECTED_AT_ENV, _no_restart_while_stopping(simple._restart_workers)
    )
    local._stop_workers = _stamp_after(STOPPED_AT_ENV, local._stop_workers)
    local._start_workers = _stamp_before(SPAWNED_AT_ENV, local._start_workers)


if __name__ == "__main__":
    stamp_agent()  # and the stop file's rule
    with without_final_gc():
        main()
