"""The drafter group's recent training state, kept outside the drafter processes (pipeline.state_copy_every).

A drafter death restarts the whole group (torchrun); without this the new generation resumes from
the newest checkpoint and trains every step since again (up to train.checkpoint_every of them).
With it, the group resumes from a copy at most `state_copy_every` steps old, taken in host shared
memory, which outlives the processes:

    /dev/shm/dflash-state-<run>-<digest>-n<node>/
        tensors              the state's tensors: a header, then two slots, written in turn
        rank<r>-step<S>.pt   each rank's small state (a pickle) at step S (scheduler, step, RNG, optimizer groups)

What one copy holds: the drafter's trainable weights as a checkpoint holds them (the float32
masters of bf16 weights), every optimizer state tensor (both AdamW moments and the step counts),
and per rank the step, LR scheduler, anchor sampler and RNG states. The data position is the
queue's: a batch is acked only once a copy (or checkpoint) holds the step that trained it
(dflash.pipeline.drafter_worker), so a resume neither skips nor repeats one.

The replicas of a data-parallel group are identical, so each host's local rank 0 writes the
tensors for its host; every rank writes its own small state. On the GPU the copy runs on a copy
stream right behind the optimizer's kernels, into page-locked shared memory, while the next step's
forward and backward run; the next optimizer step waits (on the device, not the host) until the
copy has read the tensors it will overwrite. A thread marks the copy complete once the device says
so.

Torn copies: each slot carries a begin and an end marker. The writer sets begin = step before the
first byte and end = step after the last; a reader takes a slot only when both are equal (a death
mid-copy leaves end behind begin), reads it, and checks again. The small state files are written
to a temp name and renamed.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import queue
import re
import shutil
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.errors import ConfigError
from dflash.rundir import atomic_write_bytes, supervisor_alive

MAGIC = b"DFLSTATE"
VERSION = 1
HEADER_BYTES = 1 << 16
"""The header's room: magic, version, layout length, the slots' markers, the layout (JSON)."""
_FIXED = struct.Struct("<8sqq")  # magic, version, layout length
_MARK = struct.Struct("<qq")  # begin, end of one slot
_MARKS_AT = 64
_LAYOUT_AT = 128
ALIGN = 4096
_META_RE = re.compile(r"^rank(\d+)-step(\d+)\.pt$")


def copy_dir(queue_name: str) -> Path:
    """This host's copy directory, named after this host's hidden-state queue: the supervisor and
    every drafter rank of the host derive it alike."""
    from dflash.pipeline.transport import segment_path

    return segment_path(f"{queue_name}-state")


def _shm_root() -> Path:
    """Where every host's copy directories live (the hidden-state queues' filesystem)."""
    return copy_dir("x").parent


OWNER = "owner"
"""In a copy directory: whose job it belongs to, as `owner_line()` writes it."""

_FRESH_S = 60.0
"""A copy directory without its owner file younger than this is a start in progress, not stale."""


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "?"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "?"


def owner_line(token: str) -> str:
    """The boot, the pid namespace and the supervisor_token of the supervisor: another container
    sharing this /dev/shm (docker --ipc=host) sees other pids, so only a copy of this namespace, or
    of an earlier boot, can be judged stale."""
    return f"{_boot_id()} {_pid_namespace()} {token}"


def _stale(d: Path) -> bool:
    try:
        boot, ns, token = (d / OWNER).read_text().split()
    except FileNotFoundError:
        try:
            return time.time() - d.stat().st_mtime > _FRESH_S
        except OSError:
            return False
    except (OSError, ValueError):
        return True  # not one of ours as written: unreadable or garbled
    if boot != _boot_id():
        return True
    if ns != _pid_namespace():
        return False
    return not supervisor_alive(token)


def prepare_copies(queue_name: str, owner: str) -> Path:
    """The supervisor's start: this host's copy directory, empty, owned by `owner`. An earlier
    launch's copies are removed: a relaunched job resumes from its checkpoints (the copies belong to
    one launch's drafter generations)."""
    d = copy_dir(queue_name)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(mode=0o700)
    atomic_write_bytes(d / OWNER, owner_line(owner).encode(), durable=False)
    return d


def remove_copies(queue_name: str) -> None:
    """The supervisor's cleanup, on every exit path of the job."""
    shutil.rmtree(copy_dir(queue_name), ignore_errors=True)


def remove_stale_copies(root: Path | None = None) -> list[Path]:
    """Copy directories whose supervisor is gone (SIGKILLed, OOM-killed, the host rebooted with a
    persistent /dev/shm): removed, and returned. Any job's start sweeps them: a crashed job's copies
    are GBs of shared memory that nothing else would free. A live job's copies, and those of another
    pid namespace (which this process cannot judge), are kept."""
    root = root or _shm_root()
    gone = []
    for d in sorted(root.glob("dflash-*-state")):
        if d.is_dir() and _stale(d):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


# ---- what a copy holds ---------------------------------------------------------------------------


def state_tensors(trainer: Any) -> dict[str, torch.Tensor]:
    """The live tensors one copy holds, by a name that finds them again: `w/<weight>` as
    trainer.weights() gives them, `o/<index>/<key>` for the optimizer's state of its index-th
    parameter (the numbering of optimizer.state_dict())."""
    out = {f"w/{name}": t.detach() for name, t in trainer.weights().items()}
    index = 0
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            for key, value in trainer.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"o/{index}/{key}"] = value.detach()
            index += 1
    return out


def small_state(trainer: Any) -> dict[str, Any]:
    """Everything else a rank needs to go on where the copy was taken (all host-side, nothing waits)."""
    from dflash.checkpoint import rng_state

    # optimizer.state_dict()'s param_groups (parameters numbered in order), without its state dict
    groups, index = [], 0
    for group in trainer.optimizer.param_groups:
        n = len(group["params"])
        groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(index, index + n))}
        )
        index += n
    rng = rng_state()
    device = trainer.device
    if device.type == "cuda":
        rng["cuda_device"] = torch.cuda.get_rng_state(device)
    return {
        "step": trainer.step,
        "scheduler": trainer.scheduler.state_dict(),
        "anchor_gen": trainer.anchor_gen.get_state(),
        "param_groups": groups,
        "rng": rng,
    }


def restore(trainer: Any, tensors: dict[str, torch.Tensor], small: dict[str, Any]) -> None:
    """Load a copy into the trainer, as DrafterTrainer.load_state_dict loads a checkpoint."""
    from dflash.checkpoint import set_rng_state

    weights = {k[2:]: v for k, v in tensors.items() if k.startswith("w/")}
    opt_state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("o/"):
            _, index, key = name.split("/", 2)
            opt_state.setdefault(int(index), {})[key] = value
    state = {
        "step": small["step"],
        "optimizer": {"state": opt_state, "param_groups": small["param_groups"]},
        "scheduler": small["scheduler"],
        "anchor_gen": small["anchor_gen"],
    }
    trainer.load_state_dict(state, weights)
    rng = dict(small["rng"])
    cuda = rng.pop("cuda_device", None)
    rng.pop("cuda", None)  # all devices' states: this rank restores its own device's only
    set_rng_state(rng)
    if cuda is not None and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(cuda, trainer.device)


def copy_nbytes(spec: Any) -> int:
    """One copy's tensor bytes for a drafter spec: float32 weights and two float32 AdamW moments
    per trainable element, plus each tensor's step count and alignment. Built on the meta device:
    exact, and no memory."""
    from dflash.step.model import DFlashDrafter

    meta = torch.device("meta")
    with meta:
        embed = torch.empty(spec.vocab_size, spec.hidden_size)
        model = DFlashDrafter(spec, embed, embed, backend="sdpa", compile=False)
    trainable = [p for name, p in model.named_parameters() if p.requires_grad]
    per = [p.numel() * 4 for p in trainable]
    return sum(3 * _aligned(n) + ALIGN for n in per)


def copies_nbytes(spec: Any) -> int:
    """The host's tensors file for a drafter spec: its header and two copies' slots."""
    return HEADER_BYTES + 2 * copy_nbytes(spec)


def _header_bytes(layout_len: int) -> int:
    return max(HEADER_BYTES, _aligned(_LAYOUT_AT + layout_len))


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def host_memory_problem(
    need_bytes: int,
    shm_free: int,
    mem_available: int | None,
    drafters: int,
    every: int,
    *,
    queue_bytes: int = 0,
) -> ConfigError | None:
    """The refusal when this host cannot hold its two copies beside the hidden-state queue (None: it
    can). Shared memory is host memory: both bounds count."""
    gib = 1 << 30
    room = min(shm_free, mem_available) if mem_available is not None else shm_free
    room -= queue_bytes
    if 2 * need_bytes <= room:
        return None
    where = "/dev/shm" if room == shm_free else "host memory (MemAvailable)"
    return ConfigError(
        "pipeline.state_copy_every",
        f"({every}): the drafter group's state copies need {2 * need_bytes / gib:.1f} GiB of shared "
        f"memory on this host (two copies of {need_bytes / gib:.1f} GiB: float32 weights and AdamW "
        f"moments, one per host for its {drafters} drafter(s), whose replicas are identical), but "
        f"{where} has {room / gib:.1f} GiB free beside the hidden-state queue. Free host memory or enlarge /dev/shm (docker: --shm-size), or set "
        "pipeline.state_copy_every = 0 (no copies: a drafter death then rolls back to the newest "
        "checkpoint)",
    )


def host_room() -> tuple[int, int | None]:
    """(free bytes of the filesystem the copies live on, MemAvailable or None)."""
    st = os.statvfs(_shm_root())
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return st.f_bavail * st.f_frsize, available


# ---- the tensors file ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    """Within a slot."""
    nbytes: int


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[list[Entry], int]:
    entries, off = [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        entries.append(Entry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), off, n))
        off += _aligned(max(n, 1))
    return entries, off


class TensorFile:
    """The two-slot tensors file of one host (see the module doc)."""

    def __init__(self, path: Path, mm: mmap.mmap, entries: list[Entry], slot_bytes: int, header: int) -> None:
        self.path, self._mm, self.entries, self.slot_bytes = path, mm, entries, slot_bytes
        self.header = header
        self._mem = torch.frombuffer(mm, dtype=torch.uint8)
        self.pinned = False

    @classmethod
    def create(cls, path: Path, tensors: dict[str, torch.Tensor]) -> TensorFile:
        entries, slot_bytes = _layout(tensors)
        layout = json.dumps([[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in entries]).encode()
        header = _header_bytes(len(layout))
        size = header + 2 * slot_bytes
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _FIXED.pack_into(mm, 0, MAGIC, VERSION, len(layout))
        for slot in (0, 1):
            _MARK.pack_into(mm, _MARKS_AT + slot * _MARK.size, -1, -2)
        mm[_LAYOUT_AT : _LAYOUT_AT + len(layout)] = layout
        os.replace(tmp, path)  # a reader sees a whole header or no file
        return cls(path, mm, entries, slot_bytes, header)

    @classmethod
    def open(cls, path: Path) -> TensorFile | None:
        """The file as a dead generation left it; None if absent or not one of ours."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                return None
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, n = _FIXED.unpack_from(mm, 0)
        if magic != MAGIC or version != VERSION or not 0 < n < size:
            mm.close()
            return None
        try:
            raw = json.loads(bytes(mm[_LAYOUT_AT : _LAYOUT_AT + n]))
            entries = [
                Entry(str(a), str(b), tuple(int(x) for x in c), int(d), int(e)) for a, b, c, d, e in raw
            ]
        except (ValueError, TypeError):
            mm.close()
            return None
        slot_bytes = max((e.offset + _aligned(max(e.nbytes, 1)) for e in entries), default=0)
        header = _header_bytes(n)
        if header + 2 * slot_bytes != size:
            mm.close()
            return None
        return cls(path, mm, entries, slot_bytes, header)

    def matches(self, tensors: dict[str, torch.Tensor]) -> bool:
        entries, _ = _layout(tensors)
        return entries == self.entries

    def marks(self, slot: int) -> tuple[int, int]:
        begin, end = _MARK.unpack_from(self._mm, _MARKS_AT + slot * _MARK.size)
        return int(begin), int(end)

    def set_begin(self, slot: int, step: int) -> None:
        # end first: from here on the slot reads as torn until its copy is complete
        _MARK.pack_into(self._mm, _MARKS_AT + slot * _MARK.size, step, -2)

    def set_end(self, slot: int, step: int) -> None:
        struct.pack_into("<q", self._mm, _MARKS_AT + slot * _MARK.size + 8, step)

    def complete_steps(self) -> dict[int, int]:
        """{step: slot} of the complete slots."""
        out = {}
        for slot in (0, 1):
            begin, end = self.marks(slot)
            if begin == end and begin >= 0:
                out[begin] = slot
        return out

    def views(self, slot: int) -> dict[str, torch.Tensor]:
        base = self.header + slot * self.slot_bytes
        out = {}
        for e in self.entries:
            raw = self._mem[base + e.offset : base + e.offset + e.nbytes]
            out[e.name] = raw.view(getattr(torch, e.dtype)).view(e.shape)
        return out

    def pin(self) -> bool:
        """Page-lock the mapping (both slots) so device copies into it run by DMA."""
        if self.pinned or not torch.cuda.is_available():
            return self.pinned
        err = int(torch.cuda.cudart().cudaHostRegister(self._mem.data_ptr(), self._mem.numel(), 1))
        self.pinned = err == 0
        return self.pinned

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._mem.data_ptr())
            self.pinned = False
        self._mem = torch.empty(0, dtype=torch.uint8)
        try:
            self._mm.close()
        except BufferError:  # a view still alive (a restore's tensors on the CPU): the OS unmaps at exit
            pass


# ---- writer --------------------------------------------------------------------------------------


class StateCopier:
    """One drafter rank's side of the copies: DrafterTrainer calls `before_update` before each
    optimizer step and `after_update` after it (dflash.step.trainer).

    Copies start once the host's tensors file is ready: created at the first due step, then
    page-locked in the background (pinning touches every page of both slots: seconds at the 8B
    size, which no step waits for); until then steps are covered by checkpoints only."""

    def __init__(
        self,
        trainer: Any,
        directory: Path,
        *,
        rank: int,
        writes_tensors: bool,
        every: int,
        on_event: Callable[..., None] | None = None,
    ) -> None:
        self.trainer, self.dir, self.rank, self.every = trainer, directory, rank, every
        self.writes_tensors = writes_tensors
        self.on_event = on_event or (lambda *a, **k: None)
        self.cuda = trainer.device.type == "cuda"
        self.file: TensorFile | None = None
        self._ready = threading.Event()
        self._stream = torch.cuda.Stream(trainer.device) if self.cuda else None
        self._read_done: Any = None
        """The last copy's end on the copy stream: the next optimizer step waits for it."""
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._committed = -1
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._slot_free = [threading.Event(), threading.Event()]
        for e in self._slot_free:
            e.set()
        self._thread = threading.Thread(target=self._commit_loop, name="state-copy", daemon=True)
        self._thread.start()
        self._host_file: TensorFile | None = None
        """A reader's view of the host's tensors (ranks that do not write them)."""
        self._srcs: list[torch.Tensor] = []
        self._dsts: list[list[torch.Tensor]] = [[], []]
        self._written = [path for _, path in sorted(_small_files(directory, rank).items())]
        """This rank's small-state files, oldest first (a resumed generation's included), pruned to
        the newest three as new ones are written: no directory listing per copy."""
        self.copies = 0
        self.host_seconds = 0.0
        """Host time the copies took from the training loop (launching the device copies)."""

    def committed(self) -> int:
        """The newest step whose copy is complete for this rank (the host's tensors and its own
        small state), -1 before the first."""
        if self._error is not None:
            raise self._error
        with self._lock:
            mine = self._committed
        if self.writes_tensors or mine < 0:
            return mine
        if self._host_file is None:
            self._host_file = TensorFile.open(self.dir / "tensors")
            if self._host_file is None:
                return -1
        host = [s for s in self._host_file.complete_steps() if s <= mine]
        return max(host, default=-1)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Until the tensors file is made and page-locked (copies start then); False on timeout."""
        return self._ready.wait(timeout)

    @property
    def pinned(self) -> bool:
        return self.file is not None and self.file.pinned

    @property
    def file_bytes(self) -> int:
        f = self.file
        return 0 if f is None else f.header + 2 * f.slot_bytes

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def before_update(self) -> None:
        if self._read_done is not None:
            torch.cuda.current_stream(self.trainer.device).wait_event(self._read_done)
            self._read_done = None

    def after_update(self, step: int) -> None:
        if not self.due(step):
            return
        t0 = time.perf_counter()
        done: Any = None
        slot = (step // self.every) % 2
        if self.writes_tensors:
            if self.file is None:
                live = state_tensors(self.trainer)
                self.file = self._open_file(live)
                # The live tensors stay the same objects from here on (the optimizer updates its
                # state in place; a resume loads before the copier exists): paired with each slot's
                # views once, then one foreach copy per copy.
                views = [self.file.views(i) for i in (0, 1)]
                self._srcs = list(live.values())
                self._dsts = [[views[i][name] for name in live] for i in (0, 1)]
            if not self._ready.is_set():
                return
            # the slot's previous copy (two copies back) is complete before the slot is reused
            self._slot_free[slot].wait()
            self._slot_free[slot].clear()
            self.file.set_begin(slot, step)
            if self._stream is not None:
                stream = self._stream
                stream.wait_stream(torch.cuda.current_stream(self.trainer.device))
                with torch.cuda.stream(stream):
                    torch._foreach_copy_(self._dsts[slot], self._srcs, non_blocking=True)
                done = stream.record_event()
                self._read_done = done
            else:
                torch._foreach_copy_(self._dsts[slot], self._srcs)
        self._jobs.put((step, slot, done, small_state(self.trainer)))
        self.copies += 1
        self.host_seconds += time.perf_counter() - t0

    def _open_file(self, live: dict[str, torch.Tensor]) -> TensorFile:
        path = self.dir / "tensors"
        f = TensorFile.open(path)
        if f is not None and not f.matches(live):
            f.close()
            f = None
        if f is None:
            f = TensorFile.create(path, live)
        if not self.cuda:
            self._ready.set()
            return f

        def pin() -> None:
            if not f.pin():
                self.on_event(
                    "degraded",
                    kind="state_copy_unpinned",
                    detail="cudaHostRegister of the drafter state copy failed: copies run pageable",
                )
            self._ready.set()

        threading.Thread(target=pin, name="state-copy-pin", daemon=True).start()
        return f

    def _commit_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            step, slot, done, small = job
            try:
                if done is not None:
                    done.synchronize()
                if self.writes_tensors and self.file is not None:
                    self.file.set_end(slot, step)
                    self._slot_free[slot].set()
                self._write_small(step, small)
                with self._lock:
                    self._committed = step
            except BaseException as e:  # surfaced to the training loop by `committed`
                self._error = e
                return

    def _write_small(self, step: int, small: dict[str, Any]) -> None:
        final = self.dir / f"rank{self.rank}-step{step}.pt"
        # pickle, not torch.save: a fifth of the time (its zip container), on a thread beside the step;
        # no fsync: shared memory does not outlive the host
        atomic_write_bytes(final, pickle.dumps(small, protocol=pickle.HIGHEST_PROTOCOL), durable=False)
        self._written.append(final)
        while len(self._written) > 3:  # the two slots' steps and one in flight
            self._written.pop(0).unlink(missing_ok=True)

    def close(self) -> None:
        """Finish the queued commits and stop the thread."""
        self._jobs.put(None)
        self._thread.join()
        self._ready.wait(timeout=60)  # never unmap under a pin in progress
        for f in (self.file, self._host_file):
            if f is not None:
                f.close()
        self.file = self._host_file = None


def _small_files(directory: Path, rank: int) -> dict[int, Path]:
    out = {}
    try:
        names = list(directory.iterdir())
    except OSError:
        return out
    for p in names:
        m = _META_RE.match(p.name)
        if m and int(m.group(1)) == rank:
            out[int(m.group(2))] = p
    return out


# ---- reader --------------------------------------------------------------------------------------


def complete_steps(directory: Path, rank: int) -> set[int]:
    """The steps this rank could resume from: complete tensors on this host and its own small state."""
    f = TensorFile.open(directory / "tensors")
    if f is None:
        return set()
    try:
        return set(f.complete_steps()) & set(_small_files(directory, rank))
    finally:
        f.close()


def discard_copies(directory: Path, rank: int, *, tensors: bool) -> None:
    """Remove this rank's small states (and the host's tensors, for their writer): copies of a
    trajectory the group did not resume from must never be resumed from later."""
    for path in _small_files(directory, rank).values():
        path.unlink(missing_ok=True)
    if tensors:
        (directory / "tensors").unlink(missing_ok=True)


def torn_slots(directory: Path) -> list[tuple[int, int]]:
    """(begin, end) of the slots a copy was being written into when its writer died."""
    f = TensorFile.open(directory / "tensors")
    if f is None:
        return []
    try:
        return [m for slot in (0, 1) if (m := f.marks(slot))[0] != m[1] and m[0] >= 0]
    finally:
        f.close()


def load_copy(trainer: Any, directory: Path, rank: int, step: int) -> bool:
    """Restore the copy of `step` into the trainer; False if it is no longer complete."""
    f = TensorFile.open(directory / "tensors")
    if f is None:
        return False
    try:
        slot = f.complete_steps().get(step)
        path = _small_files(directory, rank).get(step)
        if slot is None or path is None:
            return False
        small = pickle.loads(path.read_bytes())  # this job's own file, in a 0700 directory
        views = f.views(slot)
        # Into the trainer by copy: on the CPU the optimizer would otherwise keep views of the file.
        tensors = {k: v.to(trainer.device, copy=True) for k, v in views.items()}
        if f.marks(slot) != (step, step):
            return False
        restore(trainer, tensors, small)
        return True
    finally:
        f.close()
