"""NVML behind one choke point: `NVML.call`.

Every NVML function goes through `call`, which
- initialises NVML lazily (and retries a failed init now and then: a driver may come back),
- runs the function on a worker thread and waits at most `deadline_s`: a failing GPU can block an
  NVML call for minutes, and the dashboard must keep refreshing. A call that misses its deadline
  is stuck: `stuck_calls()` names its GPU, the function and for how long, and the GPU's reading
  says so (`stuck_call`, `stuck_s`). Later calls about that GPU answer NA at once instead of
  queueing behind it, and the other GPUs are read on a fresh thread. A stuck call about no one GPU
  (init, the count, XID events), or four stuck calls, make the status "not answering". One GPU's
  1 Hz reading runs as one batch on that thread under one deadline (its calls still go through
  `call`), because a thread handoff per call would cost more CPU than the calls,
- turns every failure (NotSupported, NotFound, no permission, a function the driver lacks, a lost
  GPU) into the NA sentinel instead of raising; faults worth a finding (GPU lost, reset required)
  are remembered per GPU.

The backend is the `pynvml` module (nvidia-ml-py) or anything with the same functions, such as
`runner.watch.fakenvml.FakeNVML` for tests and GPU-less machines.

Standard library only (pynvml is imported lazily): this file runs on the GPU host, sent to
`python3 -` by the sampler. Not thread-safe: one sampler loop owns one NVML.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any


class _NotAvailable:
    """The value of a field NVML cannot give: unsupported, unavailable or not answering."""

    _instance: _NotAvailable | None = None
    __slots__ = ()

    def __new__(cls) -> _NotAvailable:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "n/a"

    __str__ = __repr__

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "NA"


NA: Any = _NotAvailable()
NA_TEXT = "n/a"
"""How NA is written in JSON (and shown): consumers test fields with `known()`."""


def known(x: Any) -> bool:
    return x is not None and x is not NA and x != NA_TEXT


def json_default(x: Any) -> Any:
    if x is NA:
        return NA_TEXT
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


# ABI constants of nvml.h (stable across driver versions), so the fake need not define them.
TEMPERATURE_GPU = 0
CLOCK_SM = 1
VOLATILE_ECC = 0
MEMORY_ERROR_CORRECTED = 0
MEMORY_ERROR_UNCORRECTED = 1
MEMORY_V2 = 0x02000028
EVENT_XID_CRITICAL = 0x8
PCIE_TX_BYTES = 0
PCIE_RX_BYTES = 1

# Error codes that mean the GPU itself is in trouble: kept as a fault, not only turned into NA.
FAULT_CODES = {
    11: "interrupt request issue",
    14: "corrupted infoROM",
    15: "GPU is lost",
    16: "GPU requires reset",
    999: "unknown NVML error",
}
_INIT_HINTS = {
    9: "driver not loaded",
    12: "libnvidia-ml.so not found",
    18: "driver/library version mismatch (reboot after a driver update)",
}

CLOCK_REASONS = (
    (0x001, "idle"),
    (0x002, "app clocks"),
    (0x004, "power cap"),
    (0x008, "hw slowdown"),
    (0x010, "sync boost"),
    (0x020, "sw thermal"),
    (0x040, "hw thermal"),
    (0x080, "power brake"),
    (0x100, "display clocks"),
    (0x200, "board limit"),
    (0x400, "reliability"),
)
"""Bits of nvmlDeviceGetCurrentClocksEventReasons (formerly ...ThrottleReasons), in words."""


def _handle_key(h: Any) -> Any:
    """A device handle as a dictionary key: pynvml's are ctypes pointers, a new object per call for
    the same device, so their address; anything else (a test's fake) as itself."""
    import ctypes

    try:
        return ("ptr", ctypes.cast(h, ctypes.c_void_p).value)
    except (ctypes.ArgumentError, TypeError):
        try:
            hash(h)
        except TypeError:
            return ("id", id(h))
        return ("obj", h)


def decode_clock_reasons(mask: Any) -> Any:
    if not isinstance(mask, int):
        return NA
    return [word for bit, word in CLOCK_REASONS if mask & bit]


_ALL = "nvml"
"""The stuck-call key of a call about no one GPU (init, the count, XID events): it blocks them all."""

_tls = threading.local()
"""Per NVML thread: the runner it serves and the job it runs (whose `call` names the call in flight)."""


class _Job:
    __slots__ = ("fn", "args", "kwargs", "done", "value", "error", "key", "call", "since")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, key: Any, call: str) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.key = key
        self.call = call
        """The NVML function running now: a batch updates it call by call, so a stuck one names it."""
        self.since = 0.0


class _DeadlineRunner:
    """Runs calls on a daemon thread; the caller waits at most deadline_s for each. A daemon, so a
    call stuck in the driver never keeps the process from exiting.

    A call that misses its deadline is stuck under its key (a GPU index, or _ALL): its thread is
    left to it (it exits once the call returns) and the next call gets a fresh thread, so one GPU
    whose calls hang leaves the others readable. Calls under a stuck key answer None at once. A stuck
    _ALL call, or max_stuck stuck calls (threads left behind), make NVML not answering as a whole."""

    def __init__(self, deadline_s: float, max_stuck: int = 4) -> None:
        self.deadline_s = deadline_s
        self.max_stuck = max_stuck
        self._jobs: queue.SimpleQueue[_Job] | None = None
        self._thread: threading.Thread | None = None
        self.stuck: dict[Any, _Job] = {}

    def _loop(self, jobs: queue.SimpleQueue[_Job]) -> None:
        _tls.runner = self
        me = threading.current_thread()
        while True:
            job = jobs.get()
            _tls.job = job
            try:
                job.value = job.fn(*job.args, **job.kwargs)
            except BaseException as e:  # handed to the caller, who decides
                job.error = e
            job.done.set()
            if self._thread is not me:  # left behind while its call was stuck: a fresh thread took over
                return

    def on_worker(self) -> bool:
        return getattr(_tls, "runner", None) is self

    def _prune(self) -> None:
        """Forget the stuck calls that have returned since."""
        for k in [k for k, job in self.stuck.items() if job.done.is_set()]:
            del self.stuck[k]

    def answering(self, key: Any = None) -> bool:
        """NVML as a whole answers (key None), or calls about this key (a GPU index) can be made."""
        self._prune()
        if _ALL in self.stuck or len(self.stuck) >= self.max_stuck:
            return False
        return key is None or key not in self.stuck

    def stuck_calls(self) -> list[dict[str, Any]]:
        """[{gpu, call, for_s}] for each call that has not returned (gpu None: about no one GPU)."""
        self._prune()
        now = time.time()
        return [
            {"gpu": None if k == _ALL else k, "call": job.call, "for_s": round(now - job.since, 1)}
            for k, job in sorted(self.stuck.items(), key=lambda kv: str(kv[0]))
        ]

    def run(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict, *, key: Any = None, call: str = ""
    ) -> _Job | None:
        """The finished job, or None when calls about `key` (None: any) are stuck, now or before."""
        key = _ALL if key is None else key
        if not self.answering(None if key == _ALL else key):
            return None
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=self._loop, args=(self._jobs,), name="nvml-calls", daemon=True
            )
            self._thread.start()
        job = _Job(fn, args, kwargs, key, call or getattr(fn, "__name__", "call"))
        self._jobs.put(job)
        if job.done.wait(self.deadline_s):
            return job
        job.since = time.time() - self.deadline_s
        self.stuck[key] = job
        self._thread = self._jobs = None  # that thread is the stuck call's now
        return None


def load_pynvml() -> Any:
    import pynvml  # nvidia-ml-py

    return pynvml


def _text(x: Any) -> Any:
    return x.decode(errors="replace") if isinstance(x, bytes) else x


class NVML:
    def __init__(
        self,
        backend: Any = None,
        *,
        deadline_s: float = 0.5,
        retry_init_s: float = 30.0,
        loader: Callable[[], Any] = load_pynvml,
    ) -> None:
        self._backend = backend
        self._loader = loader
        self._runner = _DeadlineRunner(deadline_s)
        self._retry_init_s = retry_init_s
        self._ready = False
        self._unavailable: str | None = None
        self._init_tried_at = -1e18
        self._handles: dict[int, Any] = {}
        self._known: dict[int, dict[str, Any]] = {}
        """Each GPU's last readable name and uuid: a GPU that falls off the bus keeps them in findings."""
        self._xid_index: dict[Any, int] = {}
        """Registered handles -> index: an XID of a lost GPU is placed where nvmlDeviceGetIndex fails."""
        self._count: Any = NA
        self._proc_calls: dict[str, str] = {}
        self._events: Any = None  # None: not registered yet; NA: XID events unsupported
        self.faults: dict[int, dict[str, str]] = {}
        """Per GPU index: {function: fault} for calls that failed with a GPU fault code."""

    # ---- the choke point -----------------------------------------------------------------------

    def stuck_calls(self) -> list[dict[str, Any]]:
        """The NVML calls that have not returned: [{gpu (None: about no one GPU), call, for_s}]."""
        return self._runner.stuck_calls()

    @property
    def status(self) -> str:
        if not self._runner.answering():
            return "not answering"
        if self._unavailable is not None:
            return f"unavailable: {self._unavailable}"
        return "ok" if self._ready else "unavailable: not initialised"

    def _ensure(self) -> bool:
        if self._ready:
            return True
        if time.monotonic() - self._init_tried_at < self._retry_init_s or not self._runner.answering():
            return False
        self._init_tried_at = time.monotonic()
        if self._backend is None:
            try:
                self._backend = self._loader()
            except ImportError:
                self._unavailable = "nvidia-ml-py (pynvml) is not installed"
                return False
        job = self._runner.run(self._backend.nvmlInit, (), {})
        if job is None:
            return False
        if job.error is not None:
            code = getattr(job.error, "value", -1)
            self._unavailable = _INIT_HINTS.get(code) or str(job.error) or type(job.error).__name__
            return False
        self._ready, self._unavailable = True, None
        return True

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """backend.<name>(*args, **kwargs), or NA if it is missing, fails or does not answer in time."""
        if self._runner.on_worker():  # inside a batch (one GPU's reading) that runs under the deadline
            fn = getattr(self._backend, name, None) if self._ready else None
            if fn is None:
                return NA
            _tls.job.call = name
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                return self._failed(name, e)
        if not self._ensure():
            return NA
        fn = getattr(self._backend, name, None)
        if fn is None:
            return NA
        job = self._runner.run(fn, args, kwargs, call=name)
        if job is None:
            return NA
        return job.value if job.error is None else self._failed(name, job.error)

    def _failed(self, name: str, error: BaseException) -> Any:
        fault = FAULT_CODES.get(getattr(error, "value", -1))
        gpu = _tls.job.key if self._runner.on_worker() else None
        if fault and isinstance(gpu, int):  # within a GPU's batch
            self.faults.setdefault(gpu, {})[name] = fault
        return NA

    # ---- readings ------------------------------------------------------------------------------

    def device_count(self) -> Any:
        if not known(self._count):
            self._count = self.call("nvmlDeviceGetCount")
        return self._count

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            h = self.call("nvmlDeviceGetHandleByIndex", index)
            if h is NA:
                return NA
            self._handles[index] = h
        return self._handles[index]

    def read_gpu(self, index: int) -> dict[str, Any]:
        """One GPU's 1 Hz reading; every field is a value or NA. Memory in MiB (as nvidia-smi).
        Its calls run as one batch on the NVML thread, under one deadline (a handoff per call would
        cost more than the calls): a stuck call leaves the fields read before it, the rest NA."""
        out: dict[str, Any] = {"index": index}
        job = self._runner.run(self._read_gpu, (index, out), {}, key=index) if self._ensure() else None
        if job is None or job.error is not None:
            out = dict(out)  # the stuck batch may still write into the original
            for k in _GPU_FIELDS:
                out.setdefault(k, NA)
            out.setdefault("faults", {})
            stuck = self._runner.stuck.get(index)
            if stuck is not None and not stuck.done.is_set():
                out["stuck_call"] = stuck.call
                out["stuck_s"] = round(time.time() - stuck.since, 1)
        known = self._known.setdefault(index, {})
        for k in ("name", "uuid"):
            if isinstance(out.get(k), str) and out[k]:
                known[k] = out[k]
            elif k in known:
                out[k] = known[k]  # the name and uuid do not change; a lost GPU no longer says them
        return out

    def _read_gpu(self, index: int, out: dict[str, Any]) -> None:
        self.faults.pop(index, None)
        h = self._handle(index)
        if h is NA:
            out.update({k: NA for k in _GPU_FIELDS})
            out["faults"] = dict(self.faults.get(index, {}))
            return
        out["name"] = _text(self.call("nvmlDeviceGetName", h))
        out["uuid"] = _text(self.call("nvmlDeviceGetUUID", h))
        mem = self.call("nvmlDeviceGetMemoryInfo", h, version=MEMORY_V2)
        if mem is NA:  # drivers before 510 have only v1 (which counts reserved memory as used)
            mem = self.call("nvmlDeviceGetMemoryInfo", h)
        out["mem_used_mb"] = NA if mem is NA else mem.used / 2**20
        out["mem_total_mb"] = NA if mem is NA else mem.total / 2**20
        util = self.call("nvmlDeviceGetUtilizationRates", h)
        out["util_gpu"] = NA if util is NA else util.gpu
        out["util_mem"] = NA if util is NA else util.memory
        out["temp_c"] = self.call("nvmlDeviceGetTemperature", h, TEMPERATURE_GPU)
        power_mw = self.call("nvmlDeviceGetPowerUsage", h)
        out["power_w"] = NA if power_mw is NA else power_mw / 1000.0
        out["sm_clock_mhz"] = self.call("nvmlDeviceGetClockInfo", h, CLOCK_SM)
        reasons = self.call("nvmlDeviceGetCurrentClocksEventReasons", h)
        if reasons is NA:  # the name before driver 535
            reasons = self.call("nvmlDeviceGetCurrentClocksThrottleReasons", h)
        out["throttle"] = decode_clock_reasons(reasons)
        out.update(self._ecc(h))
        out["procs"] = self._processes(h)
        out["faults"] = dict(self.faults.get(index, {}))

    def _ecc(self, h: Any) -> dict[str, Any]:
        mode = self.call("nvmlDeviceGetEccMode", h)
        enabled = NA if mode is NA else bool(mode[0])
        if not enabled:
            return {"ecc_mode": enabled, "ecc_uncorrected": NA, "ecc_corrected": NA}
        return {
            "ecc_mode": True,
            "ecc_uncorrected": self.call(
                "nvmlDeviceGetTotalEccErrors", h, MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC
            ),
            "ecc_corrected": self.call(
                "nvmlDeviceGetTotalEccErrors", h, MEMORY_ERROR_CORRECTED, VOLATILE_ECC
            ),
        }

    def _processes(self, h: Any) -> Any:
        """[{pid, mem_mb}] over compute and graphics contexts (host pids, as NVML reports them)."""
        by_pid: dict[int, Any] = {}
        answered = False
        for kind in ("Compute", "Graphics"):
            procs = NA
            # The version that answered last time first: the others would fail every second.
            names = [f"nvmlDeviceGet{kind}RunningProcesses{v}" for v in ("_v3", "_v2", "")]
            if kind in self._proc_calls:
                names.insert(0, self._proc_calls[kind])
            for name in names:
                procs = self.call(name, h)
                if procs is not NA:
                    self._proc_calls[kind] = name
                    break
            if procs is NA:
                continue
            answered = True
            for p in procs:
                used = getattr(p, "usedGpuMemory", None)  # None: not reported (WDDM, some vGPUs)
                if used is not None:
                    by_pid[p.pid] = max(by_pid.get(p.pid) or 0.0, used / 2**20)
                else:
                    by_pid.setdefault(p.pid, NA)
        if not answered:
            return NA
        return [{"pid": pid, "mem_mb": mem} for pid, mem in sorted(by_pid.items())]

    def read_gpus(self) -> list[dict[str, Any]]:
        count = self.device_count()
        return [] if count is NA else [self.read_gpu(i) for i in range(count)]

    def poll_xids(self, wait_ms: int = 10, max_events: int = 32) -> Any:
        """XID events since the last poll as [{t, gpu, xid}], or NA when this host cannot report
        them. The event set is registered once; each poll waits at most wait_ms for the first."""
        if self._events is None:
            self._events = self._register_xid_events()
        if self._events is None or self._events is NA:
            return NA
        out = []
        for _ in range(max_events):
            data = self.call("nvmlEventSetWait", self._events, wait_ms)
            if data is NA:  # NVML_ERROR_TIMEOUT: nothing (more) happened
                break
            gpu = self.call("nvmlDeviceGetIndex", data.device)
            if gpu is NA:  # the GPU the XID is about may be the one that no longer answers
                gpu = self._xid_index.get(_handle_key(data.device), NA)
            known = self._known.get(gpu, {}) if isinstance(gpu, int) else {}
            out.append({"t": time.time(), "gpu": gpu, "xid": int(data.eventData), **known})
            wait_ms = 0
        return out

    def _register_xid_events(self) -> Any:
        count = self.device_count()
        if count is NA:
            return None if self.status != "ok" else NA  # retried once NVML answers
        events = self.call("nvmlEventSetCreate")
        if events is NA:
            return NA
        registered = 0
        for i in range(count):
            h = self._handle(i)
            if h is not NA and self.call("nvmlDeviceRegisterEvents", h, EVENT_XID_CRITICAL, events) is None:
                registered += 1
                self._xid_index[_handle_key(h)] = i
        return events if registered else NA

    def pcie_throughput(self, index: int) -> dict[str, Any]:
        """PCIe KB/s over the last 20 ms. The call itself blocks ~20 ms: never on the 1 Hz path."""
        h = self._handle(index)
        if h is NA:
            return {"tx_kbps": NA, "rx_kbps": NA}
        return {
            "tx_kbps": self.call("nvmlDeviceGetPcieThroughput", h, PCIE_TX_BYTES),
            "rx_kbps": self.call("nvmlDeviceGetPcieThroughput", h, PCIE_RX_BYTES),
        }

    def close(self) -> None:
        if self._ready and self._runner.answering():
            self.call("nvmlShutdown")
        self._ready = False


_GPU_FIELDS = (
    "name",
    "uuid",
    "mem_used_mb",
    "mem_total_mb",
    "util_gpu",
    "util_mem",
    "temp_c",
    "power_w",
    "sm_clock_mhz",
    "throttle",
    "ecc_mode",
    "ecc_uncorrected",
    "ecc_corrected",
    "procs",
)
