"""A stand-in for the `pynvml` module, for tests and GPU-less machines: the same functions NVML
calls, answering from per-GPU settings (memory, utilization, processes, clock-event reasons, ECC,
XID events), and able to fail the way real GPUs do: NotSupported fields, a missing function version,
a lost GPU, a call that hangs until released, processes that have already exited.

Standard library only: the sampler ships it to the GPU host with nvml.py (`--fake-nvml SPEC.json`).
"""

from __future__ import annotations

import collections
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

NOT_SUPPORTED = 3
NOT_FOUND = 6
UNINITIALIZED = 1
TIMEOUT = 10
GPU_IS_LOST = 15


class FakeNVMLError(Exception):
    """Like pynvml.NVMLError: the NVML return code in `.value`."""

    def __init__(self, value: int) -> None:
        super().__init__(f"fake NVML error {value}")
        self.value = value


@dataclass
class FakeGPU:
    name: str = "NVIDIA H200"
    uuid: str = ""
    """Empty: GPU-fake-<index>."""
    mem_total_mb: float = 143771.0
    mem_used_mb: float = 0.0
    util_gpu: int = 0
    util_mem: int = 0
    temp_c: int = 35
    power_w: float = 80.0
    sm_clock_mhz: int = 1980
    clock_reasons: int = 0
    """nvmlClocksEventReasons bitmask, e.g. 0x8 (hw slowdown) | 0x40 (hw thermal)."""
    ecc_mode: bool | None = True
    """None: ECC is not supported (consumer GPUs)."""
    ecc_uncorrected: int = 0
    ecc_corrected: int = 0
    procs: list[Any] = field(default_factory=list)
    """Compute processes as [pid, MiB] pairs (MiB None: not reported); host pids, as NVML gives."""
    graphics_procs: list[Any] = field(default_factory=list)
    not_supported: set[str] = field(default_factory=set)
    """Function names that raise NotSupported on this GPU, e.g. {"nvmlDeviceGetPowerUsage"}."""
    hang: set[str] = field(default_factory=set)
    """Function names that block on this GPU until FakeNVML.release()."""
    lost: bool = False
    """Every call on this GPU fails with NVML_ERROR_GPU_IS_LOST."""


class _Handle:
    """A device handle: equal for the same device, as pynvml's pointers hold the same address."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Handle) and other.index == self.index

    def __hash__(self) -> int:
        return hash(("fake-nvml-device", self.index))

    def __repr__(self) -> str:
        return f"<fake GPU handle {self.index}>"


def _ns(**kw: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**kw)


class FakeNVML:
    NVMLError = FakeNVMLError

    def __init__(
        self,
        gpus: list[FakeGPU],
        *,
        init_error: int | None = None,
        missing: set[str] | None = None,
        xid_supported: bool = True,
        hang: set[str] | None = None,
    ) -> None:
        self.gpus = gpus
        self.hang = set(hang or ())
        """Functions about no one GPU (nvmlDeviceGetCount, nvmlEventSetWait) that block until release()."""
        self.init_error = init_error
        self.missing = set(missing or ())
        """Functions this 'pynvml' does not have (an older nvidia-ml-py), e.g. the _v3 process calls."""
        self.xid_supported = xid_supported
        self.initialised = False
        self.calls: collections.Counter[str] = collections.Counter()
        self.event_waits_ms: list[int] = []
        """The timeout of every nvmlEventSetWait, in order."""
        self._released = threading.Event()
        self._pending_xids: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> FakeNVML:
        """From JSON: {"gpus": [{FakeGPU fields}], "missing": [...], "xid_supported": bool, "xids": [[gpu, xid]],
        "hang": [...]}."""
        gpus = []
        for g in spec.get("gpus", []):
            g = dict(g)
            for key in ("not_supported", "hang"):
                g[key] = set(g.get(key, ()))
            gpus.append(FakeGPU(**g))
        fake = cls(
            gpus,
            missing=set(spec.get("missing", ())),
            xid_supported=spec.get("xid_supported", True),
            hang=set(spec.get("hang", ())),
        )
        for gpu, xid in spec.get("xids", []):
            fake.inject_xid(gpu, xid)
        return fake

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml") and name in object.__getattribute__(self, "missing"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    # ---- test controls -------------------------------------------------------------------------

    def release(self) -> None:
        """Let every hung call return (and later ones not hang)."""
        self._released.set()

    def inject_xid(self, gpu: int, xid: int) -> None:
        with self._lock:
            self._pending_xids.append((gpu, xid))

    # ---- behaviour shared by every call --------------------------------------------------------

    def _enter(self, name: str, handle: _Handle | None = None) -> FakeGPU | None:
        self.calls[name] += 1
        if not self.initialised:
            raise FakeNVMLError(UNINITIALIZED)
        gpu = None if handle is None else self.gpus[handle.index]
        if name in (self.hang if gpu is None else gpu.hang) and not self._released.is_set():
            self._released.wait()
        if gpu is not None:
            if gpu.lost:
                raise FakeNVMLError(GPU_IS_LOST)
            if name in gpu.not_supported:
                raise FakeNVMLError(NOT_SUPPORTED)
        return gpu

    # ---- the pynvml functions NVML calls -------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise FakeNVMLError(2)
        return _Handle(index)

    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetIndex", handle)
        return handle.index

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return self._gpu("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return self._gpu("nvmlDeviceGetUUID", handle).uuid or f"GPU-fake-{handle.index}"

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Any:
        g = self._gpu("nvmlDeviceGetMemoryInfo_v2" if version else "nvmlDeviceGetMemoryInfo", handle)
        total, used = int(g.mem_total_mb * 2**20), int(g.mem_used_mb * 2**20)
        return _ns(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> Any:
        g = self._gpu("nvmlDeviceGetUtilizationRates", handle)
        return _ns(gpu=g.util_gpu, memory=g.util_mem)

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        return self._gpu("nvmlDeviceGetTemperature", handle).temp_c

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        return int(self._gpu("nvmlDeviceGetPowerUsage", handle).power_w * 1000)

    def nvmlDeviceGetClockInfo(self, handle: _Handle, clock: int) -> int:
        return self._gpu("nvmlDeviceGetClockInfo", handle).sm_clock_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetCurrentClocksEventReasons", handle).clock_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetCurrentClocksThrottleReasons", handle).clock_reasons

    def nvmlDeviceGetEccMode(self, handle: _Handle) -> list[int]:
        g = self._gpu("nvmlDeviceGetEccMode", handle)
        if g.ecc_mode is None:
            raise FakeNVMLError(NOT_SUPPORTED)
        return [int(g.ecc_mode), int(g.ecc_mode)]

    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, error_type: int, counter: int) -> int:
        g = self._gpu("nvmlDeviceGetTotalEccErrors", handle)
        return g.ecc_uncorrected if error_type == 1 else g.ecc_corrected

    def _procs(self, name: str, handle: _Handle, graphics: bool) -> list[Any]:
        g = self._gpu(name, handle)
        out = []
        for pid, mib in g.graphics_procs if graphics else g.procs:
            out.append(_ns(pid=pid, usedGpuMemory=None if mib is None else int(mib * 2**20)))
        return out

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: _Handle) -> list[Any]:
        return self._procs("nvmlDeviceGetComputeRunningProcesses_v3", handle, False)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: _Handle) -> list[Any]:
        return self._procs("nvmlDeviceGetComputeRunningProcesses_v2", handle, False)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        return self._procs("nvmlDeviceGetComputeRunningProcesses", handle, False)

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: _Handle) -> list[Any]:
        return self._procs("nvmlDeviceGetGraphicsRunningProcesses_v3", handle, True)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: _Handle) -> list[Any]:
        return self._procs("nvmlDeviceGetGraphicsRunningProcesses_v2", handle, True)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: _Handle) -> list[Any]:
        return self._procs("nvmlDeviceGetGraphicsRunningProcesses", handle, True)

    def nvmlDeviceGetPcieThroughput(self, handle: _Handle, counter: int) -> int:
        self._gpu("nvmlDeviceGetPcieThroughput", handle)
        return 1000 + counter

    def nvmlEventSetCreate(self) -> Any:
        self._enter("nvmlEventSetCreate")
        if not self.xid_supported:
            raise FakeNVMLError(NOT_SUPPORTED)
        return _ns(kind="fake event set")

    def nvmlDeviceRegisterEvents(self, handle: _Handle, event_types: int, event_set: Any) -> None:
        self._gpu("nvmlDeviceRegisterEvents", handle)

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:
        self._enter("nvmlEventSetWait")
        self.event_waits_ms.append(timeout_ms)
        with self._lock:
            if self._pending_xids:
                gpu, xid = self._pending_xids.pop(0)
                return _ns(device=_Handle(gpu), eventType=0x8, eventData=xid)
        time.sleep(timeout_ms / 1000.0)  # as the real wait: nothing happened within the timeout
        raise FakeNVMLError(TIMEOUT)

    def _gpu(self, name: str, handle: _Handle) -> FakeGPU:
        gpu = self._enter(name, handle)
        assert gpu is not None
        return gpu
