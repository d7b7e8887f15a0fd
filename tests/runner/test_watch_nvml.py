"""NVML's choke point: n/a instead of exceptions, a deadline on every call, version fallbacks, XIDs.
FakeNVML stands in for the GPUs; the real pynvml is exercised too, on this GPU-less machine."""

from __future__ import annotations

import json
import pickle
import threading
import time

from runner.watch.fakenvml import FakeGPU, FakeNVML
from runner.watch.nvml import NA, NVML, decode_clock_reasons, json_default, known


def test_na_is_one_falsy_value_written_as_n_a() -> None:
    assert not NA and str(NA) == "n/a" and repr(NA) == "n/a"
    assert pickle.loads(pickle.dumps(NA)) is NA
    assert json.dumps({"x": NA}, default=json_default) == '{"x": "n/a"}'
    assert not known(NA) and not known("n/a") and not known(None) and known(0)


def test_reads_every_field_in_mib_and_words() -> None:
    fake = FakeNVML(
        [
            FakeGPU(
                mem_used_mb=10240, util_gpu=99, util_mem=40, temp_c=61, power_w=612.5, procs=[[498, 10240.0]]
            )
        ]
    )
    fake.gpus[0].clock_reasons = 0x4 | 0x8 | 0x40
    g = NVML(fake).read_gpus()[0]
    assert g["mem_used_mb"] == 10240 and g["mem_total_mb"] == 143771
    assert (g["util_gpu"], g["util_mem"], g["temp_c"], g["power_w"]) == (99, 40, 61, 612.5)
    assert g["throttle"] == ["power cap", "hw slowdown", "hw thermal"]
    assert (g["ecc_mode"], g["ecc_uncorrected"], g["ecc_corrected"]) == (True, 0, 0)
    assert g["procs"] == [{"pid": 498, "mem_mb": 10240.0}]
    assert g["uuid"] == "GPU-fake-0" and g["faults"] == {}
    assert decode_clock_reasons(NA) is NA and decode_clock_reasons(0) == []


def test_unsupported_fields_are_na_not_errors() -> None:
    fake = FakeNVML(
        [FakeGPU(ecc_mode=None, not_supported={"nvmlDeviceGetPowerUsage", "nvmlDeviceGetTemperature"})]
    )
    g = NVML(fake).read_gpu(0)
    assert g["power_w"] is NA and g["temp_c"] is NA
    assert g["ecc_mode"] is NA and g["ecc_uncorrected"] is NA  # consumer GPUs: no ECC
    assert g["mem_used_mb"] == 0 and g["util_gpu"] == 0  # the rest still answers


def test_memory_v1_when_v2_is_unsupported() -> None:
    fake = FakeNVML([FakeGPU(mem_used_mb=5, not_supported={"nvmlDeviceGetMemoryInfo_v2"})])
    assert NVML(fake).read_gpu(0)["mem_used_mb"] == 5
    assert fake.calls["nvmlDeviceGetMemoryInfo_v2"] == 1 and fake.calls["nvmlDeviceGetMemoryInfo"] == 1


def test_process_calls_fall_back_v3_v2_v1_and_remember_the_one_that_answered() -> None:
    v3 = "nvmlDeviceGetComputeRunningProcesses_v3"
    v2 = "nvmlDeviceGetComputeRunningProcesses_v2"
    fake = FakeNVML([FakeGPU(procs=[[11, 100.0], [12, None]], not_supported={v2})], missing={v3})
    nvml = NVML(fake)
    procs = nvml.read_gpu(0)["procs"]
    assert procs == [{"pid": 11, "mem_mb": 100.0}, {"pid": 12, "mem_mb": NA}]  # None: not reported
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 1
    nvml.read_gpu(0)
    assert fake.calls[v2] == 1, "the unsupported version is not asked again every second"
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 2


def test_processes_na_when_no_version_answers_and_graphics_merged() -> None:
    names = {
        f"nvmlDeviceGet{k}RunningProcesses{v}" for k in ("Compute", "Graphics") for v in ("_v3", "_v2", "")
    }
    assert NVML(FakeNVML([FakeGPU(not_supported=names)])).read_gpu(0)["procs"] is NA
    fake = FakeNVML([FakeGPU(procs=[[5, 10.0]], graphics_procs=[[5, 30.0], [6, 1.0]])])
    assert NVML(fake).read_gpu(0)["procs"] == [{"pid": 5, "mem_mb": 30.0}, {"pid": 6, "mem_mb": 1.0}]


def test_a_hanging_call_names_its_gpu_and_call_and_leaves_the_other_gpus_read() -> None:
    fake = FakeNVML([FakeGPU(util_gpu=50, hang={"nvmlDeviceGetUtilizationRates"}), FakeGPU(util_gpu=70)])
    nvml = NVML(fake, deadline_s=0.3)
    before = set(threading.enumerate())
    t0 = time.monotonic()
    first = nvml.read_gpus()
    took = time.monotonic() - t0
    assert 0.3 <= took < 1.5, took
    assert nvml.status == "ok", "one GPU's stuck call is not NVML as a whole"
    assert first[0]["mem_used_mb"] == 0 and first[0]["util_gpu"] is NA, "read before the stuck call: kept"
    assert first[0]["stuck_call"] == "nvmlDeviceGetUtilizationRates" and first[0]["stuck_s"] >= 0.3
    assert first[1]["util_gpu"] == 70 and "stuck_call" not in first[1]
    [stuck] = nvml.stuck_calls()
    assert stuck["gpu"] == 0 and stuck["call"] == "nvmlDeviceGetUtilizationRates"
    calls = fake.calls["nvmlDeviceGetName"]
    t0 = time.monotonic()
    second = nvml.read_gpus()
    # Blocked again would cost another deadline (0.3 s); the count below proves GPU 0 was not asked.
    assert time.monotonic() - t0 < 0.3, "the caller is not blocked again while the call is stuck"
    assert fake.calls["nvmlDeviceGetName"] == calls + 1, "only GPU 1 is read while GPU 0's call hangs"
    assert second[0]["stuck_call"] == "nvmlDeviceGetUtilizationRates" and second[1]["util_gpu"] == 70
    mine = [t for t in threading.enumerate() if t.name == "nvml-calls" and t not in before]
    assert len(mine) == 2, "the stuck call keeps its thread; a fresh one reads the rest"
    fake.release()
    deadline = time.monotonic() + 5
    while nvml.stuck_calls() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert nvml.stuck_calls() == [] and nvml.status == "ok"
    assert [g["util_gpu"] for g in nvml.read_gpus()] == [50, 70]
    for t in mine:
        t.join(timeout=0.2)
    assert sum(t.is_alive() for t in mine) == 1, "the left-behind thread exits once its call returns"


def test_a_stuck_call_about_no_one_gpu_or_too_many_stuck_make_nvml_not_answering() -> None:
    fake = FakeNVML([FakeGPU()], hang={"nvmlDeviceGetCount"})
    nvml = NVML(fake, deadline_s=0.2)
    assert nvml.read_gpus() == [] and nvml.status == "not answering"
    assert nvml.stuck_calls()[0]["gpu"] is None and nvml.stuck_calls()[0]["call"] == "nvmlDeviceGetCount"
    fake.release()
    # Every GPU hanging (a driver lock): at most four deadlines are spent, then nothing is asked.
    hung = {"nvmlDeviceGetName"}
    fake = FakeNVML([FakeGPU(hang=hung) for _ in range(6)])
    nvml = NVML(fake, deadline_s=0.2)
    t0 = time.monotonic()
    gpus = nvml.read_gpus()
    assert time.monotonic() - t0 < 0.2 * 4 + 0.5
    assert nvml.status == "not answering" and [s["gpu"] for s in nvml.stuck_calls()] == [0, 1, 2, 3]
    assert all(g["mem_used_mb"] is NA for g in gpus) and [g["index"] for g in gpus] == list(range(6))
    fake.release()


def test_init_failure_is_unavailable_and_retried() -> None:
    fake = FakeNVML([FakeGPU()], init_error=9)
    nvml = NVML(fake, retry_init_s=0.0)
    assert nvml.read_gpus() == [] and nvml.status == "unavailable: driver not loaded"
    fake.init_error = None
    assert len(nvml.read_gpus()) == 1 and nvml.status == "ok"


def test_without_pynvml_installed() -> None:
    def missing() -> object:
        raise ImportError("No module named 'pynvml'")

    nvml = NVML(loader=missing)
    assert nvml.read_gpus() == [] and nvml.poll_xids() is NA
    assert nvml.status == "unavailable: nvidia-ml-py (pynvml) is not installed"


def test_real_pynvml_on_a_machine_without_a_driver() -> None:
    nvml = NVML()  # the real nvidia-ml-py: no libnvidia-ml here, so it must say so, not raise
    gpus = nvml.read_gpus()
    if nvml.status == "ok":  # on the GPU host: real readings
        assert gpus and all(isinstance(g["mem_total_mb"], float) for g in gpus)
    else:
        assert gpus == [] and nvml.status.startswith("unavailable: ")


def test_lost_gpu_is_a_fault_not_an_exception() -> None:
    fake = FakeNVML([FakeGPU(lost=True), FakeGPU()])
    gpus = NVML(fake).read_gpus()
    assert gpus[0]["mem_used_mb"] is NA and "GPU is lost" in gpus[0]["faults"].values()
    assert gpus[1]["faults"] == {}


def test_xid_events_registered_once_and_polled_with_a_short_wait() -> None:
    fake = FakeNVML([FakeGPU(), FakeGPU()])
    nvml = NVML(fake)
    assert nvml.poll_xids(wait_ms=20) == []
    assert fake.event_waits_ms == [20], "one wait of the poll's own short timeout"
    fake.inject_xid(1, 79)
    fake.inject_xid(0, 13)
    got = nvml.poll_xids()
    assert [(x["gpu"], x["xid"]) for x in got] == [(1, 79), (0, 13)]
    # After the first event, the rest are drained without waiting.
    assert fake.event_waits_ms[1:] == [10, 0, 0]
    nvml.poll_xids()
    assert fake.calls["nvmlEventSetCreate"] == 1 and fake.calls["nvmlDeviceRegisterEvents"] == 2
    assert NVML(FakeNVML([FakeGPU()], xid_supported=False)).poll_xids() is NA


def test_pcie_throughput_is_off_the_one_hertz_path() -> None:
    fake = FakeNVML([FakeGPU()])
    nvml = NVML(fake)
    nvml.read_gpus()
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0
    assert nvml.pcie_throughput(0) == {"tx_kbps": 1000, "rx_kbps": 1001}


def test_stuck_call_does_not_keep_the_process_alive() -> None:
    fake = FakeNVML([FakeGPU(hang={"nvmlDeviceGetName"})])
    NVML(fake, deadline_s=0.05).read_gpus()
    stuck = [t for t in threading.enumerate() if t.name == "nvml-calls"]
    assert stuck and all(t.daemon for t in stuck)
    fake.release()
