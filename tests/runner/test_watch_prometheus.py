"""`watch --prometheus`: a real HTTP server scraped over loopback with urllib, serving the snapshot the
detectors judged; bound to 127.0.0.1 unless told otherwise; its own registry."""

from __future__ import annotations

import socket
import sys
import urllib.error
import urllib.request
from typing import Any

import prometheus_client
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_watch_fakes import gpu, healthy_sample, worker

from runner.errors import RunnerError
from runner.watch.detectors import detect
from runner.watch.prometheus import PrometheusExporter, parse_bind
from runner.watch.snapshot import History
from runner.watch.thresholds import Thresholds

T0 = 1_800_000_000.0
RUN = "field-20261201-000000"
MIB = 2**20


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.type == "gauge", fam.name
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    want = frozenset({"run": RUN, "host": "gpu-host", **labels}.items())
    hits = [v for (n, ls), v in m.items() if n == name and ls == want]
    assert len(hits) == 1, f"{name}{labels}: {[k for k in m if k[0] == name]}"
    return hits[0]


def series(m: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str) -> list[dict[str, str]]:
    return [dict(ls) for (n, ls), _ in m.items() if n == name]


def field_like_sample(t: float) -> dict[str, Any]:
    """drafter-1's process is gone and GPU 3 idles with memory held; GPU 1 cannot read its temperature."""
    s = healthy_sample(t)
    s["gpus"][1] = gpu(1, util=95, temp_c="n/a", power_w="n/a")
    s["gpus"][3] = gpu(3, util=0, used=96000.0)
    s["workers"]["drafter-1"] = worker(
        "drafter-1", 3, alive=False, proc_state="gone", age_s=40.0, progress_age_s=45.0, state="computing"
    )
    s["workers"]["drafter-0"] = worker("drafter-0", 2, state="waiting_input", step=812, age_s=0.7)
    s["metrics"] = [
        {
            "t": t - 2,
            "step": 812,
            "loss": 3.25,
            "acc": 0.41,
            "tok_s": 4600.0,
            "tgt_bps": 0.11,
            "dft_bps": 0.1,
            "q_pre": [50, 46],
            "q_hs": [0],
            "eta_s": 36.9 * 86400,
        }
    ]
    return s


@pytest.fixture
def exporter() -> Any:
    with PrometheusExporter(port=0) as e:
        yield e


def test_scraped_gauges_match_the_snapshot(exporter: PrometheusExporter) -> None:
    snap = History().ingest(field_like_sample(T0))
    findings = detect([snap], Thresholds())
    assert any(f.kind == "dead_worker" and f.severity == "critical" for f in findings)
    exporter.update(snap, findings)
    m = scrape(exporter.url)

    d1 = {"gpu": "3", "role": "drafter", "worker": "drafter-1"}
    assert value(m, "dflash_gpu_memory_used_bytes", **d1) == 96000.0 * MIB
    assert value(m, "dflash_gpu_memory_total_bytes", **d1) == 97887.0 * MIB
    assert value(m, "dflash_gpu_utilization_percent", **d1) == 0.0
    t0 = {"gpu": "0", "role": "target", "worker": "target-0"}
    assert value(m, "dflash_gpu_utilization_percent", **t0) == 97.0
    assert value(m, "dflash_gpu_temperature_celsius", **t0) == 60.0
    assert value(m, "dflash_gpu_power_watts", **t0) == 400.0
    assert {s["gpu"] for s in series(m, "dflash_gpu_temperature_celsius")} == {"0", "2", "3"}, (
        "an n/a reading is left out, not exported as 0"
    )
    assert {s["gpu"] for s in series(m, "dflash_gpu_power_watts")} == {"0", "2", "3"}

    w0 = {"worker": "drafter-0", "role": "drafter"}
    states = {s["state"]: value(m, "dflash_worker_state", **w0, state=s["state"])
              for s in series(m, "dflash_worker_state") if s["worker"] == "drafter-0"}  # fmt: skip
    assert states["waiting_input"] == 1.0 and sum(states.values()) == 1.0 and "unknown" in states
    assert value(m, "dflash_worker_step", **w0) == 812
    assert value(m, "dflash_worker_heartbeat_age_seconds", **w0) == 0.7
    assert value(m, "dflash_worker_alive", **w0) == 1.0
    assert value(m, "dflash_worker_alive", worker="drafter-1", role="drafter") == 0.0
    assert value(m, "dflash_worker_heartbeat_age_seconds", worker="drafter-1", role="drafter") == 40.0
    assert value(m, "dflash_worker_progress_age_seconds", worker="drafter-1", role="drafter") == 45.0

    assert value(m, "dflash_pipeline_tokens_per_second") == 4600.0
    assert value(m, "dflash_pipeline_target_batches_per_second") == 0.11
    assert value(m, "dflash_pipeline_drafter_steps_per_second") == 0.1
    assert value(m, "dflash_pipeline_eta_seconds") == pytest.approx(36.9 * 86400)
    assert [value(m, "dflash_pipeline_q_pre", target=str(i)) for i in range(2)] == [50, 46]
    assert value(m, "dflash_pipeline_q_hs", queue="0") == 0
    assert value(m, "dflash_pipeline_prefetch_depth") == 50 and value(m, "dflash_pipeline_queue_depth") == 8
    assert value(m, "dflash_train_loss") == 3.25 and value(m, "dflash_train_step") == 812

    by_sev = {sev: value(m, "dflash_watch_findings", severity=sev) for sev in ("info", "warning", "critical")}
    assert by_sev == {s: float(sum(f.severity == s for f in findings)) for s in by_sev}
    assert by_sev["critical"] >= 1
    assert value(m, "dflash_watch_health") == 2.0
    dead = value(m, "dflash_watch_finding", severity="critical", kind="dead_worker", subject="drafter-1")
    assert dead == 1.0
    assert value(m, "dflash_watch_nvml_ok") == 1.0 and value(m, "dflash_watch_sampler_ok") == 1.0


def test_each_scrape_shows_the_newest_update(exporter: PrometheusExporter) -> None:
    h = History()
    bad = h.ingest(field_like_sample(T0))
    exporter.update(bad, detect([bad], Thresholds()))
    assert value(scrape(exporter.url), "dflash_watch_health") == 2.0
    sample = healthy_sample(T0 + 1)
    del sample["workers"]["drafter-1"]  # the restarted group has one drafter fewer
    ok = h.ingest(sample)
    assert detect([ok], Thresholds()) == []
    exporter.update(ok, [])
    m = scrape(exporter.url)
    assert value(m, "dflash_watch_health") == 0.0
    assert value(m, "dflash_watch_findings", severity="critical") == 0.0
    assert series(m, "dflash_watch_finding") == [], "a finding that cleared is gone"
    assert "drafter-1" not in {s["worker"] for s in series(m, "dflash_worker_alive")}, "a gone worker is gone"
    assert value(m, "dflash_gpu_temperature_celsius", gpu="1", role="target", worker="target-1") == 60.0


def test_one_update_per_host_each_kept(exporter: PrometheusExporter) -> None:
    node0 = History().ingest(field_like_sample(T0))
    node1 = History().ingest(healthy_sample(T0, host="gpu-host-2", run_dir="/runs/healthy-node1"))
    exporter.update(node0, detect([node0], Thresholds()))
    exporter.update(node1, [])
    exporter.update(node0, detect([node0], Thresholds()))  # the next refresh replaces node 0's only
    m = scrape(exporter.url)
    assert value(m, "dflash_watch_health") == 2.0
    other = {"run": RUN, "host": "gpu-host-2"}
    assert m[("dflash_watch_health", frozenset(other.items()))] == 0.0
    assert len(series(m, "dflash_watch_health")) == 2
    used = series(m, "dflash_gpu_memory_used_bytes")
    assert sorted((s["host"], s["gpu"]) for s in used) == sorted(
        [(h, str(i)) for h in ("gpu-host", "gpu-host-2") for i in range(4)]
    )
    # two nodes on one machine (loopback) report one host name: kept apart, not duplicated
    twin = History().ingest(healthy_sample(T0, run_dir="/runs/healthy-node2"))
    exporter.update(twin, [])
    hosts = sorted(s["host"] for s in series(scrape(exporter.url), "dflash_watch_health"))
    assert hosts == ["gpu-host", "gpu-host-2", "gpu-host:/runs/healthy-node2"]


def test_before_the_first_update_a_scrape_is_empty_not_an_error(exporter: PrometheusExporter) -> None:
    assert scrape(exporter.url) == {}


def _listening(port: int) -> list[str]:
    me = psutil.Process()
    conns = me.net_connections(kind="inet") if hasattr(me, "net_connections") else me.connections(kind="inet")
    return [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def _outside_address() -> str | None:
    """An address of this machine other than loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.254.254.254", 1))  # no packet is sent: this only picks the outgoing interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else str(ip)


def test_bound_to_loopback_by_default(exporter: PrometheusExporter) -> None:
    assert _listening(exporter.port) == ["127.0.0.1"], "listening on loopback only, not 0.0.0.0"
    assert exporter.url == f"http://127.0.0.1:{exporter.port}/metrics"
    other = _outside_address()
    if other is not None:
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://{other}:{exporter.port}/metrics", timeout=5)


def test_all_interfaces_only_when_asked() -> None:
    host, _ = parse_bind("0.0.0.0:9464")
    with PrometheusExporter(host, port=0) as e:
        assert _listening(e.port) == ["0.0.0.0"]
        e.update(History().ingest(healthy_sample(T0)), [])
        assert value(scrape(f"http://127.0.0.1:{e.port}/metrics"), "dflash_watch_health") == 0.0


def test_a_port_in_use_is_a_runner_error(exporter: PrometheusExporter) -> None:
    with pytest.raises(RunnerError, match=f"cannot serve Prometheus metrics on 127.0.0.1:{exporter.port}"):
        PrometheusExporter(port=exporter.port)


def test_without_prometheus_client_it_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    with pytest.raises(RunnerError, match="needs the prometheus-client package"):
        PrometheusExporter(port=0)


def test_its_own_registry_not_the_global_one(exporter: PrometheusExporter) -> None:
    exporter.update(History().ingest(healthy_sample(T0)), [])
    assert exporter.registry is not prometheus_client.REGISTRY
    assert b"dflash_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)
    assert b"dflash_watch_health" in prometheus_client.generate_latest(exporter.registry)
    assert b"process_cpu_seconds_total" not in prometheus_client.generate_latest(exporter.registry)


@pytest.mark.parametrize(
    "text,want",
    [
        ("9464", ("127.0.0.1", 9464)),
        (":9464", ("127.0.0.1", 9464)),
        ("0.0.0.0:9464", ("0.0.0.0", 9464)),
        ("localhost:80", ("localhost", 80)),
        ("[::1]:9464", ("::1", 9464)),
        (" 10.0.0.5:65535 ", ("10.0.0.5", 65535)),
    ],
)
def test_parse_bind(text: str, want: tuple[str, int]) -> None:
    assert parse_bind(text) == want


@pytest.mark.parametrize(
    "text,why",
    [
        ("0", "from 1 to 65535"),
        ("65536", "from 1 to 65535"),
        ("http", "from 1 to 65535"),
        ("host:", "from 1 to 65535"),
        ("-1", "from 1 to 65535"),
        ("::1:9464", "in brackets"),
        ("[::1]9464", "from 1 to 65535"),
        ("a b:80", "not a host name"),
        ("$(id):80", "not a host name"),
    ],
)
def test_parse_bind_refuses(text: str, why: str) -> None:
    with pytest.raises(RunnerError, match=why):
        parse_bind(text)


def test_the_newest_tau_is_a_gauge(exporter: PrometheusExporter) -> None:
    s = healthy_sample(T0)
    s["events"] = [
        {"t": T0 - 20, "event": "tau", "step": 200, "tau": 1.4, "acc": 0.2},
        {"t": T0 - 10, "event": "tau", "step": 400, "tau": 1.75, "acc": 0.25},
    ]
    snap = History().ingest(s)
    exporter.update(snap, detect([snap], Thresholds()))
    m = scrape(exporter.url)
    assert value(m, "dflash_drafter_tau") == 1.75 and value(m, "dflash_drafter_tau_step") == 400
    assert value(m, "dflash_watch_finding", severity="info", kind="tau", subject="drafter") == 1.0
