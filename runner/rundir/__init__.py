"""The runner's reader of the run directory (docs/run-directory.md), locally or on a host over ssh.

The runner never imports dflash: it reads the files the job writes. One code path for both places:
a POSIX shell script collects everything a refresh needs (run.json, the job.lock holder from
/proc/locks, the tails of metrics.jsonl and events.jsonl, every heartbeat) in one process, run by
`sh` here or through ssh there, and its output is parsed here.
"""

from runner.rundir.reader import (
    RUN_FORMAT,
    WORKER_STATES,
    RunLocation,
    RunView,
    append_event,
    clean_stop,
    last_lifecycle,
    parse_jsonl,
    read_run,
    tail_argv,
    tau_series,
)

__all__ = [
    "RUN_FORMAT",
    "WORKER_STATES",
    "RunLocation",
    "RunView",
    "append_event",
    "clean_stop",
    "last_lifecycle",
    "parse_jsonl",
    "read_run",
    "tail_argv",
    "tau_series",
]
