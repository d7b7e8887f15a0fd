"""Where each file of the run directory lives (docs/run-directory.md), named once for the runner.

Every runner module that opens, tails, copies or names a file of a run directory takes its name from
here; the job writes them (dflash/rundir.py and dflash/manifest.py hold its side of the contract).
Paths are relative to the run directory, with `/` separators, so the same name serves a local Path,
a remote shell line and an advice string.

Stdlib only and importing nothing: the watch sampler, bundled onto GPU hosts that have nothing but
python3, reads it too (runner/watch/bundle.py).
"""

from __future__ import annotations

RUN_JSON = "run.json"
"""The manifest: config, hosts, command lines, the runner's record."""
JOB_LOCK = "job.lock"
"""flock held by the running job; holds its pid."""
METRICS = "metrics.jsonl"
"""One status record per status interval."""
EVENTS = "events.jsonl"
"""Lifecycle events (the job's, watch's, dflashctl's)."""
WORKERS = "workers"
"""One heartbeat per worker: workers/<role>-<index>.json."""
DATA_POSITION_SUFFIX = ".data.json"
"""workers/target-<i>.data.json: a target's data position, not a heartbeat."""
LOGS = "logs"
"""Each worker's stdout+stderr: logs/<worker>.log."""
SUPERVISOR = "supervisor"
"""The log name of the launch supervisor (logs/supervisor.log)."""
WATCH = "watch"
WATCH_LOCK = f"{WATCH}/lock"
"""flock held by the acting `dflashctl watch`'s sampler."""
SAMPLES = f"{WATCH}/samples.jsonl"
"""GPU and worker readings, one record per watch refresh (for `report`)."""

REPORTED = (RUN_JSON, METRICS, EVENTS, SAMPLES)
"""What `report` reads, and copies from a remote host (never the checkpoints or logs)."""


def log(worker: str) -> str:
    """The log of a worker ("drafter-0", "target-1", "drafter-group-node0", "data", "supervisor")."""
    return f"{LOGS}/{worker}.log"


def group_log(node: int) -> str:
    """torchrun's own output for the drafter group on host `node`."""
    return log(f"drafter-group-node{node}")


SUPERVISOR_LOG = log(SUPERVISOR)
DRAFTER_LOGS = log("drafter-*")
"""A glob over the drafters' logs (for advice: `read logs/drafter-*.log`)."""


def is_heartbeat(file_name: str) -> bool:
    """Whether a file in workers/ is a heartbeat: not a data position, not a temp file (dot file)."""
    return (
        not file_name.startswith(".")
        and file_name.endswith(".json")
        and not file_name.endswith(DATA_POSITION_SUFFIX)
    )
