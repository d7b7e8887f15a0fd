"""The shared-memory hidden-state queue, exercised by real processes on real /dev/shm segments.

Worker processes come from a forkserver that has imported torch once, so each start costs
milliseconds instead of a fresh interpreter's torch import; one test uses a plain `python -c`
subprocess to attach the way an unrelated target process does.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from dflash.errors import ConfigError
from dflash.pipeline.transport import (
    HiddenStateQueue,
    LeaseLostError,
    StaleGenerationError,
    TransportError,
    _alive,
    _process_start,
    name_for_run,
    segment_path,
    slot_bytes_for,
)

JOIN_S = 20


@pytest.fixture(scope="module")
def ctx() -> Any:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "dflash.pipeline.transport"])
    return context


@pytest.fixture
def qname() -> Iterator[str]:
    name = f"dflash-test-{uuid.uuid4().hex[:12]}"
    yield name
    segment_path(name).unlink(missing_ok=True)


def _item(producer: int, index: int) -> dict[str, torch.Tensor]:
    # bf16 payload plus an exact int64 copy of the identity, so a mixed-up slot cannot go unnoticed.
    return {
        "hidden_BTH": torch.full((2, 3, 4), float(index % 7) + producer / 4, dtype=torch.bfloat16),
        "ident_2": torch.tensor([producer, index], dtype=torch.int64),
    }


# ---- worker processes (module level so the forkserver can import them) ---------------------------
def _produce(name: str, producer: int, count: int) -> None:
    queue = HiddenStateQueue.attach(name)
    for index in range(count):
        ok = queue.put(_item(producer, index), {"producer": producer, "index": index}, timeout=JOIN_S)
        assert ok, "put timed out"
    queue.close()


def _consume(name: str, stop: Any, results: Any) -> None:
    """Take and ack batches until `stop` is set and the queue is empty; send what was seen."""
    queue = HiddenStateQueue.attach(name)
    queue.register_consumer(0)
    got = []
    while True:
        lease = queue.get(timeout=0.05)
        if lease is None:
            if stop.is_set():
                break
            continue
        expected = _item(lease.meta["producer"], lease.meta["index"])
        intact = all(torch.equal(lease.tensors[k], v) for k, v in expected.items())
        got.append((lease.token, lease.seq, lease.meta["producer"], lease.meta["index"], intact))
        queue.ack(lease)
    results.send(got)
    queue.close()


def _lease_and_hold(name: str, generation: int, go: Any, results: Any) -> None:
    """Lease one batch, report it, wait; then report what ack() and get() say (if still alive).

    Reports go through a pipe, written synchronously: a process killed after its report cannot
    die holding a lock of the channel (a multiprocessing.Queue's feeder thread could).
    """
    queue = HiddenStateQueue.attach(name)
    queue.register_consumer(generation)
    lease = queue.get(timeout=JOIN_S)
    assert lease is not None
    results.send(("leased", lease.seq))
    go.wait(JOIN_S)
    outcome = []
    for action in (lambda: queue.ack(lease), lambda: queue.get(timeout=0.05)):
        try:
            action()
            outcome.append("ok")
        except (LeaseLostError, StaleGenerationError) as e:
            outcome.append(type(e).__name__)
    results.send(("after", outcome))


def _hold_lock(name: str, ready: Any) -> None:
    queue = HiddenStateQueue.attach(name)
    with queue._locked():
        ready.set()
        time.sleep(JOIN_S)


def _reserve_and_hang(name: str, ready: Any) -> None:
    """A producer that dies between reserving a slot and publishing it."""
    queue = HiddenStateQueue.attach(name)
    assert queue._reserve() is not None
    ready.set()
    time.sleep(JOIN_S)


def _recv(conn: Any) -> Any:
    assert conn.poll(JOIN_S), "worker process did not report in time"
    return conn.recv()


def _holder(ctx: Any, name: str, generation: int) -> tuple[Any, Any, Any]:
    """Start a consumer that leases one batch and waits for `go`; returns (process, go, reports)."""
    reports, results = ctx.Pipe(duplex=False)
    go = ctx.Event()
    proc = ctx.Process(target=_lease_and_hold, args=(name, generation, go, results))
    proc.start()
    results.close()
    return proc, go, reports


def _kill(proc: Any) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(JOIN_S)


# ---- tests ---------------------------------------------------------------------------------------
def test_many_producers_many_consumers_exactly_once_fifo(ctx: Any, qname: str) -> None:
    producers, consumers, per_producer = 3, 2, 12
    total = producers * per_producer
    queue = HiddenStateQueue.create(qname, capacity=4, slot_bytes=8192)
    stop = ctx.Event()
    pipes = [ctx.Pipe(duplex=False) for _ in range(consumers)]
    procs = [ctx.Process(target=_consume, args=(qname, stop, sender)) for _, sender in pipes]
    procs += [ctx.Process(target=_produce, args=(qname, p, per_producer)) for p in range(producers)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + JOIN_S
    while queue.stats()["acked"] < total and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    got = [row for reports, _ in pipes for row in _recv(reports)]
    for proc in procs:
        proc.join(JOIN_S)
        assert proc.exitcode == 0
    assert all(intact for *_, intact in got), "a batch arrived with someone else's tensors"
    assert sorted((p, i) for _, _, p, i, _ in got) == [
        (p, i) for p in range(producers) for i in range(per_producer)
    ]
    assert sorted(seq for _, seq, *_ in got) == list(range(total)), "every publish delivered exactly once"
    # FIFO: in delivery order (the lease token) the publish order never goes backwards...
    by_delivery = [seq for _, seq, *_ in sorted(got)]
    assert by_delivery == sorted(by_delivery)
    # ...and each producer's batches were published in the order it put them.
    for p in range(producers):
        assert [i for _, _, q, i, _ in sorted(got, key=lambda r: r[1]) if q == p] == list(range(per_producer))
    stats = queue.stats()
    assert stats["produced"] == stats["delivered"] == stats["acked"] == total
    assert (stats["redelivered"], stats["depth"], stats["leased"], stats["free"]) == (0, 0, 0, 4)
    queue.close()


def test_put_blocks_when_full_until_ack_and_get_times_out(qname: str) -> None:
    queue = HiddenStateQueue.create(qname, capacity=2, slot_bytes=8192)
    queue.register_consumer(0)
    assert queue.put(_item(0, 0), {"i": 0}) and queue.put(_item(0, 1), {"i": 1})
    assert queue.depth() == 2
    waits: list[float] = []
    t0 = time.monotonic()
    assert queue.put(_item(0, 2), {"i": 2}, timeout=0.2, on_wait=lambda: waits.append(1.0)) is False
    assert time.monotonic() - t0 >= 0.2 and waits, "a full queue must wait and say so"

    done = threading.Event()

    def blocked_put() -> None:
        if queue.put(_item(0, 2), {"i": 2}, timeout=JOIN_S):
            done.set()

    writer = threading.Thread(target=blocked_put)
    writer.start()
    lease = queue.get(timeout=1)
    assert lease is not None and lease.meta == {"i": 0}
    assert not done.wait(0.15), "put must still block: the leased slot is not free before ack"
    queue.ack(lease)
    assert done.wait(5), "put must resume once a slot is acked"
    writer.join()
    assert [queue.get(timeout=1).meta["i"] for _ in range(2)] == [1, 2]  # type: ignore[union-attr]

    # get: empty -> times out with on_wait called; a set stop event returns at once.
    empty_waits: list[float] = []
    t0 = time.monotonic()
    assert queue.get(timeout=0.2, on_wait=lambda: empty_waits.append(1.0)) is None
    assert time.monotonic() - t0 >= 0.2 and empty_waits
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    t0 = time.monotonic()
    assert queue.get(stop=stop) is None and time.monotonic() - t0 < 5
    assert queue.put(_item(0, 3), {}, stop=stop) is False and queue.depth() == 0, "a stopped put adds nothing"
    queue.close()


def test_killed_consumer_lease_is_redelivered_once(ctx: Any, qname: str) -> None:
    queue = HiddenStateQueue.create(qname, capacity=3, slot_bytes=8192)
    for index in range(2):
        queue.put(_item(0, index), {"index": index})
    holder, _, reports = _holder(ctx, qname, 0)
    assert _recv(reports) == ("leased", 0)
    _kill(holder)

    assert queue.register_consumer(0) == 1, "the dead consumer's lease goes back"
    first = queue.get(timeout=1)
    assert first is not None and (first.seq, first.deliveries) == (0, 2), "reclaimed batch goes to the front"
    second = queue.get(timeout=1)
    assert second is not None and (second.seq, second.deliveries) == (1, 1)
    queue.ack(first)
    queue.ack(second)
    assert queue.get(timeout=0.05) is None, "nothing is delivered twice to the live group"
    stats = queue.stats()
    assert (stats["produced"], stats["delivered"], stats["acked"], stats["redelivered"]) == (2, 3, 2, 1)

    # Without any new registration, a consumer waiting in get() picks up a dead peer's lease itself.
    queue.put(_item(0, 2), {"index": 2})
    holder, _, reports = _holder(ctx, qname, 0)
    assert _recv(reports) == ("leased", 2)
    assert queue.get(timeout=0.05) is None
    _kill(holder)
    again = queue.get(timeout=2)
    assert again is not None and (again.seq, again.deliveries) == (2, 2)
    queue.ack(again)
    assert queue.stats()["redelivered"] == 2
    queue.close()


def test_liveness_sees_zombies_and_reused_pids() -> None:
    child = subprocess.Popen(["sleep", "30"])
    start = _process_start(child.pid)
    assert start is not None and _alive(child.pid, start)
    assert not _alive(child.pid, start + 1), "same pid, other start time: a reused pid, not our process"
    os.kill(child.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while _alive(child.pid, start) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(child.pid, start), "a killed child that nobody reaped yet (zombie) is dead"
    child.wait()
    assert _process_start(child.pid) is None


def test_newer_generation_fences_the_old_one(ctx: Any, qname: str) -> None:
    queue = HiddenStateQueue.create(qname, capacity=2, slot_bytes=8192)
    queue.put(_item(0, 0), {"index": 0})
    old, go, reports = _holder(ctx, qname, 0)
    assert _recv(reports) == ("leased", 0)

    assert queue.register_consumer(1) == 1, "a live consumer of generation 0 loses its lease to generation 1"
    lease = queue.get(timeout=1)
    assert lease is not None and lease.seq == 0 and lease.deliveries == 2
    go.set()
    assert _recv(reports) == ("after", ["LeaseLostError", "StaleGenerationError"])
    old.join(JOIN_S)
    queue.ack(lease)
    with pytest.raises(StaleGenerationError):
        HiddenStateQueue.attach(qname).register_consumer(0)
    stats = queue.stats()
    assert (stats["generation"], stats["acked"], stats["redelivered"], stats["free"]) == (1, 1, 1, 2)
    queue.close()


def test_process_killed_holding_the_lock_or_a_half_written_slot(ctx: Any, qname: str) -> None:
    queue = HiddenStateQueue.create(qname, capacity=1, slot_bytes=8192)
    ready = ctx.Event()
    locker = ctx.Process(target=_hold_lock, args=(qname, ready))
    locker.start()
    assert ready.wait(JOIN_S)
    done = threading.Event()
    writer = threading.Thread(target=lambda: queue.put(_item(0, 0), {}, timeout=JOIN_S) and done.set())
    writer.start()
    assert not done.wait(0.3), "the lock holder excludes others while it lives"
    _kill(locker)
    assert done.wait(5), "the kernel drops a dead holder's flock"
    writer.join()
    queue.register_consumer(0)
    lease = queue.get(timeout=1)
    assert lease is not None
    queue.ack(lease)

    # A producer dying between reserve and publish must not eat the only slot.
    ready = ctx.Event()
    hung = ctx.Process(target=_reserve_and_hang, args=(qname, ready))
    hung.start()
    assert ready.wait(JOIN_S)
    assert queue.stats()["writing"] == 1
    _kill(hung)
    assert queue.put(_item(0, 1), {"after": "abandoned"}, timeout=5)
    stats = queue.stats()
    assert (stats["abandoned_writes"], stats["ready"], stats["produced"]) == (1, 1, 2)
    queue.close()


_UNRELATED = """
import json, sys, torch
from dflash.pipeline.transport import HiddenStateQueue
q = HiddenStateQueue.attach(sys.argv[1])
depth_seen = q.depth()
q.register_consumer(0)
lease = q.get(timeout=10)
x = lease.tensors["x_TH"]
q.ack(lease)
q.put({"y_TH": x * 2}, {"from": "unrelated", "dtype": str(x.dtype)}, timeout=10)
print(json.dumps({"depth_seen": depth_seen, "meta": lease.meta, "stats": q.stats()}))
"""


def test_unrelated_process_attaches_by_name_bf16_round_trip(qname: str, python: str, repo: Any) -> None:
    queue = HiddenStateQueue.create(qname, capacity=2, slot_bytes=8192)
    queue.register_consumer(0)
    x_TH = (torch.arange(24, dtype=torch.float32).reshape(6, 4) / 7).to(torch.bfloat16)
    queue.put({"x_TH": x_TH}, {"sample_ids": [3, 9], "tokens": 24})
    proc = subprocess.run(
        [python, "-c", _UNRELATED, qname],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["depth_seen"] == 1 and report["meta"] == {"sample_ids": [3, 9], "tokens": 24}
    assert report["stats"]["ready"] == 1 and report["stats"]["acked"] == 1
    back = queue.get(timeout=1)
    assert back is not None and back.meta == {"from": "unrelated", "dtype": "torch.bfloat16"}
    assert back.tensors["y_TH"].dtype == torch.bfloat16 and torch.equal(back.tensors["y_TH"], x_TH * 2)
    queue.ack(back)
    queue.close()


def test_oversize_item_names_the_sizes_and_config_key(qname: str) -> None:
    queue = HiddenStateQueue.create(qname, capacity=1, slot_bytes=4096)
    with pytest.raises(ConfigError) as err:
        queue.put({"h_BTH": torch.zeros(1, 64, 64, dtype=torch.bfloat16)}, {})
    message = str(err.value)
    assert "pipeline.slot_mb" in message and "4096 bytes" in message and "(1, 64, 64) bfloat16" in message
    assert queue.stats()["free"] == 1, "a refused item reserves nothing"
    with pytest.raises(TransportError, match="JSON"):
        queue.put({"h": torch.zeros(1)}, {"bad": object()})
    queue.close()
    hidden = {
        "h_BTH": torch.zeros(1, 64, 64, dtype=torch.bfloat16),
        "ids_BT": torch.zeros(1, 64, dtype=torch.int64),
    }
    size = slot_bytes_for({k: (tuple(v.shape), v.dtype) for k, v in hidden.items()}, meta_bytes=4096)
    assert size % 4096 == 0 and size >= 64 * 64 * 2 + 64 * 8 + 4096
    sized = HiddenStateQueue.create(qname, capacity=1, slot_bytes=size)
    assert sized.put(hidden, {"sample_ids": list(range(500))})
    sized.close()


def test_create_replaces_stale_segment_and_attach_checks(qname: str) -> None:
    with pytest.raises(TransportError, match="supervisor creates it"):
        HiddenStateQueue.attach(qname)
    segment_path(qname).write_bytes(b"left over by a crashed run" * 100)
    with pytest.raises(TransportError, match="not a hidden-state queue"):
        HiddenStateQueue.attach(qname)
    stale = HiddenStateQueue.create(qname, capacity=2, slot_bytes=8192)
    stale.put(_item(0, 0), {})
    fresh = HiddenStateQueue.create(qname, capacity=3, slot_bytes=16384)
    assert (fresh.capacity, fresh.depth(), fresh.stats()["produced"]) == (3, 0, 0)
    stale.put(_item(0, 1), {})  # a straggler on the old mapping cannot touch the new queue
    assert fresh.depth() == 0 and HiddenStateQueue.attach(qname).capacity == 3
    stale.close()
    fresh.unlink()
    assert not segment_path(qname).exists()
    fresh.close()
    with pytest.raises(TransportError, match="bad hidden-state queue name"):
        segment_path("../escape")


def test_views_mode_and_names_for_runs(qname: str, tmp_path: Any) -> None:
    queue = HiddenStateQueue.create(qname, capacity=1, slot_bytes=8192)
    queue.register_consumer(0)
    queue.put({"a": torch.arange(5)}, {})
    lease = queue.get(timeout=1, copy=False)
    assert lease is not None and lease.tensors["a"].tolist() == [0, 1, 2, 3, 4]
    queue.ack(lease)
    queue.put({"a": torch.arange(5) + 10}, {})
    assert lease.tensors["a"].tolist() == [10, 11, 12, 13, 14], "views alias the slot, valid until ack"
    del lease
    queue.close()
    run_a, run_b = tmp_path / "runs" / "r1", tmp_path / "other" / "r1"
    assert name_for_run(run_a) == name_for_run(str(run_a)) != name_for_run(run_b)
    assert name_for_run(run_a).startswith("dflash-hs-r1-")
    assert sys.platform != "linux" or segment_path(name_for_run(run_a)).parent.as_posix() == "/dev/shm"


@pytest.mark.gpu
def test_cuda_round_trip_through_pinned_slots(qname: str) -> None:
    queue = HiddenStateQueue.create(qname, capacity=2, slot_bytes=1 << 20)
    queue.register_consumer(0)
    hidden_BTH = torch.randn(2, 64, 256, device="cuda").to(torch.bfloat16)
    assert queue.put({"hidden_BTH": hidden_BTH}, {"tokens": 128})
    assert queue.pinned, "the first CUDA copy page-locks the mapping (cudaHostRegister)"
    lease = queue.get(device="cuda", timeout=1)
    assert lease is not None and lease.tensors["hidden_BTH"].is_cuda
    assert torch.equal(lease.tensors["hidden_BTH"], hidden_BTH)
    queue.ack(lease)
    queue.close()
