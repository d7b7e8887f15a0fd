"""`dflashctl watch --prometheus [HOST:]PORT`: the snapshot the dashboard shows, as Prometheus gauges.

    exporter = PrometheusExporter(*parse_bind("9464"))      # serves http://127.0.0.1:9464/metrics
    exporter.update(snapshot, findings)                     # after each refresh: no work until a scrape
    exporter.close()

Bound to 127.0.0.1 unless a host is given: the numbers name hosts, pids and GPUs, which a shared
machine's other users need not see. The exporter has its own CollectorRegistry (not the process-wide
one, so nothing else a process registers leaks in), and one collector that renders the newest
snapshot at scrape time: a worker or GPU that has gone is gone from the next scrape, not stuck at its
last value. Unknown readings (the sampler's "n/a") are left out, not exported as 0.
prometheus_client is imported when an exporter is made: a dflashctl installed without it still runs
every other verb, and --prometheus says what to install.

Every series carries `run` (run.json's run_id) and `host`. Units are Prometheus base units (bytes,
seconds, watts, celsius) except utilization, in percent as NVML and DCGM's exporter report it.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from runner.errors import RunnerError
from runner.rundir import WORKER_STATES as HEARTBEAT_STATES
from runner.rundir import tau_series
from runner.watch.findings import SEVERITY_RANK, Finding, exit_code
from runner.watch.snapshot import GpuView, Snapshot

if TYPE_CHECKING:
    from prometheus_client.core import GaugeMetricFamily, Metric

DEFAULT_HOST = "127.0.0.1"
WORKER_STATES = (*HEARTBEAT_STATES, "unknown")
"""The heartbeat's states; anything else (or none) counts as unknown."""
MIB = 2**20
_HOST_RE = re.compile(r"^[A-Za-z0-9_.:%-]+$")


def parse_bind(text: str) -> tuple[str, int]:
    """`PORT`, `HOST:PORT` or `[IPv6]:PORT` -> (host, port); the host defaults to 127.0.0.1."""
    s = text.strip()
    host, port_s = DEFAULT_HOST, s
    if s.startswith("["):
        end = s.find("]")
        if end < 0 or s[end + 1 : end + 2] != ":":
            port_s = ""  # reported below
        else:
            host, port_s = s[1:end], s[end + 2 :]
    elif ":" in s:
        host, _, port_s = s.rpartition(":")
        if ":" in host:
            raise RunnerError(f"--prometheus {text!r}: write an IPv6 address in brackets, e.g. [::1]:9464")
        host = host or DEFAULT_HOST
    if not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
        raise RunnerError(
            f"--prometheus {text!r}: the port must be a number from 1 to 65535; give PORT or HOST:PORT, "
            "e.g. 9464 (this machine only) or 0.0.0.0:9464 (every interface)"
        )
    if not host or not _HOST_RE.match(host):
        raise RunnerError(f"--prometheus {text!r}: {host!r} is not a host name or address")
    return host, int(port_s)


def _gpu_labels(g: GpuView, snap: Snapshot) -> tuple[str, str]:
    """(role, worker) of the GPU: comma-joined when several share it (co-located mode), "" if none."""
    ws = [w for w in (snap.worker(n) for n in g.workers) if w is not None]
    return ",".join(sorted({w.role for w in ws})), ",".join(w.name for w in ws)


class _Families:
    """Gauge families whose every sample carries the run and host labels of the snapshot being added."""

    def __init__(self) -> None:
        self.base: list[str] = []
        self.all: dict[str, GaugeMetricFamily] = {}

    def add(self, name: str, doc: str, labels: Sequence[str], values: Sequence[str], value: Any) -> None:
        from prometheus_client.core import GaugeMetricFamily

        if value is None:
            return  # unknown: no sample rather than a made-up 0
        fam = self.all.get(name)
        if fam is None:
            fam = self.all[name] = GaugeMetricFamily(name, doc, labels=["run", "host", *labels])
        fam.add_metric([*self.base, *values], float(value))


View = tuple[Snapshot, Sequence[Finding], float]
"""A host's newest snapshot, its findings, and when it was handed over."""


def families(views: Iterable[View]) -> list[Metric]:
    """The gauges of every host's newest snapshot (what a scrape returns)."""
    f = _Families()
    seen: set[tuple[str, str]] = set()
    for snap, findings, at in views:
        run = str(snap.manifest.get("run_id") or PurePath(snap.run_dir or "run").name)
        host = snap.host
        if (run, host) in seen:  # two nodes answering with one host name (loopback): keep them apart
            host = f"{host}:{snap.run_dir}"
        seen.add((run, host))
        f.base = [run, host]
        _add(f, snap, findings, at)
    return list(f.all.values())


def _add(f: _Families, snap: Snapshot, findings: Sequence[Finding], updated_at: float) -> None:
    gl = ["gpu", "role", "worker"]
    for g in snap.gpus:
        lv = [str(g.index), *_gpu_labels(g, snap)]
        used = None if g.mem_used_mb is None else g.mem_used_mb * MIB
        total = None if g.mem_total_mb is None else g.mem_total_mb * MIB
        f.add("dflash_gpu_memory_used_bytes", "GPU memory in use (NVML).", gl, lv, used)
        f.add("dflash_gpu_memory_total_bytes", "GPU memory in total (NVML).", gl, lv, total)
        f.add(
            "dflash_gpu_utilization_percent",
            "GPU utilization over NVML's last sample period.",
            gl,
            lv,
            g.util_gpu,
        )
        f.add("dflash_gpu_temperature_celsius", "GPU temperature.", gl, lv, g.temp_c)
        f.add("dflash_gpu_power_watts", "GPU power draw.", gl, lv, g.power_w)
    wl = ["worker", "role"]
    for w in snap.workers:
        lv = [w.name, w.role]
        state = w.state if w.state in WORKER_STATES else "unknown"
        for s in WORKER_STATES:
            f.add(
                "dflash_worker_state",
                "1 for the state the worker's heartbeat reports, 0 for the others.",
                [*wl, "state"],
                [*lv, s],
                int(s == state),
            )
        f.add("dflash_worker_step", "Drafter: optimizer steps; target: batches published.", wl, lv, w.step)
        f.add(
            "dflash_worker_heartbeat_age_seconds",
            "Seconds since the heartbeat was rewritten.",
            wl,
            lv,
            w.age_s,
        )
        f.add(
            "dflash_worker_progress_age_seconds",
            "Seconds since the worker last made progress.",
            wl,
            lv,
            w.progress_age_s,
        )
        f.add(
            "dflash_worker_alive",
            "1 while the worker's process exists, 0 once it is gone.",
            wl,
            lv,
            None if w.alive is None else int(w.alive),
        )
        f.add(
            "dflash_worker_gpu_memory_bytes",
            "GPU memory NVML reports for the worker's process.",
            wl,
            lv,
            None if w.gpu_mem_mb is None else w.gpu_mem_mb * MIB,
        )
    p = snap.pipeline
    if p is not None:
        for name, doc, value in (
            ("dflash_pipeline_tokens_per_second", "Real sequence tokens trained per second.", p.tok_s),
            ("dflash_pipeline_target_batches_per_second", "Target batches published per second.", p.tgt_bps),
            ("dflash_pipeline_drafter_steps_per_second", "Drafter steps per second.", p.dft_bps),
            ("dflash_pipeline_eta_seconds", "Seconds to train.total_steps at the current rate.", p.eta_s),
            ("dflash_pipeline_prefetch_depth", "Capacity of each target's prefetch queue.", p.prefetch_depth),
            ("dflash_pipeline_queue_depth", "Capacity of the hidden-state transport.", p.queue_depth),
            ("dflash_train_step", "Optimizer steps done (newest metrics record).", p.step),
            ("dflash_train_loss", "Mean weighted cross-entropy over the last interval.", p.loss),
            ("dflash_train_acc", "Top-1 accuracy over the last interval.", p.acc),
            ("dflash_pipeline_metrics_age_seconds", "Seconds since the newest metrics record.", p.age_s),
        ):
            f.add(name, doc, [], [], value)
        for i, q in enumerate(p.q_pre):
            f.add(
                "dflash_pipeline_q_pre",
                "Data batches waiting in a target's prefetch queue.",
                ["target"],
                [str(i)],
                q,
            )
        for i, q in enumerate(p.q_hs):
            f.add(
                "dflash_pipeline_q_hs", "Hidden-state batches ready in the transport.", ["queue"], [str(i)], q
            )
    taus = tau_series(snap.events)
    if taus:
        last = taus[-1]
        f.add("dflash_drafter_tau", "Newest tau: tokens per target verification under speculative decoding "
              "(the job's tau event, after a checkpoint).", [], [], last["tau"])  # fmt: skip
        f.add(
            "dflash_drafter_tau_step",
            "The step whose checkpoint gave dflash_drafter_tau.",
            [],
            [],
            last["step"],
        )
    for sev in SEVERITY_RANK:
        f.add(
            "dflash_watch_findings",
            "Current findings by severity.",
            ["severity"],
            [sev],
            sum(x.severity == sev for x in findings),
        )
    for x in findings:
        f.add(
            "dflash_watch_finding",
            "1 per current finding.",
            ["severity", "kind", "subject"],
            [x.severity, x.kind, x.subject],
            1,
        )
    f.add(
        "dflash_watch_health",
        "0 healthy, 1 warnings, 2 critical (watch --once's exit code).",
        [],
        [],
        exit_code(findings),
    )
    f.add(
        "dflash_watch_sample_age_seconds",
        "Seconds since the sampler's newest line.",
        [],
        [],
        snap.sample_age_s,
    )
    f.add("dflash_watch_sampler_ok", "1 while the sampler answers.", [], [], int(snap.source == "ok"))
    f.add("dflash_watch_nvml_ok", "1 while NVML answers.", [], [], int(snap.nvml == "ok"))
    f.add("dflash_watch_updated_timestamp_seconds", "Unix time of the newest update.", [], [], updated_at)


class _SnapshotCollector:
    """A prometheus_client collector (anything with collect()) over each host's newest update."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._views: dict[tuple[str, str], View] = {}

    def set(self, snap: Snapshot, findings: Iterable[Finding]) -> None:
        with self._lock:
            self._views[(snap.host, snap.run_dir)] = (snap, tuple(findings), time.time())

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            views = sorted(self._views.items())
        return iter(families(v for _, v in views))


class PrometheusExporter:
    """Serves /metrics over HTTP from a daemon thread; binds at construction (port 0: a free one)."""

    def __init__(self, host: str = DEFAULT_HOST, port: int = 0) -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError as e:
            raise RunnerError(
                "--prometheus needs the prometheus-client package: pip install 'prometheus-client>=0.20' "
                "into dflashctl's environment"
            ) from e
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = _SnapshotCollector()
        self.registry.register(self._collector)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise RunnerError(
                f"cannot serve Prometheus metrics on {host}:{port}: {e.strerror or e}; "
                "pick another port (--prometheus HOST:PORT)"
            ) from e
        self.host = host
        self.port = int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def update(self, snapshot: Snapshot, findings: Iterable[Finding]) -> None:
        """What the next scrape shows for this snapshot's host (and run directory): this snapshot and
        these findings. A run on several hosts: one update per host, each kept until its next."""
        self._collector.set(snapshot, findings)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> PrometheusExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
