"""Which process a heartbeat names, whether it lives, and what it uses (CPU, RSS), across pid namespaces.

A heartbeat carries the pid the worker sees (`os.getpid()`), which inside a container is a pid of
the container's namespace; NVML and a sampler on the host see host pids. /proc/<pid>/status has
`NSpid:` listing the process's pid in every namespace it belongs to, outermost (the reader's) first,
so the last field is the pid the worker itself sees: that maps a host pid to a heartbeat pid. Pids
are reused, so a process is matched by start time too: it began before the heartbeat's `started_at`
(written after the worker's imports) and not long before.

Standard library only, psutil used when installed: this file runs on the GPU host inside the sampler.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "disk-sleep",
    "T": "stopped",
    "t": "tracing-stop",
    "Z": "zombie",
    "X": "dead",
    "I": "idle",
}
"""/proc state letters in psutil's words, so both paths report the same."""
GONE_STATES = ("zombie", "dead")


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    """In the reader's namespace."""
    state: str
    start_time: float
    """Unix time."""
    cpu_s: float
    """User + system CPU seconds."""
    rss_bytes: int
    nspid: tuple[int, ...]
    """The pid in each namespace, the reader's first, the process's own last."""


class ProcFS:
    """Reads one /proc (a synthetic directory in tests)."""

    def __init__(self, root: str | Path = "/proc") -> None:
        self.root = Path(root)
        self._btime: float | None = None
        self._tick = os.sysconf("SC_CLK_TCK")
        self._page = os.sysconf("SC_PAGE_SIZE")

    @property
    def boot_time(self) -> float:
        if self._btime is None:
            for line in (self.root / "stat").read_text().splitlines():
                if line.startswith("btime "):
                    self._btime = float(line.split()[1])
                    break
            else:
                raise OSError(f"no btime in {self.root / 'stat'}")
        return self._btime

    def read(self, pid: int) -> ProcInfo | None:
        try:
            stat = (self.root / str(pid) / "stat").read_text()
            status = (self.root / str(pid) / "status").read_text()
        except OSError:
            return None
        try:
            f = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
            start = self.boot_time + int(f[19]) / self._tick
            cpu = (int(f[11]) + int(f[12])) / self._tick
            rss = int(f[21]) * self._page
        except (IndexError, ValueError, OSError):
            return None
        nspid: tuple[int, ...] = (pid,)
        for line in status.splitlines():
            if line.startswith("NSpid:"):
                nspid = tuple(int(x) for x in line.split()[1:]) or (pid,)
                break
        return ProcInfo(pid, _STATES.get(f[0], f[0]), start, cpu, rss, nspid)

    def pids(self) -> list[int]:
        try:
            return [int(n) for n in os.listdir(self.root) if n.isdigit()]
        except OSError:
            return []

    def innermost_pid(self, pid: int) -> int | None:
        """The pid the process sees itself as (inside its container), from NSpid's last field."""
        info = self.read(pid)
        return None if info is None else info.nspid[-1]


def _psutil() -> Any:
    try:
        import psutil
    except ImportError:
        return None
    return psutil


class ProcessProbe:
    """Resolves heartbeat pids to processes of this namespace and measures them, once per sample."""

    def __init__(
        self,
        proc_root: str | Path = "/proc",
        *,
        use_psutil: bool | None = None,
        start_slack_s: float = 2.0,
        max_start_lead_s: float = 1800.0,
        rescan_s: float = 10.0,
        hostname: str | None = None,
    ) -> None:
        self.fs = ProcFS(proc_root)
        # psutil reads the real /proc only: a synthetic root means the /proc path.
        self._ps: Any = _psutil() if use_psutil is not False and str(proc_root) == "/proc" else None
        self.start_slack_s = start_slack_s
        """A process's kernel start time may lie this far after started_at (clock granularity)."""
        self.max_start_lead_s = max_start_lead_s
        """...and this far before it (imports, model load, rendezvous before the heartbeat starts)."""
        self.rescan_s = rescan_s
        self.hostname = hostname or socket.gethostname()
        self._resolved: dict[tuple[int, float], tuple[int, float]] = {}
        self._failed_scan: dict[tuple[int, float], float] = {}
        self._gone: set[tuple[int, float]] = set()
        self._cpu: dict[tuple[int, float], tuple[float, float]] = {}

    @property
    def uses_psutil(self) -> bool:
        return self._ps is not None

    def _fits(self, info: ProcInfo | None, started_at: float) -> bool:
        return (
            info is not None
            and info.state not in GONE_STATES
            and started_at - self.max_start_lead_s <= info.start_time <= started_at + self.start_slack_s
        )

    def resolve(
        self, pid: int, started_at: float, host: str = "", candidates: Iterable[int] = ()
    ) -> int | None:
        """The pid in this namespace of the live process a heartbeat names, or None (gone, a zombie,
        or a reused pid). `candidates` (the GPU processes NVML lists) are tried before a full scan."""
        key = (pid, started_at)
        if key in self._gone:
            return None
        if key in self._resolved:
            host_pid, start = self._resolved[key]
            info = self.fs.read(host_pid)
            if info is not None and info.start_time == start and info.state not in GONE_STATES:
                return host_pid
            del self._resolved[key]
            self._gone.add(key)  # found once, gone now: that process never comes back
            return None
        same = self.fs.read(pid)
        # The writer sees itself as `pid`, so a match in this namespace must too (NSpid's last).
        same_fits = same is not None and self._fits(same, started_at) and same.nspid[-1] == pid
        if same_fits and host in ("", self.hostname):
            return self._remember(key, pid, same)
        nested = self._nested(pid, started_at, candidates)
        if nested is not None:
            return self._remember(key, nested.pid, nested)
        return self._remember(key, pid, same) if same_fits else None

    def _nested(self, pid: int, started_at: float, candidates: Iterable[int]) -> ProcInfo | None:
        """A process of a nested pid namespace (a container) that sees itself as `pid`."""

        def best(pids: Iterable[int]) -> ProcInfo | None:
            hits = []
            for p in pids:
                info = self.fs.read(p)
                if (
                    info is not None
                    and len(info.nspid) > 1
                    and info.nspid[-1] == pid
                    and self._fits(info, started_at)
                ):
                    hits.append(info)
            return max(hits, key=lambda i: i.start_time) if hits else None

        found = best(candidates)
        key = (pid, started_at)
        if found is None and time.monotonic() - self._failed_scan.get(key, -1e18) >= self.rescan_s:
            found = best(self.fs.pids())
            if found is None:
                self._failed_scan[key] = time.monotonic()
        return found

    def _remember(self, key: tuple[int, float], host_pid: int, info: ProcInfo | None) -> int:
        assert info is not None
        self._resolved[key] = (host_pid, info.start_time)
        self._failed_scan.pop(key, None)
        return host_pid

    def measure(self, host_pid: int) -> dict[str, Any]:
        """{alive, proc_state, cpu_percent, rss_mb} of a resolved process; cpu_percent over the time
        since the previous measure (None the first time)."""
        reading = self._read_psutil(host_pid) if self._ps is not None else self._read_procfs(host_pid)
        if reading is None:
            return {"alive": False, "proc_state": "gone", "cpu_percent": None, "rss_mb": None}
        state, start, cpu_s, rss = reading
        now = time.monotonic()
        key = (host_pid, start)
        prev = self._cpu.get(key)
        self._cpu[key] = (cpu_s, now)
        percent = None
        if prev is not None and now > prev[1]:
            percent = round(100.0 * (cpu_s - prev[0]) / (now - prev[1]), 1)
        return {
            "alive": state not in GONE_STATES,
            "proc_state": state,
            "cpu_percent": percent,
            "rss_mb": round(rss / 2**20, 1),
        }

    def _read_procfs(self, pid: int) -> tuple[str, float, float, int] | None:
        info = self.fs.read(pid)
        return None if info is None else (info.state, info.start_time, info.cpu_s, info.rss_bytes)

    def _read_psutil(self, pid: int) -> tuple[str, float, float, int] | None:
        ps: Any = self._ps
        try:
            proc = ps.Process(pid)
            with proc.oneshot():
                times = proc.cpu_times()
                return proc.status(), proc.create_time(), times.user + times.system, proc.memory_info().rss
        except ps.ZombieProcess:
            return "zombie", 0.0, 0.0, 0
        except (ps.NoSuchProcess, ps.AccessDenied):
            return self._read_procfs(pid)  # AccessDenied: /proc may still say enough

    def forget_except(self, keys: Iterable[tuple[int, float]]) -> None:
        """Drop state of heartbeats that are gone (a restarted worker writes a new pid)."""
        keep = set(keys)
        for d in (self._resolved, self._failed_scan):
            for k in [k for k in d if k not in keep]:
                del d[k]
        self._gone &= keep
        live = {v[0] for v in self._resolved.values()}
        for k in [k for k in self._cpu if k[0] not in live]:
            del self._cpu[k]


def lock_holder_pids(path: str | Path, proc_root: str | Path = "/proc") -> list[int] | None:
    """Pids holding an flock on `path`, from /proc/locks (no lock is taken: a monitor briefly
    holding the job's lock could make a starting job refuse its own run directory). None when
    /proc/locks cannot be read."""
    try:
        st = os.stat(path)
        text = (Path(proc_root) / "locks").read_text()
    except OSError:
        return None
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in text.splitlines():
        f = line.split()
        # "1: FLOCK  ADVISORY  WRITE 2660 fe:00:1466913 0 EOF"; blocked waiters carry "->".
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == ident and f[4].lstrip("-").isdigit():
            pids.append(int(f[4]))
    return pids
