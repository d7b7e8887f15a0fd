"""The watch loop's core, without a UI or actions: sampler lines in, (Snapshot, findings) out.

    proc = start_sampler(sampler_argv(run_dir))                 # local; over ssh: ["ssh", host, ...]
    watcher = Watcher(proc.stdout, Thresholds.from_table(cfg.get("watch")), baseline_dir=...)
    while True:
        snapshot, findings = watcher.refresh(timeout=2.0)       # never blocks longer than timeout

Lines come from any iterator (a subprocess's stdout, an ssh channel, a list in tests). A reader
thread drains it, so a silent sampler (a stuck host, a dead ssh link) turns into a `sampler`
finding instead of a frozen dashboard. Its source states (Snapshot.source): ok; starting (no line
yet, not silent for long); silent (no line for Thresholds.sampler_silent_s); ended (the stream
closed and stayed closed); failed (closed before its first sample). All but ok and starting are
critical: watch is blind there, and says so (detect_run.sampler_state).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from runner.watch.baseline import for_manifest
from runner.watch.bundle import bundle_source
from runner.watch.detectors import detect
from runner.watch.findings import Finding
from runner.watch.snapshot import History, Snapshot
from runner.watch.thresholds import Thresholds

_END = object()


def start_sampler(argv: Sequence[str]) -> subprocess.Popen[str]:
    """Start a sampler command (sampler_argv(...), possibly behind ssh) with the self-contained
    sampler program on its stdin; its stdout is the line stream a Watcher reads."""
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        # Merged: a traceback or an ssh warning lands in Watcher.noise instead of filling a pipe
        # nobody reads (a full stderr pipe would stall the sampler).
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    assert proc.stdin is not None
    # `python3 -` reads its whole program before it runs, so this write cannot deadlock on output.
    proc.stdin.write(bundle_source())
    proc.stdin.close()
    return proc


def _empty_snapshot(now: float, host: str) -> Snapshot:
    return Snapshot(
        t=now,
        host=host,
        nvml="unavailable: no sample yet",
        gpus=(),
        workers=(),
        pipeline=None,
        metrics=(),
        events=(),
        xids=(),
        xid_supported=False,
        manifest={},
        job={},
        source="silent",
    )


class Watcher:
    def __init__(
        self,
        source: Iterable[str | bytes] | None,
        thresholds: Thresholds | None = None,
        *,
        baseline_dir: Path | None = None,
        history: History | None = None,
        clock: Callable[[], float] = time.time,
        host: str = "",
    ) -> None:
        self.host = host
        """Whom the lines come from (an ssh host, localhost), for findings made before any sample."""
        self.thresholds = thresholds or Thresholds()
        self.history = history or History()
        self.baseline_dir = baseline_dir
        self.clock = clock
        self.noise: collections.deque[str] = collections.deque(maxlen=20)
        """The sampler's recent non-JSON output (a traceback, an ssh banner), for the UI to show."""
        self.ended = False
        self.restarts = 0
        """Sources attached after the first (WatchSession starts an ended sampler again)."""
        self.bad_samples = 0
        """Lines that parsed as JSON but could not be read as a sample (counted, kept in noise)."""
        self._lines: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._received_at: float | None = None
        self._started = clock()
        self._baseline_for: object = None
        if source is not None:
            self.attach(source, restart=False)

    def attach(self, source: Iterable[str | bytes], *, restart: bool = True) -> None:
        """Read lines from `source` from now on (a restarted sampler's stdout): the history stays.
        Each source gets its own queue, so the end of an old one cannot end the new one."""
        self._lines = queue.SimpleQueue()
        self.ended = False
        self.restarts += restart
        threading.Thread(
            target=self._read, args=(source, self._lines), name="watch-reader", daemon=True
        ).start()

    @staticmethod
    def _read(source: Iterable[str | bytes], lines: queue.SimpleQueue[Any]) -> None:
        try:
            for line in source:
                lines.put(line)
        except (OSError, ValueError):
            pass  # a closed pipe ends the stream like EOF
        finally:
            lines.put(_END)

    @property
    def last_words(self) -> str:
        """The sampler's newest non-JSON line (a traceback's last line, an ssh error), or ""."""
        return self.noise[-1] if self.noise else ""

    def sample_age(self) -> float:
        """Seconds since the newest sample arrived (since the start, before the first one)."""
        return self.clock() - (self._received_at if self._received_at is not None else self._started)

    def feed(self, line: str | bytes) -> Snapshot | None:
        """Fold one sampler line in now (the reader thread does this for a source)."""
        text = line.decode(errors="replace") if isinstance(line, bytes) else line
        text = text.strip()
        if not text:
            return None
        try:
            sample = json.loads(text)
        except ValueError:
            self.noise.append(text[:500])
            return None
        if not isinstance(sample, dict) or not isinstance(sample.get("t"), (int, float)):
            self.noise.append(text[:500])
            return None
        try:
            return self.ingest(sample)
        except (TypeError, ValueError, AttributeError, KeyError) as e:
            # A line of another shape (another sampler version, a damaged stream): counted and shown,
            # and no sample: a source that only sends such lines turns silent, a critical finding.
            self.bad_samples += 1
            self.noise.append(f"a sample watch could not read ({type(e).__name__}: {e}): {text[:300]}")
            return None

    def ingest(self, sample: dict[str, Any]) -> Snapshot:
        """Fold one sample (a sample_once() dict, or a parsed line) in."""
        snap = self.history.ingest(sample)
        self._received_at = self.clock()
        if self.baseline_dir is not None and self.history.manifest is not self._baseline_for:
            self._baseline_for = self.history.manifest
            base = for_manifest(self.baseline_dir, self.history.manifest)
            self.history.baseline_tok_s = None if base is None else base.tok_s
            snap = dataclasses.replace(snap, baseline_tok_s=self.history.baseline_tok_s)
            self.history.snapshots[-1] = snap
        return snap

    def _drain(self, timeout: float | None) -> int:
        got = 0
        block = timeout is None or timeout > 0
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.ended:
            try:
                if got == 0 and block:
                    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                    item = self._lines.get(timeout=wait)
                else:
                    item = self._lines.get_nowait()
            except queue.Empty:
                break
            if item is _END:
                self.ended = True
                break
            if self.feed(item) is not None:
                got += 1
        return got

    def refresh(self, timeout: float | None = 0.0) -> tuple[Snapshot, list[Finding]]:
        """Fold in every line that arrived (waiting up to `timeout` s for the first one; None: wait
        until one comes or the stream ends) and judge the newest snapshot."""
        self._drain(timeout)
        now = self.clock()
        latest = self.history.latest
        age = self.sample_age()
        quiet = age > self.thresholds.sampler_silent_s
        if latest is None:
            # No sample at all: a sampler that ended without one failed (watch sees nothing), never "ok".
            source = "failed" if self.ended else "silent" if quiet else "starting"
            snap = dataclasses.replace(
                _empty_snapshot(now, self.host),
                sample_age_s=age,
                source=source,
                sampler_noise=self.last_words,
                sampler_restarts=self.restarts,
            )
            return snap, detect([snap], self.thresholds)
        # A sampler that ended right after its line (--once) is fine; one that ends and stays gone is not.
        source = "ok" if not quiet else "ended" if self.ended else "silent"
        snap = dataclasses.replace(
            latest,
            sample_age_s=age,
            source=source,
            sampler_noise=self.last_words,
            sampler_restarts=self.restarts,
        )
        self.history.snapshots[-1] = snap
        return snap, detect(self.history.snapshots, self.thresholds)
