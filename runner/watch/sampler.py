"""The sampler: runs on the GPU host and prints one JSON line per interval about one run directory.

    python -m runner.watch.sampler --run-dir RUN_DIR [--interval 1] [--once] [--fake-nvml SPEC.json]
    ssh HOST python3 - --run-dir RUN_DIR ...   with bundle.bundle_source() on stdin: the same code

Each line (schema version 1; NA fields are "n/a"):
    {"v": 1, "t", "host", "run_dir", "run_dir_exists", "interval_s",
     "nvml": "ok" | "not answering" | "unavailable: <why>",
     "nvml_stuck": [{"gpu" (null: about no one GPU), "call", "for_s"}]   NVML calls not returned,
     "gpus": [{"index", "name", "uuid", "mem_used_mb", "mem_total_mb" (MiB), "util_gpu", "util_mem" (%),
               "temp_c", "power_w", "sm_clock_mhz", "throttle": [words], "ecc_mode",
               "ecc_uncorrected", "ecc_corrected", "procs": [{"pid" (host pid), "mem_mb"}],
               "faults": {function: fault}, "stuck_call", "stuck_s" (only while its call hangs)}],
     "xid": [{"t", "gpu", "xid"}] | "n/a",
     "workers": {"drafter-0": {<heartbeat fields>, "age_s", "progress_age_s", "uptime_s",
                 "state_age_s", "host_pid", "alive", "proc_state", "cpu_percent", "rss_mb",
                 "gpu_index", "gpu_mem_mb", "gpu_match": "pid" | "uuid" | "device" | null}},
     "metrics": [metrics.jsonl records appended since the previous line],
     "events": [events.jsonl records since the previous line, without `batch` debugging records],
     "job": {"lock_pid", "lock_held": bool | "n/a"},
     "manifest": {run.json}      only on the first line and when run.json changes,
     "sampler": {"pid", "psutil", "seconds"},
     "damage": [a line per damaged file, or file with records skipped],
     "source_errors": [{"source", "error"}]   a source that raised: the line goes out without it,
     "watch_lock": "held" | "other" | "off"}
With --keep, the sampler takes `<run dir>/watch/lock` (an flock: one acting watch per run, held for
the sampler's life, released by the kernel however it ends) and, while it holds it, appends a compact
GPU and worker record per line to `<run dir>/watch/samples.jsonl` for `dflashctl report`.
The first line carries a backlog: the newest metrics and events already in the files.
Ages are computed here, on the host's clock, which the job's timestamps use too.

Standard library only (pynvml and psutil when present): runner.watch.bundle ships it to a host.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from runner.rundir import layout
from runner.rundir.schema import (
    ANY_RECORD,
    EVENTS,
    HEARTBEAT,
    METRICS,
    RUN_JSON,
    Schema,
    Tally,
    parse_lines,
    read_record_file,
)
from runner.watch import nvml as nvml_mod
from runner.watch.nvml import NA, NVML, known
from runner.watch.procinfo import ProcessProbe, lock_holder_pids

SCHEMA_VERSION = 1
SKIPPED_EVENTS = ("batch",)
"""Per-batch debugging records (DFLASH_LOG_BATCHES=1): many, and no detector reads them."""


class JsonlTail:
    """Complete records appended to a JSONL file since the last read, by byte offset. A torn last
    line (a writer killed mid-write, or still writing) waits for the next read."""

    def __init__(self, path: Path, first_read_max_bytes: int, kind: Schema = ANY_RECORD) -> None:
        self.path = path
        self.offset: int | None = None  # None: not read yet
        self.first_read_max_bytes = first_read_max_bytes
        self.kind = kind
        self.tally = Tally()
        """Lines skipped so far: not JSON, or not of the record's shape (runner.rundir.schema)."""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if self.offset is None or size < self.offset:  # first read, or the file was replaced
                    start = max(0, size - self.first_read_max_bytes)
                    f.seek(start)
                    data = f.read()
                    if start > 0:  # began mid-line: drop up to the first newline
                        cut = data.find(b"\n") + 1
                        data, start = data[cut:], start + cut
                    self.offset = start
                else:
                    f.seek(self.offset)
                    data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return parse_lines(self.kind, data[:end], self.tally)


def device_index(device: Any) -> int | None:
    """`cuda:5` -> 5, `cuda` -> 0, anything else (cpu) -> None."""
    if not isinstance(device, str) or not device.startswith("cuda"):
        return None
    _, _, idx = device.partition(":")
    return int(idx) if idx.isdigit() else 0


def read_heartbeats(workers_dir: Path, damage: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Each worker's heartbeat of the right shape; a damaged one is skipped, with a line in `damage`."""
    out: dict[str, dict[str, Any]] = {}
    try:
        names = sorted(os.listdir(workers_dir))
    except OSError:
        return out
    for name in names:
        if not layout.is_heartbeat(name):
            continue
        hb, why = read_record_file(workers_dir / name, HEARTBEAT)
        if hb is not None:
            out[name[: -len(".json")]] = hb
        elif why and damage is not None:
            damage.append(why)
    return out


class SamplerState:
    """What one sampler keeps between lines: file offsets, NVML, process probe."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        nvml: NVML | None = None,
        probe: ProcessProbe | None = None,
        interval_s: float = 1.0,
        backlog: int = 360,
        host: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.nvml = nvml if nvml is not None else NVML()
        self.probe = probe if probe is not None else ProcessProbe()
        self.interval_s = interval_s
        self.backlog = backlog
        self.host = host or socket.gethostname()
        self.metrics = JsonlTail(self.run_dir / layout.METRICS, first_read_max_bytes=4 << 20, kind=METRICS)
        self.events = JsonlTail(self.run_dir / layout.EVENTS, first_read_max_bytes=16 << 20, kind=EVENTS)
        self.manifest_damage: str | None = None
        self._manifest_stamp: tuple[int, int] | None = None
        self._first = True
        self.keep = False
        self._lock_fd: int | None = None


def _watch_lock(state: SamplerState) -> str:
    """held | other | off: whether this sampler is the run's acting watch (retried every line, so a
    second watch takes over when the first one exits)."""
    if not state.keep:
        return "off"
    if state._lock_fd is not None:
        return "held"
    import fcntl

    try:
        (state.run_dir / layout.WATCH).mkdir(exist_ok=True)
        fd = os.open(state.run_dir / layout.WATCH_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return "other"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return "other"
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    state._lock_fd = fd
    return "held"


def _keep(state: SamplerState, sample: dict[str, Any]) -> None:
    gpus = [
        {
            k: g.get(k)
            for k in ("index", "util_gpu", "mem_used_mb", "mem_total_mb", "temp_c", "power_w", "throttle")
        }
        for g in sample["gpus"]
    ]
    workers = {
        name: {k: w.get(k) for k in ("state", "step", "alive", "gpu_index")}
        for name, w in sample["workers"].items()
    }
    line = dumps({"t": sample["t"], "host": sample["host"], "gpus": gpus, "workers": workers}) + "\n"
    try:
        fd = os.open(state.run_dir / layout.SAMPLES, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())  # one O_APPEND write per record, as the job writes its files
        finally:
            os.close(fd)
    except OSError:
        pass  # a full disk must not stop the monitor


def _manifest_if_changed(state: SamplerState) -> dict[str, Any] | None:
    path = state.run_dir / layout.RUN_JSON
    try:
        st = path.stat()
    except OSError:
        return None
    stamp = (st.st_mtime_ns, st.st_size)
    if stamp == state._manifest_stamp:
        return None
    manifest, why = read_record_file(path, RUN_JSON)
    state._manifest_stamp = stamp
    state.manifest_damage = why
    return manifest


def _job(run_dir: Path, proc_root: Path) -> dict[str, Any]:
    lock = run_dir / layout.JOB_LOCK
    try:
        text = lock.read_text().strip()
    except OSError:
        return {"lock_pid": None, "lock_held": False}
    holders = lock_holder_pids(lock, proc_root)
    return {
        "lock_pid": int(text) if text.isdigit() else None,
        "lock_held": NA if holders is None else bool(holders),
    }


def _attach_gpu(
    w: dict[str, Any], gpus: list[dict[str, Any]], by_pid: dict[int, list[tuple[int, Any]]]
) -> None:
    """Which GPU the worker sits on: by its pid among NVML's processes (exact, also for a worker in
    a container once its host pid is known), else by the heartbeat's gpu_uuid, else its device."""
    dev = device_index(w.get("device"))
    hits = by_pid.get(w["host_pid"], []) if w.get("host_pid") is not None else []
    if hits:
        # CUDA may also open a small context on GPU 0: the heartbeat's device, else the most memory.
        # Inside a container cuda:N counts the container's GPUs only, so there the memory decides.
        biggest = max(hits, key=lambda h: h[1] if known(h[1]) else -1)
        same_ns = w["host_pid"] == w.get("pid")
        gpu, mem = next((h for h in hits if h[0] == dev), biggest) if same_ns else biggest
        w.update(gpu_index=gpu, gpu_mem_mb=mem, gpu_match="pid")
        return
    uuid = w.get("gpu_uuid")
    for g in gpus:
        if uuid and g.get("uuid") == uuid:
            w.update(gpu_index=g["index"], gpu_mem_mb=NA, gpu_match="uuid")
            return
    if dev is not None and any(g["index"] == dev for g in gpus):
        w.update(gpu_index=dev, gpu_mem_mb=NA, gpu_match="device")
    else:
        w.update(gpu_index=dev, gpu_mem_mb=NA, gpu_match=None)


def _workers(
    state: SamplerState, now: float, gpus: list[dict[str, Any]], damage: list[str]
) -> dict[str, dict[str, Any]]:
    by_pid: dict[int, list[tuple[int, Any]]] = {}
    for g in gpus:
        if isinstance(g.get("procs"), list):
            for p in g["procs"]:
                by_pid.setdefault(p["pid"], []).append((g["index"], p["mem_mb"]))
    workers = {}
    keys = []
    for name, hb in read_heartbeats(state.run_dir / layout.WORKERS, damage).items():
        w = dict(hb)
        for field, since in (
            ("age_s", "updated_at"),
            ("progress_age_s", "last_progress_at"),
            ("uptime_s", "started_at"),
            ("state_age_s", "state_since"),
        ):
            w[field] = round(now - hb[since], 3) if isinstance(hb.get(since), (int, float)) else None
        pid, started = hb.get("pid"), hb.get("started_at")
        if isinstance(pid, int) and isinstance(started, (int, float)):
            keys.append((pid, float(started)))
            host_pid = state.probe.resolve(pid, float(started), str(hb.get("host", "")), by_pid)
            w["host_pid"] = host_pid
            if host_pid is None:
                w.update(alive=False, proc_state="gone", cpu_percent=None, rss_mb=None)
            else:
                w.update(state.probe.measure(host_pid))
        else:
            w.update(host_pid=None, alive=NA, proc_state=NA, cpu_percent=None, rss_mb=None)
        _attach_gpu(w, gpus, by_pid)
        workers[name] = w
    state.probe.forget_except(keys)
    return workers


class _Sources:
    """Each source of a line read on its own: one that raises (an NVML call, a file, /proc) is an
    entry in the line's `source_errors` and its default, never the end of the sampler (a watch
    without its sampler is blind)."""

    def __init__(self) -> None:
        self.errors: list[dict[str, str]] = []

    def read(self, source: str, fn: Callable[[], Any], default: Any) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - any source's failure is reported, not raised
            self.errors.append({"source": source, "error": f"{type(e).__name__}: {e}"[:300]})
            return default


def sample_once(state: SamplerState) -> dict[str, Any]:
    """One sampler line as a dict (what main prints as JSON)."""
    t0 = time.perf_counter()
    now = time.time()
    src = _Sources()
    gpus = src.read("nvml", state.nvml.read_gpus, [])
    xid = src.read("nvml xid events", state.nvml.poll_xids, NA)
    # The lock before the files: a job writes its last records, then releases job.lock as it exits.
    # Read the other way round, a job that ended between the two reads looked stopped with no
    # "stopped" event (a "not running" warning for a completed job).
    job = src.read(
        layout.JOB_LOCK, lambda: _job(state.run_dir, state.probe.fs.root), {"lock_pid": None, "lock_held": NA}
    )
    damage: list[str] = []
    metrics = src.read(layout.METRICS, state.metrics.read, [])
    events = [
        e for e in src.read(layout.EVENTS, state.events.read, []) if e.get("event") not in SKIPPED_EVENTS
    ]
    if state._first:
        metrics, events = metrics[-state.backlog :], events[-4 * state.backlog :]
    sample: dict[str, Any] = {
        "v": SCHEMA_VERSION,
        "t": now,
        "host": state.host,
        "run_dir": str(state.run_dir),
        "run_dir_exists": state.run_dir.is_dir(),
        "interval_s": state.interval_s,
        "nvml": state.nvml.status,
        "nvml_stuck": state.nvml.stuck_calls(),
        "gpus": gpus,
        "xid": xid,
        "workers": src.read(
            f"{layout.WORKERS}/ (heartbeats, processes)", lambda: _workers(state, now, gpus, damage), {}
        ),
        "metrics": metrics,
        "events": events,
        "job": job,
    }
    manifest = src.read(layout.RUN_JSON, lambda: _manifest_if_changed(state), None)
    if manifest is not None:
        sample["manifest"] = manifest
    # What the readers skipped: damaged files now, and the records skipped since the sampler started.
    damage += [state.manifest_damage] if state.manifest_damage else []
    damage += [t.tally.line(str(t.path)) for t in (state.metrics, state.events) if t.tally.skipped]
    sample["damage"] = damage
    state._first = False
    sample["watch_lock"] = (
        src.read(layout.WATCH_LOCK, lambda: _watch_lock(state), "off") if sample["run_dir_exists"] else "off"
    )
    if sample["watch_lock"] == "held":
        src.read(layout.SAMPLES, lambda: _keep(state, sample), None)
    sample["source_errors"] = src.errors
    sample["sampler"] = {
        "pid": os.getpid(),
        "psutil": state.probe.uses_psutil,
        "seconds": round(time.perf_counter() - t0, 6),
    }
    return sample


def dumps(sample: dict[str, Any]) -> str:
    return json.dumps(sample, default=nvml_mod.json_default, separators=(",", ":"))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflashctl-sampler", description="Print one JSON line per interval.")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--once", action="store_true")
    ap.add_argument("--backlog", type=int, default=360, help="metrics records sent on the first line")
    ap.add_argument("--deadline", type=float, default=0.5, help="seconds an NVML call may take")
    ap.add_argument("--fake-nvml", help="JSON spec of a FakeNVML (tests, GPU-less machines)")
    ap.add_argument("--keep", action="store_true", help="take the watch lock; keep samples in the run dir")
    args = ap.parse_args(argv)
    backend = None
    if args.fake_nvml:
        from runner.watch.fakenvml import FakeNVML

        backend = FakeNVML.from_spec(json.loads(Path(args.fake_nvml).read_text()))
    state = SamplerState(
        args.run_dir,
        nvml=NVML(backend, deadline_s=args.deadline),
        interval_s=args.interval,
        backlog=args.backlog,
    )
    state.keep = args.keep
    next_at = time.monotonic()
    try:
        while True:
            try:
                line = dumps(sample_once(state))
            except Exception as e:  # noqa: BLE001 - a line that cannot be made is said, and the next one tried
                # On stderr, which watch merges into its noise: with no sample for sampler_silent_s
                # it becomes a critical finding quoting this line.
                sys.stderr.write(f"sampler: no sample this interval: {type(e).__name__}: {e}\n")
                sys.stderr.flush()
                if args.once:
                    return 1
            else:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
                if args.once:
                    return 0
            next_at += args.interval
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind (a slow NVML, a stopped sampler): do not burst to catch up
                next_at, delay = time.monotonic(), 0.0
            time.sleep(delay)
    except (BrokenPipeError, KeyboardInterrupt):
        # The watcher went away (ssh closed): exit quietly, without a second error flushing stdout.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
