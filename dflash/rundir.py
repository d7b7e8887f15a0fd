"""The run directory: the one seam between the job and dflashctl (see docs/run-directory.md).

    <runs root>/<run-id>/
      run.json  metrics.jsonl  events.jsonl  workers/<role>-<index>.json  logs/  checkpoints/

Everything persistent is written atomically (temp file + rename) or appended line by line with
one write() per record, so a reader never sees half a JSON object.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash.errors import DFlashError

RUN_FORMAT = 1
"""run.json's `format`: the version of this directory layout. dflashctl may create the directory
first with a stub run.json of its own ({format, run_id, runner}); the job fills in the rest."""

HEARTBEAT_INTERVAL_S = 1.0
"""Heartbeats are rewritten at least this often (the contract says at least every 2 s)."""

WORKER_STATES = (
    "starting",
    "computing",
    "waiting_input",
    "waiting_output",
    "compiling",
    "checkpointing",
    "stopped",
)


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Temp file + rename: readers see the old content or the new, never part. durable=False skips
    the fsync, for files rewritten every second anyway (heartbeats) whose loss in a crash is moot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def install_dir(tmp: Path, final: Path) -> None:
    """Rename a fully written directory `tmp` into place at `final` (same filesystem). An existing
    `final` is first renamed aside and only then deleted: at every instant `final` is either the
    old complete directory or the new one, never a half-deleted mix."""
    if final.exists():
        aside = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.old-"))
        os.replace(final, aside / "old")
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(tmp, final)


def atomic_write_json(path: Path, obj: Any, *, durable: bool = True) -> None:
    data = (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode()
    atomic_write_bytes(path, data, durable=durable)


def append_jsonl(path: Path, obj: dict[str, Any]) -> None:
    """One record, one O_APPEND write: safe across the processes of one host."""
    line = (json.dumps(obj, default=str, allow_nan=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file; a torn last line (a writer killed mid-write) is skipped."""
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def read_jsonl_from(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Complete records appended since byte `offset`, and the offset to continue from: a tail that
    re-reads nothing (a torn last line is left for the next call)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records, offset + end


def _clean(x: Any) -> Any:
    """JSON has no NaN/inf: they become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


NAME_MAX = 255
"""Bytes in one path component (file or directory name) on Linux filesystems."""


def unusable_reason(path: str | Path, error: OSError | None = None) -> str | None:
    """Why this process cannot create directory `path` (or write in it), in words; None when it can.
    `error`: what creating it raised, which then gives the reason. Without one, nothing is created:
    the nearest existing ancestor is probed with a temp dir removed at once (access() says yes to
    root everywhere, also under /sys, where mkdir fails all the same)."""
    p = Path(path).absolute()
    long = next((part for part in p.parts if len(os.fsencode(part)) > NAME_MAX), None)
    if long is not None:
        shown = long if len(long) <= 24 else f"{long[:24]}..."
        return f"the name {shown!r} is {len(os.fsencode(long))} bytes, longer than the {NAME_MAX} a name may have"
    if error is not None and error.errno == errno.ENAMETOOLONG:
        return f"the path is too long for this filesystem ({len(os.fsencode(str(p)))} bytes)"
    for a in [*reversed(p.parents), p]:
        if not os.path.lexists(a):
            break
        if not os.path.isdir(a):
            return f"{a} is a file, not a directory"
    if error is not None:
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return f"{error.filename or p} is not writable by this user ({error.strerror})"
        where = f": {error.filename}" if error.filename else ""
        return f"{error.strerror or error}{where}"
    existing = next(a for a in (p, *p.parents) if os.path.lexists(a))
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".dflash-probe-"))
    except OSError as e:
        return f"{existing} is not writable by this user ({e.strerror})"
    return None


_HELD_LOCKS: list[int] = []


def held_lock_fds() -> tuple[int, ...]:
    """The run-dir lock fds this process holds: a launcher passes them to its workers, so the lock
    lasts until the job's last process exits, not only its supervisor."""
    return tuple(_HELD_LOCKS)


class RunDir:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def manifest(self) -> Path:
        return self.root / "run.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def workers(self) -> Path:
        return self.root / "workers"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def create(self) -> RunDir:
        for d in (self.root, self.workers, self.logs, self.checkpoints):
            d.mkdir(parents=True, exist_ok=True)
        return self

    @property
    def lock_path(self) -> Path:
        return self.root / "job.lock"

    def hold(self) -> None:
        """Claim the run directory for this process's lifetime and that of the workers it passes the
        lock to (an flock, released by the kernel when the last of them exits, however it exits). A second job on the same directory, such as a relaunch
        while the old supervisor is still stopping, would share its queue name and checkpoints and
        delete the other's files: it is refused, naming the holder."""
        import fcntl

        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DFlashError(
                f"run directory {self.root} is in use by another job (pid {holder}, or workers it "
                "started); stop that job, or pass another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _HELD_LOCKS.append(fd)  # kept open (and locked) until the process exits

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        atomic_write_json(self.manifest, manifest)

    def read_manifest(self) -> dict[str, Any]:
        return json.loads(self.manifest.read_text())

    def event(self, name: str, /, **fields: Any) -> dict[str, Any]:
        rec = {"t": time.time(), "event": name, "host": socket.gethostname(), "pid": os.getpid(), **fields}
        append_jsonl(self.events, _clean(rec))
        return rec

    def metric(self, record: dict[str, Any]) -> None:
        append_jsonl(self.metrics, _clean(record))

    def read_events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in read_jsonl(self.events) if kind is None or e.get("event") == kind]

    def read_metrics(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.metrics))

    def heartbeat_path(self, role: str, index: int) -> Path:
        return self.workers / f"{role}-{index}.json"

    def log_path(self, role: str, index: int) -> Path:
        return self.logs / f"{role}-{index}.log"


SUPERVISOR_ENV = "DFLASH_SUPERVISOR"
"""Set by the launcher for its workers: "<pid>:<start time>" of the supervisor process."""


def _proc_stat(pid: int) -> tuple[str, str]:
    """(state, start time in clock ticks since boot) from /proc/<pid>/stat. Unlike a wall-clock
    create time, the start time does not move when the clock is stepped (NTP, VM resume)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return fields[0], fields[19]


def supervisor_token() -> str:
    return f"{os.getpid()}:{_proc_stat(os.getpid())[1]}"


def supervisor_alive(token: str) -> bool:
    """Whether the process named by a supervisor_token() still runs: same pid, same start (a reused
    pid is told apart), and not a zombie (dead, only not yet reaped)."""
    pid, _, started = token.partition(":")
    try:
        state, start = _proc_stat(int(pid))
    except (OSError, ValueError, IndexError):
        return False
    return start == started and state not in ("Z", "X")


class Heartbeat:
    """A worker's heartbeat file, rewritten atomically by a daemon thread every second, also while
    the worker is blocked (waiting for input, compiling). The thread only writes JSON: it never
    touches torch, so it cannot race with compiled work."""

    def __init__(
        self,
        run: RunDir,
        role: str,
        index: int,
        *,
        rank: int | None = None,
        device: str = "cpu",
        interval_s: float = HEARTBEAT_INTERVAL_S,
    ) -> None:
        self.path = run.heartbeat_path(role, index)
        self._lock = threading.Lock()
        now = time.time()
        self._state: dict[str, Any] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "role": role,
            "index": index,
            "rank": rank,
            "device": device,
            "step": 0,
            "state": "starting",
            "state_since": now,
            "last_progress_at": now,
            "updated_at": now,
            "started_at": now,
        }
        self._state_s: dict[str, float] = {}  # seconds spent in each state before the current one
        self._interval = interval_s
        self._write_lock = threading.Lock()  # one write at a time, in order: the final state lands last
        self._supervisor = os.environ.get(SUPERVISOR_ENV)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{role}-{index}", daemon=True)

    def start(self) -> Heartbeat:
        self._write()
        self._thread.start()
        return self

    def set(self, state: str | None = None, *, progress: bool = False, **fields: Any) -> None:
        if state is not None and state not in WORKER_STATES:
            raise ValueError(f"unknown worker state {state!r}")
        with self._lock:
            if state is not None:
                if state != self._state["state"]:
                    now = time.time()
                    old = self._state["state"]
                    self._state_s[old] = self._state_s.get(old, 0.0) + now - self._state["state_since"]
                    self._state["state_since"] = now  # how long a state lasts (watch limits it)
                self._state["state"] = state
            self._state.update(fields)
            if progress:
                self._state["last_progress_at"] = time.time()
        self._write()

    def get(self) -> dict[str, Any]:
        with self._lock:
            return {**self._state, "state_s": self._state_seconds(time.time())}

    def _state_seconds(self, now: float) -> dict[str, float]:
        """Seconds spent in each state since the start, the current one up to now: where a worker's
        time goes (bench/pipeline.py reads the queue waits from two samples of it)."""
        out = dict(self._state_s)
        cur = self._state["state"]
        out[cur] = out.get(cur, 0.0) + max(0.0, now - self._state["state_since"])
        return {k: round(v, 3) for k, v in out.items()}

    def _write(self) -> None:
        with self._write_lock:
            with self._lock:
                now = self._state["updated_at"] = time.time()
                snap = {**self._state, "state_s": self._state_seconds(now)}
            try:
                # No fsync: workers set their state several times a step; the file is a live view.
                atomic_write_json(self.path, _clean(snap), durable=False)
            except OSError:
                pass  # a full disk must not kill training; the watcher sees a stale heartbeat

    def _loop(self) -> None:
        orphaned = False
        while not self._stop.wait(self._interval):
            self._write()
            if self._supervisor and not orphaned and not supervisor_alive(self._supervisor):
                # The supervisor was SIGKILLed or OOM-killed: nobody will stop this worker, which
                # would hold its GPU (and train on, or block on a full queue) indefinitely. Take the
                # graceful path the supervisor's own SIGTERM would have taken.
                orphaned = True
                os.kill(os.getpid(), signal.SIGTERM)

    def stop(self, final_state: str = "stopped") -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.set(final_state)


# ---- status line ---------------------------------------------------------------------------------


def _fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "--"
    if seconds >= 86400:
        return f"{seconds / 86400:.1f}d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 60:.0f}m"


def _fmt(x: Any, spec: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "---"
    return format(x, spec)


def format_status_line(m: dict[str, Any]) -> str:
    """Render a metrics record in the field's status-line format:
    `[23m] step=14 loss=10.6894 acc=0.011 streak=0.0 lr=7.53e-06 noise=0.0006 | tgt=0.11b/s
    dft=0.11b/s (4.6Ktok/s) | q_pre=[50, 46, 48, 46, 47] q_hs=[0] | epoch~0.01 ETA=36.9d`"""
    mins = int(m.get("elapsed_s", 0) // 60)
    tok = m.get("tok_s") or 0.0
    return (
        f"[{mins}m] step={m.get('step', 0)} loss={_fmt(m.get('loss'), '.4f')} acc={_fmt(m.get('acc'), '.3f')} "
        f"streak={_fmt(m.get('streak'), '.1f')} lr={_fmt(m.get('lr'), '.2e')} noise={_fmt(m.get('noise'), '.4f')} | "
        f"tgt={_fmt(m.get('tgt_bps'), '.2f')}b/s dft={_fmt(m.get('dft_bps'), '.2f')}b/s ({tok / 1000:.1f}Ktok/s) | "
        f"q_pre={list(m.get('q_pre', []))} q_hs={list(m.get('q_hs', []))} | "
        f"epoch~{_fmt(m.get('epoch'), '.2f')} ETA={_fmt_duration(m.get('eta_s'))}"
    )


_NUM = r"(---|[-+0-9.eE]+)"
_STATUS_RE = re.compile(
    r"\[(?P<mins>\d+)m\] step=(?P<step>\d+) loss="
    + _NUM
    + r" acc="
    + _NUM
    + r" streak="
    + _NUM
    + r" lr="
    + _NUM
    + r" noise="
    + _NUM
    + r" \| tgt="
    + _NUM
    + r"b/s dft="
    + _NUM
    + r"b/s \((?P<ktok>[0-9.]+)Ktok/s\) \| q_pre=\[(?P<q_pre>[^\]]*)\] q_hs=\[(?P<q_hs>[^\]]*)\] \| "
    r"epoch~" + _NUM + r" ETA=(?P<eta>--|[0-9.]+[mhd])"
)


def parse_status_line(line: str) -> dict[str, Any]:
    """Inverse of format_status_line, for logs of jobs that predate metrics.jsonl (the field's)."""
    m = _STATUS_RE.search(line)
    if not m:
        raise ValueError(f"not a DFlash status line: {line[:120]!r}")
    g = m.groups()

    def num(s: str) -> float | None:
        return None if s == "---" else float(s)

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x.strip()]

    eta = m.group("eta")
    unit = {"m": 60, "h": 3600, "d": 86400}
    eta_s = None if eta == "--" else float(eta[:-1]) * unit[eta[-1]]
    return {
        "elapsed_s": int(m.group("mins")) * 60,
        "step": int(m.group("step")),
        "loss": num(g[2]),
        "acc": num(g[3]),
        "streak": num(g[4]),
        "lr": num(g[5]),
        "noise": num(g[6]),
        "tgt_bps": num(g[7]),
        "dft_bps": num(g[8]),
        "tok_s": float(m.group("ktok")) * 1000,
        "q_pre": ints(m.group("q_pre")),
        "q_hs": ints(m.group("q_hs")),
        "epoch": num(g[12]),
        "eta_s": eta_s,
    }
