"""A GPU hardware fault takes precedence over the worker on it (issue 50 part 3): the advice is to
drain the GPU, watch neither kills the worker on it (the group would restart onto it) nor relaunches
a job placed on it, and the GPU keeps its index and name in every finding, also once NVML stops
answering for it (an XID of a lost GPU named "GPU -1" before)."""

from __future__ import annotations

import copy
from typing import Any

from test_watch_fakes import healthy_sample

from runner.watch.actions import ActorState, Policy, plan_actions
from runner.watch.detectors import detect
from runner.watch.fakenvml import FakeGPU, FakeNVML
from runner.watch.nvml import NVML
from runner.watch.snapshot import History

T0 = 1_800_000_000.0


def _judge(s: dict[str, Any]) -> tuple[Any, list[Any]]:
    history = History()
    snap = history.ingest(s)
    return snap, detect(history.snapshots)


def _acts(snap: Any, findings: list[Any]) -> list[str]:
    """What a fresh acting watch would do now (restarts on, a relaunch possible)."""
    return [a.action for a in plan_actions(snap, findings, ActorState(), Policy(), now=T0, can_relaunch=True)]


def _with(s: dict[str, Any], **drafter0: Any) -> dict[str, Any]:
    s = copy.deepcopy(s)
    s["workers"]["drafter-0"].update(drafter0)
    return s


def test_an_xid_of_a_gpu_that_is_lost_keeps_its_index_and_name() -> None:
    fake = FakeNVML([FakeGPU(), FakeGPU(), FakeGPU(name="NVIDIA H200")])
    nvml = NVML(fake)
    assert nvml.read_gpus()[2]["name"] == "NVIDIA H200"
    assert nvml.poll_xids(wait_ms=1) == []  # registered while the GPU answered
    fake.gpus[2].lost = True
    fake.inject_xid(2, 79)
    (x,) = nvml.poll_xids()
    assert (x["gpu"], x["xid"], x["name"]) == (2, 79, "NVIDIA H200")
    lost = nvml.read_gpus()[2]
    assert lost["name"] == "NVIDIA H200" and lost["faults"], "the last known name stays with the lost GPU"


def test_the_drain_advice_replaces_the_restart_advice_and_watch_does_not_act() -> None:
    s = healthy_sample(T0)
    s["gpus"][2]["name"] = "NVIDIA H200"
    s["xid"] = [{"t": T0 - 5, "gpu": 2, "xid": 79, "name": "NVIDIA H200"}]
    frozen = _with(s, age_s=40.0, progress_age_s=40.0, proc_state="running")  # on GPU 2
    snap, findings = _judge(frozen)
    by_kind = {f.kind: f for f in findings}
    xid, hung = by_kind["gpu_xid"], by_kind["hung_worker"]
    assert xid.subject == "GPU 2" and "GPU 2 (NVIDIA H200, drafter-0): XID 79" in xid.message
    assert "drain the GPU" in xid.advice and "does not restart a worker onto it" in xid.advice
    assert hung.subject == "drafter-0" and hung.advice.startswith("GPU 2 (NVIDIA H200) has a hardware fault")
    assert "restarts its drafter group by itself" not in hung.advice
    assert (hung.numbers["gpu"], hung.numbers["gpu_name"]) == (2, "NVIDIA H200")
    assert _acts(snap, findings) == [], "no kill onto a lost GPU"
    # The same hung drafter on a healthy GPU is killed (the group restarts): the fault is what holds watch.
    healthy_gpu = copy.deepcopy(frozen)
    healthy_gpu["xid"] = []
    snap, findings = _judge(healthy_gpu)
    assert _acts(snap, findings) == ["terminate"]


def test_a_stopped_job_on_a_lost_gpu_is_not_relaunched() -> None:
    s = healthy_sample(T0)
    s["gpus"][2]["faults"] = {"nvmlDeviceGetMemoryInfo": "GPU is lost"}
    s["job"] = {"lock_pid": None, "lock_held": False}  # the job exited
    s["events"] = [
        {"t": T0 - 60, "event": "launched"},
        {"t": T0 - 5, "event": "stopped", "reason": "drafter group failed"},
    ]
    snap, findings = _judge(s)
    assert ("critical", "gpu_fault", "GPU 2") in [(f.severity, f.kind, f.subject) for f in findings]
    assert _acts(snap, findings) == []
    s["gpus"][2]["faults"] = {}
    assert _acts(*_judge(s)) == ["relaunch"]


def test_an_application_xid_keeps_the_worker_advice() -> None:
    s = healthy_sample(T0)
    s["xid"] = [{"t": T0 - 5, "gpu": 2, "xid": 13}]
    _, findings = _judge(s)
    (xid,) = [f for f in findings if f.kind == "gpu_xid"]
    assert xid.severity == "warning" and "application XID" in xid.advice
