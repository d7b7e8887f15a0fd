"""One `dflashctl watch`: a sampler per host of the run (a local subprocess, or the same program fed
to the host's python3 over the run's ssh connection), a Watcher and an Actor per host."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.cache.store import default_store_root
from runner.exec import remote
from runner.launch import backend
from runner.launch.apply import relaunch
from runner.launch.control import proc_tool
from runner.launch.registry import HostRecord, RunRecord
from runner.rundir import RunLocation, append_event, clean_stop
from runner.watch.actions import Actor, Policy, signal_args
from runner.watch.baseline import key_of, update_from_healthy_run
from runner.watch.bundle import sampler_argv
from runner.watch.findings import Finding, exit_code, sort_findings, stop_reason
from runner.watch.snapshot import Snapshot
from runner.watch.thresholds import Thresholds
from runner.watch.watcher import Watcher, start_sampler


def baselines_dir() -> Path:
    """Beside the cache artifacts: a baseline belongs to a fingerprint, as an artifact does."""
    return default_store_root().parent / "baselines"


@dataclass(kw_only=True, slots=True)
class HostWatch:
    host: HostRecord
    proc: subprocess.Popen[str]
    watcher: Watcher
    actor: Actor
    argv: list[str] = field(default_factory=list)
    """The sampler's command (behind ssh for a remote host), to start it again."""
    started: float = 0.0
    """time.monotonic() of the sampler's last start."""
    snap: Snapshot | None = None
    findings: list[Finding] = field(default_factory=list)
    critical_after_warmup: bool = False

    def revive(self, every_s: float) -> None:
        """A live watch is never left blind: a sampler that exited is started again (at most once
        per `every_s`), and one silent for three times that (a frozen host, an ssh link that never
        closes) is killed first, so that it is. The history and the findings carry on."""
        now = time.monotonic()
        if now - self.started < every_s:
            return
        if not self.watcher.ended:
            if self.watcher.sample_age() > 3 * every_s and self.proc.poll() is None:
                self.proc.kill()  # its reader sees EOF: ended, started again on a later refresh
            return
        self.close()
        self.proc = start_sampler(self.argv)
        self.started = now
        assert self.proc.stdout is not None
        self.watcher.attach(self.proc.stdout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    @property
    def acting(self) -> bool:
        """This watch holds the run's watch lock on that host (the sampler took it)."""
        latest = self.watcher.history.latest
        return bool(latest is not None and latest.job.get("watch_lock") == "held")


class WatchSession:
    def __init__(
        self,
        rec: RunRecord,
        *,
        interval_s: float = 1.0,
        thresholds: Thresholds | None = None,
        policy: Policy | None = None,
        once: bool = False,
        fake_nvml: str | None = None,
    ) -> None:
        self.rec = rec
        self.interval_s = interval_s
        self.thresholds = thresholds or Thresholds()
        self.policy = policy or Policy()
        self.once = once
        self.hosts: list[HostWatch] = []
        for h in rec.hosts:
            python = sys.executable if h.host is None else "python3"
            argv = sampler_argv(h.run_dir, interval_s=interval_s, once=once, python=python, fake_nvml=fake_nvml,
                                keep=not once)  # fmt: skip
            full = list(remote.remote_argv(h.host, argv))
            proc = start_sampler(full)
            watcher = Watcher(
                proc.stdout, self.thresholds, baseline_dir=baselines_dir(), host=h.host or "localhost"
            )
            self.hosts.append(
                HostWatch(
                    host=h,
                    proc=proc,
                    watcher=watcher,
                    actor=self._actor(h),
                    argv=full,
                    started=time.monotonic(),
                )
            )

    def _actor(self, h: HostRecord) -> Actor:
        loc = RunLocation(h.run_dir, h.host)

        def signal_host(sig: str, pid: int, started_at: float | None) -> None:
            proc_tool(h.host, signal_args(sig, pid, started_at))

        can_relaunch = backend.of(self.rec.backend).relaunchable and bool(self.rec.plan)
        return Actor(
            self.policy,
            signal_host=signal_host,
            relaunch=(lambda: relaunch(self.rec, h.node_rank)) if can_relaunch else None,
            log_event=lambda event, **fields: append_event(loc, event, **fields),
        )

    def refresh(self, timeout: float) -> list[HostWatch]:
        deadline = time.monotonic() + timeout
        for hw in self.hosts:
            if not self.once:
                hw.revive(self.thresholds.sampler_silent_s)
            hw.snap, hw.findings = hw.watcher.refresh(timeout=max(0.0, deadline - time.monotonic()))
            if hw.acting and hw.snap is not None and hw.snap.t > 0:
                hw.findings = sort_findings([*hw.findings, *hw.actor.standing(hw.snap, hw.findings)])
                hw.actor.report(hw.snap, hw.findings)
                hw.actor.act(hw.snap, hw.findings)
            uptime = max((w.uptime_s or 0 for w in hw.snap.workers), default=0) if hw.snap else 0
            if uptime > self.thresholds.warmup_s and any(f.severity == "critical" for f in hw.findings):
                hw.critical_after_warmup = True
        return self.hosts

    def wait_running(self, stop: threading.Event) -> bool:
        """Until the job holds job.lock on every host (a foreground job starts after its watch):
        True, or False once `stop` is set. Samples are read, not judged, reported or acted on."""
        while not stop.is_set():
            running = 0
            for hw in self.hosts:
                snap, _ = hw.watcher.refresh(timeout=0.5)
                running += snap.job.get("lock_held") is True
            if running == len(self.hosts):
                return True
        return False

    def finished(self) -> bool:
        """The job stopped on every host for good: completed, or stopped by a signal (a user's
        `dflashctl stop`), with no relaunch pending."""
        done = 0
        for hw in self.hosts:
            reason = stop_reason(hw.findings)
            if reason is not None and clean_stop(reason):
                done += 1
            elif reason is not None and not self.policy.restart:
                done += 1  # nothing will bring it back
        return done == len(self.hosts)

    def exit_code(self) -> int:
        return max((exit_code(hw.findings) for hw in self.hosts), default=0)

    def record_baseline(self) -> list[Any]:
        """A run that completed, watched by the acting watch, without critical findings after
        warm-up, sets the baseline tok/s for its fingerprint and config (what `degraded kernels`
        compares later runs against) from the distinct metrics records watch saw (the newest
        History.max_metrics of them)."""
        out = []
        for hw in self.hosts:
            latest = hw.watcher.history.latest
            if latest is None or hw.critical_after_warmup or not hw.acting:
                continue
            if stop_reason(hw.findings) != "completed":
                continue
            key = key_of(hw.watcher.history.manifest)
            if key is None:
                continue
            # The history's own records, each once: every snapshot carries a copy of all records so
            # far, so reading them through the snapshots would count one record once per refresh.
            metrics = [dict(m) for m in hw.watcher.history.metrics]
            b = update_from_healthy_run(baselines_dir(), key[0], key[1], metrics, run_id=self.rec.run_id,
                                        warmup_s=self.thresholds.warmup_s)  # fmt: skip
            if b is not None:
                out.append(b)
        return out

    def close(self) -> None:
        for hw in self.hosts:
            hw.close()


def wait_first(session: WatchSession, timeout: float) -> None:
    """Until every host's sampler sent a line (or timeout): --once must judge a real sample."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        session.refresh(timeout=0.5)
        if all(hw.watcher.history.latest is not None or hw.watcher.ended for hw in session.hosts):
            return
