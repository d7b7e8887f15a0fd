"""The watch hot path, measured the way `dflashctl watch` runs it, and how fast it sees a fault.

CPU only, no GPU needed (FakeNVML stands in for the GPUs); about 3.5 minutes with the defaults:
    .venv/bin/python bench/watch.py --seconds 60 --out /tmp/watch-bench.json

1. Cost. A run directory like a live 8-GPU pipeline run (5 targets, 3 drafters, each worker a real
   process the sampler resolves and measures; an hour of recorded metrics as backlog; job.lock held).
   While this script rewrites the 8 heartbeats and appends a metrics record every second (as the job
   does), a consumer process runs watch's loop: the real sampler as its subprocess (bundle_source()
   fed to `python -` with sampler_argv(..., fake_nvml=SPEC, keep=True), as watch starts it: it holds
   the watch lock and appends watch/samples.jsonl, the file `dflashctl report` plots; 8 fake GPUs
   whose process lists name the workers), Watcher at 1 Hz, and the dashboard rendered to a non-tty
   Console every refresh. Reported: CPU seconds per wall second of the sampler process and of the
   consumer process (psutil, after a warm-up), against the goal of 2% of one core in all.
2. Detection latency, default Thresholds(), sampler at 1 Hz, a real worker process writing its
   heartbeat every second like the job:
   - SIGKILL: seconds from the signal to Watcher's first `dead_worker` finding (goal < 5 s);
   - SIGSTOP: seconds from the signal to the first `hung_worker` finding (goal < 30 s);
   - stalled: the process keeps its heartbeat but stops stepping while q_hs has batches and its GPU
     idles (a drafter stuck in a collective); seconds from its last progress to `hung_worker`.
   Each --trials times; the worst trial is the number that counts.

Prints one JSON object and writes it atomically to --out if given.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runner.fsutil import atomic_write_text  # noqa: E402
from runner.watch.bundle import sampler_argv  # noqa: E402
from runner.watch.thresholds import Thresholds  # noqa: E402
from runner.watch.watcher import Watcher, start_sampler  # noqa: E402

GOAL_CORE_PCT = 2.0
GOAL_DEAD_S = 5.0
GOAL_HUNG_S = 30.0
HOST = socket.gethostname()

# A worker as the job writes its heartbeat: atomically, every second; "stall" steps for 2 s, then
# keeps its heartbeat fresh without progress.
WORKER = r"""
import json, os, socket, sys, time
run, name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
role, _, index = name.rpartition("-")
path = os.path.join(run, "workers", name + ".json")
started = last = time.time()
step = 0
while True:
    now = time.time()
    if mode == "progress" or now - started < 2.0:
        step, last = step + 1, now
    hb = {"pid": os.getpid(), "host": socket.gethostname(), "role": role, "index": int(index),
          "rank": int(index), "device": "cuda:" + index, "step": step, "state": "computing",
          "last_progress_at": last, "updated_at": now, "started_at": started}
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps(hb))
    os.replace(path + ".tmp", path)
    time.sleep(1.0)
"""


def manifest(run_id: str, targets: int, drafters: int) -> dict[str, Any]:
    return {
        "format": 1,
        "run_id": run_id,
        "started_at": time.time() - 3600,
        "config": {
            "run": {"name": "bench", "status_interval_s": 10.0},
            "pipeline": {"targets": targets, "drafters": drafters, "prefetch_depth": 50, "queue_depth": 8},
            "train": {"total_steps": 100000},
        },
    }


def metric(t: float, step: int, targets: int) -> dict[str, Any]:
    """A healthy pipeline's record: balanced queues, steady throughput."""
    return {
        "t": t,
        "elapsed_s": 3600.0,
        "step": step,
        "loss": 3.2,
        "acc": 0.41,
        "acc_per_pos": [0.6, 0.5, 0.4],
        "streak": 2.1,
        "lr": 1e-4,
        "noise": 0.0,
        "tgt_bps": 2.0,
        "dft_bps": 2.0,
        "tok_s": 20000.0,
        "q_pre": [25] * targets,
        "q_hs": [4],
        "epoch": 0.3,
        "eta_s": 8 * 86400.0,
    }


def append(path: Path, *records: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def fake_spec(path: Path, gpus: int, procs: dict[int, int], idle: frozenset[int] = frozenset()) -> Path:
    """FakeNVML over `gpus` H200s; GPU i lists procs[i] (a pid) holding 60 GB."""
    spec = {
        "gpus": [
            {
                "mem_used_mb": 61000.0 if i in procs else 600.0,
                "util_gpu": 0 if i in idle else 95,
                "util_mem": 40,
                "temp_c": 60,
                "power_w": 500.0,
                "procs": [[procs[i], 60000.0]] if i in procs else [],
            }
            for i in range(gpus)
        ]
    }
    path.write_text(json.dumps(spec))
    return path


# ---- 1. cost: the consumer process (what `dflashctl watch` is) --------------------------------------


def consumer(run_dir: str, spec: str, interval: float) -> int:
    """watch's loop: sampler subprocess -> Watcher -> dashboard to a non-tty Console, at `interval`;
    until a line arrives on stdin. Prints the sampler's pid first, then a JSON summary."""
    import io

    from rich.console import Console

    from runner.watch.dashboard import render_dashboard

    # keep: the sampler takes the run's watch lock and appends watch/samples.jsonl, as watch's does
    argv = sampler_argv(run_dir, interval_s=interval, python=sys.executable, fake_nvml=spec, keep=True)
    proc = start_sampler(argv)
    print(json.dumps({"sampler_pid": proc.pid}), flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    watcher = Watcher(proc.stdout, Thresholds())
    sink = open(os.devnull, "w")  # noqa: SIM115
    console = Console(file=sink, width=140, force_terminal=False, color_system=None)
    refreshes, ready = 0, False
    findings: list[Any] = []
    render_s = 0.0
    try:
        while not stop.is_set():
            snap, findings = watcher.refresh(timeout=interval)
            refreshes += 1
            t0 = time.process_time()
            console.print(render_dashboard(snap, findings))
            render_s += time.process_time() - t0
            if not ready and snap.gpus:
                ready = True
                print(json.dumps({"ready": True}), flush=True)
    finally:
        proc.kill()
        proc.wait()
    print(
        json.dumps(
            {
                "refreshes": refreshes,
                "snapshots": len(watcher.history.snapshots),
                "render_cpu_ms_per_refresh": round(1000 * render_s / max(1, refreshes), 3),
                "findings_at_end": [f"{f.severity} {f.kind} {f.subject}: {f.message}" for f in findings],
                "gpus_seen": len(watcher.history.latest.gpus) if watcher.history.latest else 0,
                "workers_alive": sum(bool(w.alive) for w in watcher.history.latest.workers)
                if watcher.history.latest
                else 0,
                "rendered_bytes_example": len(_render_once(watcher, io.StringIO())),
            }
        ),
        flush=True,
    )
    return 0


def _render_once(watcher: Watcher, buf: Any) -> str:
    from rich.console import Console

    from runner.watch.dashboard import render_dashboard

    snap, findings = watcher.refresh()
    Console(file=buf, width=140, force_terminal=False, color_system=None).print(
        render_dashboard(snap, findings)
    )
    return str(buf.getvalue())


def cpu_s(p: Any) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def measure_cost(work: Path, seconds: float, gpus: int, interval: float, warmup: float) -> dict[str, Any]:
    import psutil

    run = work / "cost-run"
    (run / "workers").mkdir(parents=True)
    drafters = max(1, gpus * 3 // 8)
    targets = max(1, gpus - drafters)
    names = [f"target-{i}" for i in range(targets)] + [f"drafter-{i}" for i in range(drafters)]
    write_json(run / "run.json", manifest("bench-cost", targets, drafters))
    lock = open(run / "job.lock", "w")  # noqa: SIM115 (held for the whole measurement, as the job does)
    fcntl.flock(lock, fcntl.LOCK_EX)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    now = time.time()
    append(run / "metrics.jsonl", *(metric(now - 3600 + 10 * i, 10 * i, targets) for i in range(360)))
    append(run / "events.jsonl", {"t": now - 3600, "event": "launched", "host": HOST, "pid": os.getpid()})
    sleepers = [subprocess.Popen(["sleep", "100000"]) for _ in names]
    stop = threading.Event()
    try:
        started = {n: psutil.Process(p.pid).create_time() for n, p in zip(names, sleepers, strict=True)}
        spec = fake_spec(work / "cost-nvml.json", gpus, {i: p.pid for i, p in enumerate(sleepers)})
        state = {"step": 3600}

        def heartbeats() -> None:
            t = time.time()
            for i, (name, p) in enumerate(zip(names, sleepers, strict=True)):
                role, _, index = name.rpartition("-")
                hb = {"pid": p.pid, "host": HOST, "role": role, "index": int(index), "rank": int(index),
                      "device": f"cuda:{i}", "step": state["step"], "state": "computing",
                      "last_progress_at": t, "updated_at": t, "started_at": started[name]}  # fmt: skip
                if role == "target":
                    hb["q_pre"] = 25
                write_json(run / "workers" / f"{name}.json", hb)

        def job() -> None:  # the job's side, at 1 Hz: not part of what is measured
            while not stop.wait(1.0):
                state["step"] += 2
                heartbeats()
                append(run / "metrics.jsonl", metric(time.time(), state["step"], targets))

        heartbeats()
        threading.Thread(target=job, daemon=True).start()
        cons = subprocess.Popen(
            [sys.executable, __file__, "--consumer", str(run), str(spec), "--interval", str(interval)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert cons.stdout is not None and cons.stdin is not None
        sampler_pid = json.loads(cons.stdout.readline())["sampler_pid"]
        first = cons.stdout.readline()
        if not first:
            raise RuntimeError("the consumer exited before its first snapshot")
        time.sleep(warmup)  # the first line's backlog, imports, psutil's first cpu reading
        pc, ps = psutil.Process(cons.pid), psutil.Process(sampler_pid)
        c0, s0, w0 = cpu_s(pc), cpu_s(ps), time.monotonic()
        time.sleep(seconds)
        c1, s1, w1 = cpu_s(pc), cpu_s(ps), time.monotonic()
        cons.stdin.write("stop\n")
        cons.stdin.close()
        tail = json.loads(cons.stdout.read().strip().splitlines()[-1])
        cons.wait(timeout=30)
    finally:
        stop.set()
        for p in sleepers:
            p.kill()
            p.wait()
        lock.close()
    wall = w1 - w0
    sampler_pct = 100 * (s1 - s0) / wall
    consumer_pct = 100 * (c1 - c0) / wall
    total = sampler_pct + consumer_pct
    samples = [json.loads(x) for x in (run / "watch" / "samples.jsonl").read_text().splitlines()]
    return {
        "gpus": gpus,
        "workers": len(names),
        "interval_s": interval,
        "wall_s": round(wall, 2),
        "sampler_cpu_s": round(s1 - s0, 3),
        "consumer_cpu_s": round(c1 - c0, 3),
        "sampler_pct_of_core": round(sampler_pct, 3),
        "consumer_pct_of_core": round(consumer_pct, 3),
        "total_pct_of_core": round(total, 3),
        "goal_pct_of_core": GOAL_CORE_PCT,
        "met": total < GOAL_CORE_PCT,
        "samples_recorded": len(samples),
        "consumer": tail,
    }


# ---- 2. detection latency ----------------------------------------------------------------------------


def _watch(run: Path, spec: Path, interval: float) -> tuple[subprocess.Popen[str], Watcher]:
    sampler = start_sampler(sampler_argv(run, interval_s=interval, python=sys.executable, fake_nvml=spec))
    return sampler, Watcher(sampler.stdout, Thresholds())


def _until(watcher: Watcher, kind: str, subject: str, timeout: float) -> float | None:
    """time.time() when a refresh first reports `kind` about `subject`; None if not within timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, findings = watcher.refresh(timeout=0.25)
        if any(f.kind == kind and f.subject == subject for f in findings):
            return time.time()
    return None


def _healthy(watcher: Watcher, name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap, findings = watcher.refresh(timeout=0.5)
        w = snap.worker(name)
        if w is not None and w.alive and (w.step or 0) > 0 and not any(f.subject == name for f in findings):
            return
    raise RuntimeError(f"{name} never looked healthy to watch")


def one_trial(work: Path, fault: str, trial: int, interval: float, gpus: int) -> float | None:
    run = work / f"{fault}-{trial}"
    (run / "workers").mkdir(parents=True)
    name = "drafter-5" if gpus > 5 else "drafter-0"
    write_json(run / "run.json", manifest(f"bench-{fault}", 5, 3))
    lock = open(run / "job.lock", "w")  # noqa: SIM115
    fcntl.flock(lock, fcntl.LOCK_EX)  # the job holds it; the worker alone stopping must not end the job
    now = time.time()
    if fault == "stalled":
        # hidden-state batches wait for the drafter; one record stays fresh for the whole trial
        append(run / "metrics.jsonl", {**metric(now, 1000, 5), "q_hs": [6]})
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(run), name, "stall" if fault == "stalled" else "progress"]
    )
    sampler = None
    try:
        idle = frozenset({int(name.split("-")[1])}) if fault == "stalled" else frozenset()
        spec = fake_spec(work / f"{fault}-{trial}.json", gpus, {int(name.split("-")[1]): worker.pid}, idle)
        sampler, watcher = _watch(run, spec, interval)
        if fault == "stalled":
            # from the worker's last progress (2 s after it starts) to the finding
            t = _until(watcher, "hung_worker", name, 60.0)
            hb = json.loads((run / "workers" / f"{name}.json").read_text())
            return None if t is None else t - float(hb["last_progress_at"])
        _healthy(watcher, name)
        time.sleep((trial * 0.37) % 1.0)  # spread the signal's phase against the sampler's ticks
        t0 = time.time()
        if fault == "sigkill":
            worker.send_signal(signal.SIGKILL)
            worker.wait()  # reaped, as torchrun reaps its ranks
            t = _until(watcher, "dead_worker", name, 30.0)
        else:
            os.kill(worker.pid, signal.SIGSTOP)
            t = _until(watcher, "hung_worker", name, 60.0)
        return None if t is None else t - t0
    finally:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGCONT)
            worker.kill()
        worker.wait()
        if sampler is not None:
            sampler.kill()
            sampler.wait()
        lock.close()


def measure_latency(work: Path, trials: int, interval: float, gpus: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fault, kind, goal in (
        ("sigkill", "dead_worker", GOAL_DEAD_S),
        ("sigstop", "hung_worker", GOAL_HUNG_S),
        ("stalled", "hung_worker", GOAL_HUNG_S),
    ):
        got = [one_trial(work, fault, i, interval, gpus) for i in range(trials)]
        seen = [round(x, 2) for x in got if x is not None]
        worst = max(seen) if len(seen) == len(got) else None
        out[fault] = {
            "finding": kind,
            "trials_s": [None if x is None else round(x, 2) for x in got],
            "worst_s": worst,
            "goal_s": goal,
            "met": worst is not None and worst < goal,
        }
        print(f"{fault}: {kind} after {out[fault]['trials_s']} s", file=sys.stderr, flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="measured wall seconds of the cost phase")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds before the cost is measured")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0, help="sampler and refresh interval (s)")
    ap.add_argument("--trials", type=int, default=3, help="repetitions of each latency fault")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--out", help="write the JSON result here (atomically)")
    ap.add_argument("--consumer", nargs=2, metavar=("RUN_DIR", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.consumer:
        return consumer(args.consumer[0], args.consumer[1], args.interval)
    work = Path(tempfile.mkdtemp(prefix="dflash-watch-bench-"))
    try:
        result: dict[str, Any] = {
            "bench": "watch",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
            "python": platform.python_version(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "thresholds": {k: v for k, v in Thresholds().to_table().items() if k in ("stale_s", "hung_s", "idle_window_s")},
        }  # fmt: skip
        if not args.skip_cost:
            result["cost"] = measure_cost(work, args.seconds, args.gpus, args.interval, args.warmup)
        if not args.skip_latency:
            result["latency"] = measure_latency(work, args.trials, args.interval, args.gpus)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        atomic_write_text(Path(args.out), text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
