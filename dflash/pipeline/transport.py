"""Bounded hidden-state queue in shared memory between target workers and drafter workers of one host.

The targets are not children of the drafters' launcher (torchrun), so the queue is a named file in
/dev/shm that unrelated processes map with mmap. A plain file (not multiprocessing.shared_memory)
keeps Python's resource_tracker out of it: no process but the supervisor's `unlink()` ever removes it.

Layout: a control block (header counters + one record per slot) and `capacity` data slots. Every
change to the control block happens under an `fcntl.flock` on the segment's own file, which the
kernel releases when its holder dies. Data is copied outside the lock: reserve a slot (FREE ->
WRITING) -> copy -> publish (-> READY); a consumer leases (READY -> LEASED) -> copies out -> acks
(-> FREE) after its optimizer step. A process killed inside the few-microsecond critical section
leaves the queue usable; at worst a counter is off by one.

Semantics (the contract the drafter group relies on):
- FIFO by publish order (a global sequence number taken at publish) across all producers. A batch
  returned by a reclaim keeps its number, which is lower than that of every batch still waiting
  (delivery is in number order), so it goes to the front of the queue.
- A consumer calls `register_consumer(generation)` once, with torchrun's restart count
  (TORCHELASTIC_RESTART_COUNT). The queue remembers the highest generation registered. Registering a
  higher generation returns every lease held by an older generation to READY (torchrun has killed
  that group), and every registration returns leases of dead processes. A consumer of an older
  generation is fenced: its get() and ack() raise StaleGenerationError / LeaseLostError, so a batch
  is never delivered to two members of the live group.
- get() and put() also return the leases / half-written slots of dead processes while they wait,
  so a consumer death outside torchrun (tests, a hand-run worker) does not lose the batch either.
- A process counts as dead when /proc/<pid> is gone, is a zombie, or has a different start time
  (pid reuse). All processes of one queue must share a pid namespace (same host and container).
- get() returns copies: on `device` when given (one copy from shared memory to that device), else
  CPU clones. With copy=False (CPU only) the tensors are views into the slot, valid until ack().
- Counters (produced, delivered, acked, redelivered) live in the control block; at any quiet moment
  produced == acked + ready + leased and delivered == acked + redelivered + leased.
- put()/get() wait by polling (0.5 ms growing to 10 ms); `on_wait` is called when a wait starts and
  about every 0.5 s while it lasts, so the caller can keep its heartbeat state current.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import mmap
import os
import re
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.errors import ConfigError, DFlashError

_MAGIC = b"DFLHSQ01"
_PAGE = 4096
_TENSOR_ALIGN = 64
_SLOT_TABLE_OFFSET = 256
_ON_WAIT_INTERVAL_S = 0.5
_RECLAIM_INTERVAL_S = 0.1
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")

FREE, WRITING, READY, LEASED = 0, 1, 2, 3
_STATE_NAMES = {FREE: "free", WRITING: "writing", READY: "ready", LEASED: "leased"}
_COUNTERS = ("produced", "delivered", "acked", "redelivered", "abandoned_writes")


def _record(fields: tuple[tuple[str, str], ...]) -> tuple[dict[str, tuple[int, struct.Struct]], int]:
    """Offsets of little-endian fields laid out in order (each field naturally aligned by the order)."""
    offsets, pos = {}, 0
    for name, fmt in fields:
        packer = struct.Struct("<" + fmt)
        offsets[name] = (pos, packer)
        pos += packer.size
    return offsets, pos


_HEADER, _HEADER_SIZE = _record(
    (
        ("magic", "8s"),
        ("version", "I"),
        ("capacity", "I"),
        ("slot_bytes", "Q"),
        ("slot_stride", "Q"),
        ("data_offset", "Q"),
        ("next_seq", "q"),
        ("next_token", "Q"),
        ("generation", "q"),
        ("ready", "Q"),
        ("produced", "Q"),
        ("delivered", "Q"),
        ("acked", "Q"),
        ("redelivered", "Q"),
        ("abandoned_writes", "Q"),
        ("created_ns", "Q"),
    )
)
_SLOT, _SLOT_SIZE = _record(
    (
        ("state", "I"),
        ("spare", "I"),
        ("owner_pid", "q"),
        ("owner_start", "Q"),
        ("owner_gen", "q"),
        ("seq", "q"),
        ("data_len", "Q"),
        ("token", "Q"),
        ("deliveries", "Q"),
    )
)
assert _HEADER_SIZE <= _SLOT_TABLE_OFFSET and _SLOT_SIZE == 64


class TransportError(DFlashError):
    """The hidden-state queue cannot be used as asked (missing, corrupt, out of shared memory)."""


class StaleGenerationError(TransportError):
    """This consumer belongs to a drafter generation that a newer one has replaced."""


class LeaseLostError(TransportError):
    """The lease was reclaimed (its holder was taken for dead or stale); the batch goes to someone else."""


@dataclass(slots=True)
class Lease:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    slot: int
    seq: int
    """Global publish order of the batch (0, 1, 2, ... across all producers)."""
    token: int = 0
    """Identifies this delivery; ack() checks it so a reclaimed lease cannot free a re-leased slot."""
    deliveries: int = 1
    """1 on first delivery, more when the batch was reclaimed from a dead or stale consumer."""


def name_for_run(run_dir: str | Path, role: str = "hs") -> str:
    """Queue name every process of a run derives alike from the run directory (same path, same name)."""
    path = Path(run_dir).resolve()
    safe_id = re.sub(r"[^A-Za-z0-9_.-]", "_", path.name)[:48] or "run"
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:10]
    return f"dflash-{role}-{safe_id}-{digest}"


def segment_path(name: str) -> Path:
    if not _NAME_RE.fullmatch(name):
        raise TransportError(
            f"bad hidden-state queue name {name!r}: use 1-200 characters of letters, digits, '_', '.', '-' "
            "(name_for_run(run_dir) makes one)"
        )
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / name


def _process_start(pid: int) -> int | None:
    """Start time of a live process (clock ticks since boot; 0 where /proc is absent), None if dead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        stat = b""
    if not stat:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    fields = stat[stat.rindex(b")") + 2 :].split()  # comm may contain spaces; fields[0] is field 3
    if fields[0] in (b"Z", b"X"):  # a SIGKILLed child nobody has reaped yet is dead for us
        return None
    return int(fields[19])


def _alive(pid: int, start: int) -> bool:
    now = _process_start(pid)
    return now is not None and (start == 0 or now == 0 or now == start)


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def slot_bytes_for(specs: dict[str, tuple[Sequence[int], torch.dtype]], *, meta_bytes: int = 1 << 16) -> int:
    """Slot size that holds one batch of these tensor shapes plus up to `meta_bytes` of header JSON.

    For deriving pipeline.slot_mb from the batch shape (slot_mb = 0).
    """
    data = sum(
        _align(math.prod(shape) * torch.empty(0, dtype=dtype).element_size(), _TENSOR_ALIGN)
        for shape, dtype in specs.values()
    )
    return _align(_align(4 + meta_bytes, _TENSOR_ALIGN) + data, _PAGE)


def segment_bytes(capacity: int, slot_bytes: int) -> int:
    """Bytes of /dev/shm a queue of this shape maps: the control block, then page-aligned slots.
    dflash.check reports it before a job starts, so a container can be given enough shared memory."""
    data_offset = _align(_SLOT_TABLE_OFFSET + capacity * _SLOT_SIZE, _PAGE)
    return data_offset + capacity * _align(slot_bytes, _PAGE)


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise TransportError(
            f"hidden-state slot names an unknown dtype {name!r}; writer and reader torch differ?"
        )
    return dtype


class HiddenStateQueue:
    """One mapping of the named queue; thread-safe within a process. See the module doc for semantics."""

    def __init__(self, name: str, path: Path, fd: int, mm: mmap.mmap) -> None:
        self.name, self.path = name, path
        self._fd, self._mm = fd, mm
        self._mem = torch.frombuffer(mm, dtype=torch.uint8)
        self._thread_lock = threading.Lock()
        self._pid = os.getpid()
        self._start = _process_start(self._pid) or 0
        self._generation: int | None = None
        self._pinned: bool | None = None  # None: not tried yet (done on first CUDA copy)
        self._last_reclaim = 0.0
        self.capacity = self._h("capacity")
        self.slot_bytes = self._h("slot_bytes")
        self._stride = self._h("slot_stride")
        self._data_offset = self._h("data_offset")

    # ---- lifecycle -------------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, *, capacity: int, slot_bytes: int) -> HiddenStateQueue:
        """Make a fresh queue, replacing any segment of that name (a crashed earlier run's is stale).

        The replacement is a new file renamed over the old one, so a straggler still mapping the old
        segment keeps its own copy and cannot corrupt the new queue.
        """
        if capacity < 1:
            raise ConfigError("pipeline.queue_depth", f"must be >= 1 (got {capacity})")
        if slot_bytes < _PAGE:
            raise ConfigError("pipeline.slot_mb", f"slot of {slot_bytes} bytes is too small for a batch")
        path = segment_path(name)
        stride = _align(slot_bytes, _PAGE)
        data_offset = _align(_SLOT_TABLE_OFFSET + capacity * _SLOT_SIZE, _PAGE)
        total = segment_bytes(capacity, slot_bytes)
        fs = os.statvfs(path.parent)
        available = fs.f_bavail * fs.f_frsize + (path.stat().st_size if path.exists() else 0)
        if total > available:
            raise TransportError(
                f"hidden-state queue needs {total / 2**20:.0f} MiB in {path.parent} but only "
                f"{available / 2**20:.0f} MiB are free: lower pipeline.queue_depth ({capacity}) or "
                f"pipeline.slot_mb ({slot_bytes / 2**20:.0f}), or give the container more /dev/shm "
                "(docker --shm-size)"
            )
        tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            # Committing the pages now turns a later SIGBUS (tmpfs full mid-copy) into this clear error.
            if hasattr(os, "posix_fallocate"):
                try:
                    os.posix_fallocate(fd, 0, total)
                except OSError as e:
                    raise TransportError(
                        f"cannot reserve {total / 2**20:.0f} MiB for the hidden-state queue in {path.parent}: "
                        f"{e.strerror}; lower pipeline.queue_depth or pipeline.slot_mb, or add /dev/shm"
                    ) from e
            else:
                os.ftruncate(fd, total)
            with mmap.mmap(fd, _SLOT_TABLE_OFFSET, mmap.MAP_SHARED) as head:
                values = {
                    "magic": _MAGIC,
                    "version": 1,
                    "capacity": capacity,
                    "slot_bytes": slot_bytes,
                    "slot_stride": stride,
                    "data_offset": data_offset,
                    "created_ns": time.time_ns(),
                }
                for key, value in values.items():
                    off, packer = _HEADER[key]
                    packer.pack_into(head, off, value)
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return cls.attach(name)

    @classmethod
    def attach(cls, name: str) -> HiddenStateQueue:
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise TransportError(
                f"no hidden-state queue {name!r} at {path}: the supervisor creates it before it starts the "
                "workers; check that this worker belongs to that run and runs on the same host and container"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size < _SLOT_TABLE_OFFSET:
                raise TransportError(f"{path} is not a hidden-state queue ({size} bytes); recreate it")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        magic = _HEADER["magic"][1].unpack_from(mm, 0)[0]
        capacity, stride, data_offset = (
            _HEADER[k][1].unpack_from(mm, _HEADER[k][0])[0]
            for k in ("capacity", "slot_stride", "data_offset")
        )
        if magic != _MAGIC or size != data_offset + capacity * stride:
            mm.close()
            os.close(fd)
            raise TransportError(f"{path} is not a hidden-state queue of this version; recreate it")
        return cls(name, path, fd, mm)

    def close(self) -> None:
        """Unmap. Views handed out with copy=False keep the mapping alive until they are freed."""
        if self._fd < 0:
            return
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._mem.data_ptr())
        self._mem = torch.empty(0, dtype=torch.uint8)
        with contextlib.suppress(BufferError):  # live views from get(copy=False) keep the mapping
            self._mm.close()
        os.close(self._fd)
        self._fd = -1

    def unlink(self) -> None:
        """Remove the name (the supervisor, at the end). Processes that still map it keep working."""
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> HiddenStateQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pinned(self) -> bool:
        """Whether this process has page-locked the mapping for CUDA (done on its first CUDA copy)."""
        return bool(self._pinned)

    def _pin_for_cuda(self) -> None:
        """Page-lock the mapping once, so copies between a slot and a GPU run by DMA, not staged.

        Each process registers its own mapping; on failure the copies still work, only slower.
        """
        if self._pinned is not None:
            return
        cudart = torch.cuda.cudart()
        # Flag 1 = cudaHostRegisterPortable: pinned for every device this process may use.
        error = int(cudart.cudaHostRegister(self._mem.data_ptr(), self._mem.numel(), 1))
        self._pinned = error == 0
        if not self._pinned:
            logging.getLogger(__name__).warning(
                "hidden-state queue %s: cudaHostRegister of %d MiB failed (%s); GPU copies stay pageable "
                "and slower",
                self.name,
                self._mem.numel() >> 20,
                error,
            )

    # ---- control block ---------------------------------------------------------------------------
    def _h(self, key: str) -> Any:
        off, packer = _HEADER[key]
        return packer.unpack_from(self._mm, off)[0]

    def _hset(self, key: str, value: int) -> None:
        off, packer = _HEADER[key]
        packer.pack_into(self._mm, off, value)

    def _hadd(self, key: str, delta: int) -> None:
        self._hset(key, self._h(key) + delta)

    def _s(self, slot: int, key: str) -> int:
        off, packer = _SLOT[key]
        return packer.unpack_from(self._mm, _SLOT_TABLE_OFFSET + slot * _SLOT_SIZE + off)[0]

    def _sset(self, slot: int, **values: int) -> None:
        base = _SLOT_TABLE_OFFSET + slot * _SLOT_SIZE
        for key, value in values.items():
            off, packer = _SLOT[key]
            packer.pack_into(self._mm, base + off, value)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        # flock belongs to the open file description, which threads (and forked children) share:
        # the thread lock orders threads, and a forked child reopens the file to get its own.
        with self._thread_lock:
            if os.getpid() != self._pid:
                self._after_fork()
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _after_fork(self) -> None:
        self._fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDWR)
        self._pid = os.getpid()
        self._start = _process_start(self._pid) or 0
        self._generation = None

    # ---- reclaim ---------------------------------------------------------------------------------
    def _return_to_ready(self, slot: int) -> None:
        self._sset(slot, state=READY, owner_pid=0, owner_start=0, token=0)
        self._hadd("ready", 1)
        self._hadd("redelivered", 1)

    def _reclaim_locked(self, older_than_generation: int | None = None) -> int:
        """Return leases of dead (or older-generation) consumers to READY and free dead writers' slots."""
        returned = 0
        for slot in range(self.capacity):
            state = self._s(slot, "state")
            if state not in (WRITING, LEASED):
                continue
            dead = not _alive(self._s(slot, "owner_pid"), self._s(slot, "owner_start"))
            if state == WRITING and dead:
                self._sset(slot, state=FREE, owner_pid=0, owner_start=0)
                self._hadd("abandoned_writes", 1)
            elif state == LEASED and (
                dead
                or (older_than_generation is not None and self._s(slot, "owner_gen") < older_than_generation)
            ):
                self._return_to_ready(slot)
                returned += 1
        self._last_reclaim = time.monotonic()
        return returned

    def _maybe_reclaim_locked(self) -> None:
        if time.monotonic() - self._last_reclaim >= _RECLAIM_INTERVAL_S:
            self._reclaim_locked()

    def register_consumer(self, generation: int) -> int:
        """Join as a consumer of `generation` (torchrun's restart count); returns the leases reclaimed.

        Raises StaleGenerationError when a newer generation has already registered.
        """
        if generation < 0:
            raise ValueError(f"generation must be >= 0 (torchrun's restart count), got {generation}")
        with self._locked():
            current = self._h("generation")
            if generation < current:
                raise StaleGenerationError(
                    f"drafter generation {generation} is older than the queue's generation {current}: "
                    "this process outlived a group restart and must exit"
                )
            self._hset("generation", generation)
            returned = self._reclaim_locked(older_than_generation=generation)
            self._generation = generation
        return returned

    # ---- waiting ---------------------------------------------------------------------------------
    @staticmethod
    def _wait_for(
        attempt: Callable[[], Any],
        timeout: float | None,
        on_wait: Callable[[], None] | None,
        stop: threading.Event | None,
    ) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause, next_callback = 0.0005, 0.0
        while not (stop is not None and stop.is_set()):
            result = attempt()
            if result is not None:
                return result
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            if on_wait is not None and now >= next_callback:
                on_wait()
                next_callback = now + _ON_WAIT_INTERVAL_S
            sleep = pause if deadline is None else min(pause, max(deadline - now, 0.0))
            if stop is not None:
                stop.wait(sleep)
            else:
                time.sleep(sleep)
            pause = min(pause * 2, 0.01)
        return None

    # ---- producer --------------------------------------------------------------------------------
    def _plan(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> tuple[bytes, list[int], int]:
        """Slot header (JSON) and the offset of every tensor's bytes; raises if the item cannot fit."""
        entries: list[dict[str, Any]] = []
        offsets, described, pos = [], [], 0
        for name, t in tensors.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"hidden-state items map str -> Tensor; got {type(name).__name__} -> {type(t).__name__}"
                )
            nbytes = t.numel() * t.element_size()
            entries.append(
                {"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "offset": pos, "nbytes": nbytes}
            )
            offsets.append(pos)
            described.append(f"{name}{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}")
            pos = _align(pos + nbytes, _TENSOR_ALIGN)
        try:
            header = json.dumps({"meta": meta, "tensors": entries}, allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            raise TransportError(f"hidden-state batch meta must be plain JSON (ids, counts): {e}") from e
        data_start = _align(4 + len(header), _TENSOR_ALIGN)
        needed = data_start + pos
        if needed > self.slot_bytes:
            shapes = ", ".join(described)
            raise ConfigError(
                "pipeline.slot_mb",
                f"a hidden-state batch needs {needed} bytes ({needed / 2**20:.2f} MiB: {shapes}) but a slot "
                f"of queue {self.name!r} holds {self.slot_bytes} bytes ({self.slot_bytes / 2**20:.2f} MiB); "
                f"set pipeline.slot_mb to at least {math.ceil(needed / 2**20)} or make batches smaller",
            )
        return header, [data_start + off for off in offsets], needed

    def _reserve(self) -> int | None:
        with self._locked():
            for attempt in range(2):
                for slot in range(self.capacity):
                    if self._s(slot, "state") == FREE:
                        self._sset(
                            slot,
                            state=WRITING,
                            owner_pid=self._pid,
                            owner_start=self._start,
                            owner_gen=-1,
                            token=0,
                        )
                        return slot
                if attempt == 0:
                    self._maybe_reclaim_locked()
        return None

    def put(
        self,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any],
        *,
        timeout: float | None = None,
        on_wait: Callable[[], None] | None = None,
        on_reserved: Callable[[], None] | None = None,
        stop: threading.Event | None = None,
    ) -> bool:
        """Publish one batch; blocks while the queue is full (on_wait is called while it waits,
        on_reserved once a slot is held, before the copy into it). False when stopped or timed out."""
        header, offsets, needed = self._plan(tensors, meta)
        slot = self._wait_for(self._reserve, timeout, on_wait, stop)
        if slot is None:
            return False
        if on_reserved is not None:
            on_reserved()
        try:
            base = self._data_offset + slot * self._stride
            struct.pack_into("<I", self._mm, base, len(header))
            self._mm[base + 4 : base + 4 + len(header)] = header
            for off, t in zip(offsets, tensors.values(), strict=True):
                flat = t.detach().contiguous().reshape(-1)
                if flat.is_cuda:
                    self._pin_for_cuda()
                if flat.numel():
                    # A device->host copy straight into the slot: no staging tensor.
                    dst = self._mem[base + off : base + off + flat.numel() * flat.element_size()]
                    dst.copy_(flat.view(torch.uint8))
        except BaseException:
            with self._locked():
                self._sset(slot, state=FREE, owner_pid=0, owner_start=0)
            raise
        with self._locked():
            seq = self._h("next_seq")
            self._hset("next_seq", seq + 1)
            self._sset(slot, seq=seq, data_len=needed, deliveries=0, owner_pid=0, owner_start=0, state=READY)
            self._hadd("ready", 1)
            self._hadd("produced", 1)
        return True

    # ---- consumer --------------------------------------------------------------------------------
    def _take(self) -> tuple[int, int, int, int] | None:
        assert self._generation is not None
        with self._locked():
            current = self._h("generation")
            if self._generation < current:
                raise StaleGenerationError(
                    f"drafter generation {self._generation} was replaced by generation {current}; "
                    "this process must exit (its leases were handed to the new group)"
                )
            for attempt in range(2):
                best, best_seq = -1, 0
                for slot in range(self.capacity):
                    if self._s(slot, "state") == READY:
                        seq = self._s(slot, "seq")
                        if best < 0 or seq < best_seq:
                            best, best_seq = slot, seq
                if best >= 0:
                    token = self._h("next_token") + 1
                    self._hset("next_token", token)
                    deliveries = self._s(best, "deliveries") + 1
                    self._sset(
                        best,
                        owner_pid=self._pid,
                        owner_start=self._start,
                        owner_gen=self._generation,
                        token=token,
                        deliveries=deliveries,
                        state=LEASED,
                    )
                    self._hadd("ready", -1)
                    self._hadd("delivered", 1)
                    return best, best_seq, token, deliveries
                if attempt == 0:
                    self._maybe_reclaim_locked()
        return None

    def get(
        self,
        *,
        device: torch.device | str | None = None,
        timeout: float | None = None,
        on_wait: Callable[[], None] | None = None,
        stop: threading.Event | None = None,
        copy: bool = True,
    ) -> Lease | None:
        """Lease the oldest ready batch; None when stopped or timed out. ack() it after the step.
        On a CUDA device the copies are queued on the current stream (ordered before any work that
        uses them); ack() only once that work is done."""
        if self._generation is None:
            raise TransportError(
                "call register_consumer(generation) before get(): leases carry the generation"
            )
        if not copy and device is not None and torch.device(device).type != "cpu":
            raise ValueError("copy=False gives views into shared memory, which lives on the CPU; drop device")
        taken = self._wait_for(self._take, timeout, on_wait, stop)
        if taken is None:
            return None
        slot, seq, token, deliveries = taken
        try:
            base = self._data_offset + slot * self._stride
            (header_len,) = struct.unpack_from("<I", self._mm, base)
            header = json.loads(bytes(self._mm[base + 4 : base + 4 + header_len]))
            data_start = _align(4 + header_len, _TENSOR_ALIGN)
            tensors = {}
            for entry in header["tensors"]:
                start = base + data_start + entry["offset"]
                raw = self._mem[start : start + entry["nbytes"]]
                view = raw.view(_dtype_from_name(entry["dtype"])).view(entry["shape"])
                if not copy:
                    tensors[entry["name"]] = view
                elif device is None:
                    tensors[entry["name"]] = view.clone()
                else:
                    cuda = torch.device(device).type == "cuda"
                    if cuda:
                        self._pin_for_cuda()
                    # Queued behind the device's work, not waited for: a blocking copy would wait for
                    # the drafter's step still queued (dflash.step.trainer.StepAhead) and idle the GPU
                    # while the next step is launched. The slot stays leased until ack(), which comes
                    # after the step that read these tensors, so the copy is done before reuse.
                    tensors[entry["name"]] = view.to(device, copy=True, non_blocking=cuda)
        except BaseException:
            with self._locked():
                if self._s(slot, "state") == LEASED and self._s(slot, "token") == token:
                    self._return_to_ready(slot)
            raise
        return Lease(
            tensors=tensors, meta=header["meta"], slot=slot, seq=seq, token=token, deliveries=deliveries
        )

    def ack(self, lease: Lease) -> None:
        """Free the batch's slot (after the optimizer step that used it). Views of it become invalid."""
        with self._locked():
            if self._s(lease.slot, "state") != LEASED or self._s(lease.slot, "token") != lease.token:
                raise LeaseLostError(
                    f"lease of batch {lease.seq} (slot {lease.slot}) was reclaimed: this consumer was taken for "
                    "dead or replaced by a newer drafter generation; the batch is delivered again elsewhere, "
                    "so this process must not count it and should exit"
                )
            self._sset(lease.slot, state=FREE, owner_pid=0, owner_start=0, token=0)
            self._hadd("acked", 1)

    # ---- observation -----------------------------------------------------------------------------
    def depth(self) -> int:
        """READY batches (q_hs). Lock-free: one aligned 8-byte read of the control block."""
        return int(self._h("ready"))

    def stats(self) -> dict[str, Any]:
        """Counters and slot states, read consistently under the lock (for metrics and end-of-run proof)."""
        with self._locked():
            states = [self._s(slot, "state") for slot in range(self.capacity)]
            out: dict[str, Any] = {key: int(self._h(key)) for key in _COUNTERS}
            out.update(
                generation=int(self._h("generation")), capacity=self.capacity, slot_bytes=self.slot_bytes
            )
        for state, label in _STATE_NAMES.items():
            out[label] = states.count(state)
        out["depth"] = out["ready"]
        return out
