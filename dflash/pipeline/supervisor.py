"""The multi-process job: T target workers + a restartable drafter group, on one host or several.

    python -m dflash.launch CONFIG [--set k=v ...] [--run-dir DIR]
        [--nnodes N --node-rank I --rdzv-endpoint HOST:PORT]    # several hosts: one command per host
    python -m dflash.launch CONFIG --plan [--json]              # print the command of every host

The supervisor (this process) creates the run directory and the host's hidden-state queue, starts one
process per target worker and runs the drafters under torchrun (torch.distributed.elastic) with
`pipeline.max_restarts`: a drafter death restarts the drafter group from its last checkpoint while
the targets keep their weights and pids. A target death stops the job cleanly (final checkpoint,
event `stopped`) unless `pipeline.restart_targets` is set. SIGTERM/SIGINT stops gracefully (drafters
checkpoint); a second signal kills everything at once.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.config import JobConfig, add_config_args, load_config, set_args
from dflash.errors import DFlashError, DoesNotFit
from dflash.exiting import without_final_gc
from dflash.pipeline import DATA_SUMMARY_ENV, STOP_FILE_ENV
from dflash.pipeline.drafter_entry import SPARE_DIR_ENV, socket_dir
from dflash.pipeline.timeline import DETECTED_AT_ENV, GENERATION_ENV, LAUNCHED_AT_ENV, SPAWNED_AT_ENV
from dflash.plan.hosts import LOCAL_ENDPOINT, host_problems, plan, plan_lines
from dflash.plan.placement import slot_bytes, slot_problem
from dflash.plan.resolve import worker_devices
from dflash.plan.spares import plan_spares
from dflash.rundir import (
    SUPERVISOR_ENV,
    RunDir,
    format_status_line,
    held_lock_fds,
    read_jsonl_from,
    supervisor_token,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash.launch", description=__doc__.split("\n\n")[0])
    add_config_args(p, run_dir="run directory (this host's); an existing one is resumed")
    p.add_argument("--nnodes", type=int, help="hosts in the drafter group (overrides pipeline.nnodes)")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index, 0..nnodes-1")
    p.add_argument(
        "--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (overrides pipeline.rdzv_endpoint)"
    )
    p.add_argument("--plan", action="store_true", help="print the command each host runs, then exit")
    p.add_argument("--json", action="store_true", help="with --plan: print the plan as one JSON object")
    return p.parse_args(argv)


STOP_FILE = "stopping"
"""In the run directory while the supervisor stops the job: torchrun restarts no failed group."""


def kill_process_tree(pid: int) -> None:
    """SIGKILL a process and every descendant. torchrun starts its workers in sessions of their own,
    so killing a process group alone would orphan them (holding GPUs); the descendants are listed
    before anything dies (an orphan is re-parented and can no longer be found from its parent)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    log_start: int = 0
    """Size of the (appended) log when the latest start began: what this start wrote follows."""

    def start(self, env: dict[str, str] | None = None) -> None:
        """env: added to this process's; the start's own stamps too (dflash.pipeline.timeline:
        when it was spawned, and how many starts came before)."""
        env = {**(env or {}), SPAWNED_AT_ENV: repr(time.time()), GENERATION_ENV: str(self.starts)}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.log_start = out.tell()
            self.popen = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **env},
                # The run-dir lock travels with the workers: it holds until the last of them exits.
                pass_fds=held_lock_fds(),
            )
        self.starts += 1

    def poll(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def kill_tree(self, *, wait: bool = True) -> None:
        """kill_process_tree on this worker. wait=False inside a signal handler: the interrupted
        main thread may hold Popen's non-reentrant wait lock (inside poll()), and waiting there
        would deadlock; the main loop reaps the process."""
        if self.popen is None:
            return
        kill_process_tree(self.popen.pid)
        if wait:
            self.popen.wait()


def _tail(path: Path, start: int, size: int = 65536) -> str:
    """The last `size` bytes of a log, not before offset `start` (earlier launches' output)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(start, f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Supervisor:
    cfg: JobConfig
    run: RunDir
    config_path: str
    overrides: list[str]
    node_rank: int
    nnodes: int
    rdzv_endpoint: str
    targets: list[Proc] = field(default_factory=list)
    drafters: Proc | None = None
    stopping: str = ""
    stopping_since: float = 0.0
    stop_grace_s: float = 180.0
    """After a stop, the drafters get this long to checkpoint and exit before they are killed."""
    signals: int = 0
    metrics_offset: int = 0
    events_offset: int = 0
    early_errors: dict[int, str] = field(default_factory=dict)
    """generation -> the error a drafter of that generation failed with before its first step."""
    error: str = ""
    """The deterministic error that stopped the job (see repeated_early_failure)."""
    launched_at: float = field(default_factory=time.time)
    data: dict[str, Any] = field(default_factory=dict)
    """The data counts (TokenizedDataset.summary) of the data the targets read."""
    stopped_workers: set[int] = field(default_factory=set)
    """Drafter worker pids told to stop (stop_drafters)."""
    torchrun_signalled: bool = False
    spare_plan: Any = None
    """dflash.plan.spares.SparePlan: the spare drafters' mode on this host (None: off)."""
    spares: dict[int, Proc] = field(default_factory=dict)
    """local rank -> its spare drafter process, ready or getting ready (dflash.pipeline.spare)."""
    taken: list[Proc] = field(default_factory=list)
    """Spares that took a rank over: drafter workers now, ended with the drafter group."""
    spare_starts: int = 0
    spares_pending: bool = False
    """The spares start once the drafter group's first generation trained its first step: getting
    ready beside its cold start would slow that start (CPU, disk and host memory bandwidth) and
    leave it no faster (its first generation cannot use a spare that is not ready yet)."""
    queue_name: str = ""
    tau: Any = None
    """The in-job tau measurement (TauEval), None when train.tau_eval resolves off."""
    targets_released: bool = False
    """The drafters trained every step (event drafters_done): the targets were told to stop while
    the drafter processes and torchrun exit, instead of after them; their exits are no deaths."""

    def worker_args(self) -> list[str]:
        sets = set_args(self.overrides)
        return [self.config_path, *sets, "--run-dir", str(self.run.root)]

    def on_signal(self, signum: int, _frame: Any) -> None:
        self.signals += 1
        if self.tau is not None:
            self.tau.stopping = True
        if self.signals == 1:
            self.stopping = f"signal {signal.Signals(signum).name}"
            self.stop_drafters()
        else:
            for p in self.all_procs():
                p.kill_tree(wait=False)

    def start(self, queue_name: str) -> None:
        self.stop_file.unlink(missing_ok=True)  # an earlier launch's stop is not this one's
        # Failures are judged from this launch's events only (a resumed run has older generations).
        self.events_offset = self.run.events.stat().st_size if self.run.events.exists() else 0
        target_devs, _ = worker_devices(self.cfg)
        T = self.cfg.pipeline.targets
        for i, dev in enumerate(target_devs):
            index = self.node_rank * T + i
            proc = Proc(
                f"target-{index}",
                [
                    sys.executable,
                    "-m",
                    "dflash.pipeline.target_worker",
                    *self.worker_args(),
                    "--index",
                    str(index),
                    "--queue",
                    queue_name,
                    "--device",
                    dev,
                    "--data-world",
                    str(self.nnodes * T),
                ],
                self.run.log_path("target", index),
            )
            proc.start()
            self.targets.append(proc)
        self.queue_name = queue_name
        spare_env: dict[str, str] = {}
        if self.spare_mode != "off":
            spare_env[SPARE_DIR_ENV] = str(self.spare_dir)
            self.spare_dir.mkdir(parents=True, exist_ok=True)
            for stale in self.spare_dir.glob("*.sock"):
                stale.unlink(missing_ok=True)
            self.spares_pending = True  # started once the group trained its first step (read_events)
        torchrun = [
            sys.executable,
            "-m",
            "dflash.pipeline.torchrun",
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.cfg.pipeline.drafters}",
            f"--max-restarts={self.cfg.pipeline.max_restarts}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            *(["--local-addr=127.0.0.1"] if self.rdzv_endpoint == LOCAL_ENDPOINT else []),
            f"--rdzv-id={self.cfg.pipeline.rdzv_id or self.cfg.run.name}",
            # join: waiting for every host; read: a host reaching host 0's store (default 60 s).
            f"--rdzv-conf=join_timeout={self.cfg.pipeline.rdzv_timeout_s},"
            f"read_timeout={self.cfg.pipeline.rdzv_timeout_s}",
            "--monitor-interval=0.5",
            "-m",
            "dflash.pipeline.drafter_entry",
            *self.worker_args(),
            "--queue",
            queue_name,
        ]
        self.drafters = Proc(
            "drafter-group", torchrun, self.run.logs / f"drafter-group-node{self.node_rank}.log"
        )
        from dflash.plan.resolve import worker_threads

        # The drafters' intra-op threads, from the one rule dflash.cache.warm compiles the pipeline drafter under.
        self.drafters.start(
            env={
                "OMP_NUM_THREADS": str(worker_threads("drafter")),
                DATA_SUMMARY_ENV: json.dumps(self.data),
                LAUNCHED_AT_ENV: repr(time.time()),
                STOP_FILE_ENV: str(self.stop_file),
                **spare_env,
            }
        )
        self.run.event(
            "launched",
            node_rank=self.node_rank,
            nnodes=self.nnodes,
            targets={p.name: p.popen.pid for p in self.targets if p.popen},
            target_devices=target_devs,
            drafter_group_pid=self.drafters.popen.pid if self.drafters.popen else None,
            commands={p.name: shlex.join(p.argv) for p in [*self.targets, self.drafters]},
            data=self.data,
        )

    @property
    def stop_file(self) -> Path:
        return self.run.root / STOP_FILE

    @property
    def spare_mode(self) -> str:
        return self.spare_plan.mode if self.spare_plan is not None else "off"

    @property
    def spare_dir(self) -> Path:
        return socket_dir(self.queue_name)

    def start_spare(self, local_rank: int) -> None:
        """A spare drafter for local_rank (dflash.pipeline.spare), getting ready beside the job."""
        from dflash.plan.resolve import worker_threads

        proc = Proc(
            f"spare-{local_rank}",
            [
                sys.executable,
                "-m",
                "dflash.pipeline.spare",
                *self.worker_args(),
                "--queue",
                self.queue_name,
                "--local-rank",
                str(local_rank),
                "--mode",
                self.spare_mode,
                "--socket-dir",
                str(self.spare_dir),
            ],
            self.run.log_path("spare", local_rank),
        )
        proc.start(env={"OMP_NUM_THREADS": str(worker_threads("drafter"))})
        self.spare_starts += 1
        self.spares[local_rank] = proc
        self.run.event(
            "spare_started", worker=proc.name, local_rank=local_rank, mode=self.spare_mode, pid=proc.popen.pid
        )

    def tend_spares(self, takeovers: list[int]) -> None:
        """A spare that took a rank over becomes a drafter worker (ended with the group) and a new one
        gets ready for the next generation; a spare that died before any takeover is started again,
        at most pipeline.max_restarts + drafters times in all (then new generations start cold)."""
        if self.stopping or self.targets_released:
            return
        for pid in takeovers:
            for local_rank, proc in list(self.spares.items()):
                if proc.popen is not None and proc.popen.pid == pid:
                    self.taken.append(proc)
                    del self.spares[local_rank]
                    self.start_spare(local_rank)
        budget = self.cfg.pipeline.max_restarts + 2 * self.cfg.pipeline.drafters
        for local_rank, proc in list(self.spares.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.spares[local_rank]
            again = self.spare_starts < budget
            self.run.event(
                "spare_died",
                worker=proc.name,
                local_rank=local_rank,
                exit_code=code,
                restarted=again,
                detail="started again"
                if again
                else "no spare for this rank: new generations start on their own",
            )
            if again:
                self.start_spare(local_rank)

    def all_procs(self) -> list[Proc]:
        return [
            *self.targets,
            *([self.drafters] if self.drafters else []),
            *self.spares.values(),
            *self.taken,
            *([self.tau.proc] if self.tau is not None and self.tau.proc is not None else []),
        ]

    def stop_drafters(self) -> None:
        """A graceful stop of the drafter group: no more restarts (the stop file, which
        dflash.pipeline.torchrun reads before it restarts a failed group), then SIGTERM to each
        drafter worker itself. They agree on a step, checkpoint and exit 0, and torchrun with them.
        Not torchrun: on a signal it stops its workers itself, SIGKILLs any still checkpointing 30 s
        later, and exits 1. A death after this (one during the final checkpoint) is still one: it
        ends the group without a restart, with a non-zero exit code."""
        if self.drafters is None or self.drafters.popen is None or self.drafters.poll() is not None:
            return
        self.stop_file.touch()
        import psutil

        try:
            workers = psutil.Process(self.drafters.popen.pid).children()
        except psutil.NoSuchProcess:
            return
        if not workers and not self.stopped_workers:
            if not self.torchrun_signalled:
                self.torchrun_signalled = True
                self.drafters.signal(signal.SIGTERM)  # torchrun has no workers yet: nothing to checkpoint
            return
        for w in workers:
            if w.pid in self.stopped_workers:
                continue
            self.stopped_workers.add(w.pid)
            try:
                w.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass

    def echo_metrics(self) -> None:
        records, self.metrics_offset = read_jsonl_from(self.run.metrics, self.metrics_offset)
        for rec in records:
            print(format_status_line(rec), flush=True)

    def read_events(self) -> None:
        """This launch's new events: early drafter errors (see repeated_early_failure), and the
        drafters' end of training, after which no target batch is needed (release_targets)."""
        records, self.events_offset = read_jsonl_from(self.run.events, self.events_offset)
        takeovers = [
            rec["pid"]
            for rec in records
            if rec.get("event") == "spare_takeover" and isinstance(rec.get("pid"), int)
        ]
        if self.spares_pending and any(
            rec.get("event") == "generation_start" and rec.get("role") == "drafter-group" for rec in records
        ):
            self.spares_pending = False
            if not (self.stopping or self.targets_released):
                for local_rank in range(self.cfg.pipeline.drafters):
                    self.start_spare(local_rank)
        self.tend_spares(takeovers)
        if self.tau is not None:
            for rec in records:
                if rec.get("event") == "checkpoint" and isinstance(rec.get("path"), str):
                    self.tau.due(rec["path"], rec.get("step"))
        for rec in records:
            if rec.get("event") == "worker_error" and rec.get("before_first_step"):
                gen = rec.get("generation")
                if isinstance(gen, int):
                    self.early_errors.setdefault(gen, str(rec.get("error", "")))
            if rec.get("event") == "drafters_done" and not rec.get("stopped_by_signal"):
                self.release_targets()

    def release_targets(self) -> None:
        """SIGTERM the targets once the drafters have trained every step: they stop (publishing
        nothing more) while the drafter processes and torchrun wind down, not one after the other.
        A drafter group restarted after this resumes from the final checkpoint and trains no step."""
        if self.targets_released:
            return
        self.targets_released = True
        for proc in self.targets:
            proc.signal(signal.SIGTERM)

    def repeated_early_failure(self) -> str | None:
        """The error text when two consecutive drafter-group generations failed with the same error
        before their first step: deterministic (a bad placement, a checkpoint of another drafter, a
        broken environment), so a restart cannot help and each would spend the same minutes."""
        for gen, text in self.early_errors.items():
            if gen > 0 and self.early_errors.get(gen - 1) == text:
                return text
        return None

    def watch(self) -> int:
        assert self.drafters is not None
        while True:
            time.sleep(0.5)
            self.echo_metrics()
            self.read_events()
            if self.tau is not None:
                self.tau.poll()
            repeated = None if self.stopping else self.repeated_early_failure()
            if repeated is not None:
                self.error = repeated
                self.stopping = (
                    "the drafter group failed twice in a row with the same error before its first step, "
                    f"so no restart can help (stopped without spending the rest): {repeated}"
                )
                self.drafters.kill_tree()
                return self.drafters.poll() or 1
            for proc in self.targets:
                code = proc.poll()
                if code is None or self.stopping or self.targets_released:
                    continue
                detected = time.time()
                self.run.event("worker_died", worker=proc.name, exit_code=code)
                if self.cfg.pipeline.restart_targets:
                    proc.start(env={DETECTED_AT_ENV: repr(detected)})
                    self.run.event(
                        "restart", role="target", worker=proc.name, pid=proc.popen.pid if proc.popen else None
                    )
                else:
                    self.stopping = f"{proc.name} died (exit code {code})"
                    self.stop_drafters()
            code = self.drafters.poll()
            if code is not None:
                return code
            if self.stopping:
                self.stop_drafters()  # a generation torchrun started since is told too
                self.stopping_since = self.stopping_since or time.time()
                if time.time() - self.stopping_since > self.stop_grace_s:
                    self.run.event(
                        "forced", detail=f"drafters still running {self.stop_grace_s:.0f} s after the stop"
                    )
                    self.drafters.kill_tree()

    def group_formed(self) -> bool:
        """Whether this launch's drafter group formed at least once: torchrun starts its workers
        only after the rendezvous, and each worker's heartbeat records when it started."""
        for path in self.run.workers.glob("drafter-*.json"):
            try:
                if json.loads(path.read_text()).get("started_at", 0) >= self.launched_at:
                    return True
            except (OSError, ValueError):
                continue
        return False

    def shutdown(self, drafter_code: int) -> dict[str, Any]:
        for proc in [*self.targets, *self.spares.values()]:
            proc.signal(signal.SIGTERM)
        if self.tau is not None:
            self.read_events()  # the final checkpoint's event: its tau is measured before the end
            self.tau.finish(wait_s=0 if self.stopping else self.tau.final_wait_s)
        deadline = time.time() + 20
        for proc in self.targets:
            while proc.poll() is None and time.time() < deadline:
                time.sleep(0.1)
            proc.kill_tree()
        self.echo_metrics()
        if self.stopping:
            return {
                "reason": self.stopping,
                "drafter_exit_code": drafter_code,
                **({"error": self.error} if self.error else {}),
            }
        if drafter_code == 0:
            return {"reason": "completed", "drafter_exit_code": 0}
        log = _tail(self.drafters.log, self.drafters.log_start) if self.drafters else ""
        timeout = f"pipeline.rdzv_timeout_s={self.cfg.pipeline.rdzv_timeout_s}"
        if "RendezvousConnectionError" in log:
            return {
                "reason": f"could not reach the rendezvous at {self.rdzv_endpoint} within {timeout}: "
                "is host 0's launch running, and is that address reachable from this host?",
                "drafter_exit_code": drafter_code,
            }
        if "RendezvousTimeoutError" in log:
            formed = self.group_formed()
            reason = (
                f"the drafter group lost a host and it did not rejoin the rendezvous at "
                f"{self.rdzv_endpoint} within {timeout}; restart that host's command"
                if formed
                else f"the drafter group did not form: not all {self.nnodes} hosts joined the "
                f"rendezvous at {self.rdzv_endpoint} within {timeout}; start every host's command "
                "(see --plan) with the same config and endpoint, or raise the timeout"
            )
            return {"reason": reason, "drafter_exit_code": drafter_code}
        return {
            "reason": f"drafter group failed (exit code {drafter_code}) after up to "
            f"{self.cfg.pipeline.max_restarts} restarts; see logs/drafter-*.log",
            "drafter_exit_code": drafter_code,
        }


class StoppedBeforeStart(BaseException):
    """A stop asked for before the workers started. BaseException, as KeyboardInterrupt is: the
    data loading it may interrupt catches Exception to skip bad records."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class EarlyStop:
    """SIGTERM/SIGINT while the run directory is opened, the data prepared and the queue made (the
    Supervisor's handlers come after). The first signal is noted and the launch stops at the next
    step boundary, in order: a `stopped` event, the queue unlinked, exit status 0 as for any
    signalled stop. A second one stops the step it interrupts at once."""

    reason: str = ""

    def on_signal(self, signum: int, _frame: Any) -> None:
        if self.reason:
            raise StoppedBeforeStart(self.reason)
        self.reason = f"signal {signal.Signals(signum).name}"

    def check(self) -> None:
        if self.reason:
            raise StoppedBeforeStart(self.reason)


def state_copies(cfg: JobConfig, spec: Any, run: RunDir, queue_name: str, queue_bytes: int) -> None:
    """Before any worker: crashed jobs' copies removed, this host's memory checked for two copies of
    the drafter group's state (a refusal names pipeline.state_copy_every), and the copy directory
    made, owned by this supervisor (dflash.pipeline.state_copy)."""
    from dflash.pipeline.state_copy import (
        copy_nbytes,
        host_memory_problem,
        host_room,
        prepare_copies,
        remove_stale_copies,
    )

    for gone in remove_stale_copies():
        run.event("state_copy_stale_removed", path=str(gone), reason="its supervisor is gone")
    every = cfg.pipeline.state_copy_every
    if not every:
        return
    problem = host_memory_problem(
        copy_nbytes(spec), *host_room(), cfg.pipeline.drafters, every, queue_bytes=queue_bytes
    )
    if problem is not None:
        raise problem
    prepare_copies(queue_name, supervisor_token())


def _metric_at(path: Path, step: int | None, key: str, tail: int = 1 << 16) -> float | None:
    """`key` of the newest status record at or before `step` in metrics.jsonl's last `tail` bytes
    (a tau event carries the teacher-forced accuracy of its checkpoint's step beside it)."""
    if step is None:
        return None
    try:
        with open(path, "rb") as f:
            start = max(0, f.seek(0, os.SEEK_END) - tail)
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines()[1 if start else 0 :]
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        value = rec.get(key) if isinstance(rec, dict) else None
        if isinstance(rec.get("step"), int) and rec["step"] <= step and isinstance(value, int | float):
            return float(value)
    return None


def tau_device(targets: list[str]) -> str:
    """Where the in-job tau runs: the first target's GPU (a target worker holds weights and one
    batch's activations, a drafter its training peak), else the CPU."""
    first = targets[0] if targets else "cpu"
    return first if first.startswith("cuda") else "cpu"


@dataclass
class TauEval:
    """Tau after each checkpoint, measured by `python -m dflash.eval CHECKPOINT --json --no-baseline`
    in a process of its own at low CPU priority (logs/tau-eval.log), one at a time, on `device`:
    the CPU, or the first target's GPU, where the eval first checks that its pair fits beside the
    workers (--headroom-gb run.memory_headroom_gb; when it does not, one `tau_skipped` event says so
    and no more are tried). Paced to train.tau_budget: a measurement starts only while the ones so
    far took at most that share of the wall time since the job started; a checkpoint written while one
    runs, or before the budget allows, waits, and only the newest waiting one is measured (the final
    checkpoint's always is, after training). Its answer becomes a `tau` event (a failure a
    `tau_failed` event, with its error line)."""

    cfg: JobConfig
    run: RunDir
    prompts: str
    device: str = "cpu"
    """Where the eval runs: "cpu", or a GPU of the job's ("cuda:0")."""
    proc: Proc | None = None
    step: int | None = None
    started: float = 0.0
    waiting: tuple[str, int | None] | None = None
    since: float = field(default_factory=time.time)
    """When the budget's wall clock starts (the workers' start)."""
    spent_s: float = 0.0
    """Seconds the finished measurements took."""
    final: bool = False
    """Training is over: the waiting measurement starts whatever the budget says."""
    off: str | None = None
    """Why no more measurements are tried (the GPU has no room for the eval)."""
    stopping: bool = False
    """The job was asked to stop: no new measurement starts, and one killed with it is no failure."""
    final_wait_s: float = 180.0
    """At a completed end, how long the final checkpoint's measurement may still take."""

    def due(self, path: str, step: Any) -> None:
        self.waiting = (path, step if isinstance(step, int) else None)
        self.poll()

    def allowed(self, now: float) -> bool:
        """Within train.tau_budget: the finished measurements' seconds at most that share of the time since."""
        if self.stopping:
            return False
        return self.final or self.spent_s <= self.cfg.train.tau_budget * (now - self.since)

    def _start(self, path: str, step: int | None) -> None:
        t = self.cfg.train
        nice = ["nice", "-n", "10"] if shutil.which("nice") else []
        argv = [*nice, sys.executable, "-m", "dflash.eval", path, "--json", "--no-baseline"]
        argv += ["--device", self.device]
        if self.device != "cpu":
            argv += ["--headroom-gb", f"{self.cfg.run.memory_headroom_gb:g}"]
        argv += [
            "--prompts",
            self.prompts,
            "--limit",
            str(t.tau_prompt_count),
            "--max-new",
            str(t.tau_max_new),
        ]
        self.proc = Proc("tau-eval", argv, self.run.logs / "tau-eval.log")
        self.proc.start(env={"OMP_NUM_THREADS": "1"})
        self.step, self.started = step, time.time()

    def poll(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        if self.proc is not None:
            self._record(self.proc)
            self.proc = None
        if self.off is not None:
            self.waiting = None
        if self.waiting is not None and self.allowed(time.time()):
            path, step = self.waiting
            self.waiting = None
            self._start(path, step)

    def _record(self, proc: Proc) -> None:
        lines = [ln for ln in _tail(proc.log, proc.log_start).splitlines() if ln.strip()]
        result = None
        for line in reversed(lines):
            if line.startswith("{"):
                try:
                    result = json.loads(line)
                except ValueError:
                    continue
                break
        seconds = round(time.time() - self.started, 3)
        self.spent_s += seconds
        if proc.poll() == 0 and isinstance(result, dict):
            keep = ("tau", "rounds", "histogram", "acceptance_per_position", "prompts", "tokens", "tokens_per_s",
                    "prompts_from", "max_new", "drafter", "device")  # fmt: skip
            acc = _metric_at(self.run.metrics, self.step, "acc")
            self.run.event(
                "tau", step=self.step, seconds=seconds, acc=acc, **{k: result.get(k) for k in keep}
            )
        else:
            error = next(
                (ln for ln in reversed(lines) if ln.startswith("error: ")), lines[-1] if lines else ""
            )
            code = proc.poll()
            if self.stopping and code is not None and code < 0:
                error = "stopped with the job before it finished"
            if code == DoesNotFit.EXIT_CODE:
                self.off = error.removeprefix("error: ")
                self.run.event(
                    "tau_skipped",
                    step=self.step,
                    reason=f"no room for the in-job tau: {self.off}; later checkpoints are not measured "
                    "(train.tau_eval = false silences this)",
                )
                return
            self.run.event(
                "tau_failed", step=self.step, exit_code=proc.poll(), seconds=seconds, error=error[-400:]
            )

    def finish(self, wait_s: float) -> None:
        """The measurement of the newest checkpoint, within wait_s (0: stop the one running)."""
        deadline = time.time() + wait_s
        self.final = wait_s > 0
        while wait_s > 0 and time.time() < deadline and (self.waiting is not None or self.proc is not None):
            self.poll()
            time.sleep(0.2)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill_tree()
            self.run.event(
                "tau_failed", step=self.step, exit_code=None, error="stopped with the job before it finished"
            )
            self.proc = None
        self.waiting = None


def launch(args: argparse.Namespace) -> int:
    from dflash.data.prepare import plan_job, prepare_data
    from dflash.manifest import open_run_dir
    from dflash.pipeline.state_copy import remove_copies
    from dflash.pipeline.transport import HiddenStateQueue, name_for_run, segment_bytes
    from dflash.plan.resolve import torch_dtype

    if args.json and not args.plan:
        raise DFlashError("--json goes with --plan (the config check is `python -m dflash.check`)")
    cfg = load_config(args.config, args.overrides)
    nnodes, endpoint, problems = host_problems(cfg, args.nnodes, args.node_rank, args.rdzv_endpoint)
    if problems:
        raise DFlashError(problems[0][1])
    if args.plan:
        p = plan(cfg, args, nnodes, endpoint)
        print(json.dumps(p) if args.json else "\n".join(plan_lines(p)))
        return 0
    devices = worker_devices(cfg)  # refuses lists that do not match the worker counts, before anything starts
    early = EarlyStop()
    signal.signal(signal.SIGTERM, early.on_signal)
    signal.signal(signal.SIGINT, early.on_signal)
    run = open_run_dir(cfg, args.run_dir, argv=sys.argv)
    queue = None
    name = f"{name_for_run(run.root)}-n{args.node_rank}"
    try:
        early.check()
        parts = prepare_data(cfg, run)  # data and tokenizer errors surface here, before any worker starts
        early.check()
        from dflash.plan.placement import preflight

        preflight(cfg, *devices, parts.target_path)  # placement and memory, before any worker
        job = plan_job(cfg, parts)  # the job's plan (dflash.plan.builder): the drafter's sizes, tau_eval
        spec = job.spec
        features = len(spec.target_layer_ids) * spec.target_hidden_size
        elem = torch_dtype(cfg.target.dtype).itemsize
        problem = slot_problem(cfg, features, elem)
        if problem is not None:
            raise DFlashError(problem)
        state_copies(
            cfg, spec, run, name, segment_bytes(cfg.pipeline.queue_depth, slot_bytes(cfg, features, elem))
        )
        spares = plan_spares(cfg, devices, spec, elem, parts.target_path)
        run.event("spare_plan", **spares.to_dict())
        queue = HiddenStateQueue.create(
            name, capacity=cfg.pipeline.queue_depth, slot_bytes=slot_bytes(cfg, features, elem)
        )
        sup = Supervisor(
            cfg,
            run,
            args.config,
            args.overrides,
            args.node_rank,
            nnodes,
            endpoint,
            data=parts.dataset.summary(),
            spare_plan=spares,
        )
        if job.tau_eval:
            prompts = (
                parts.tau_prompts
            )  # train.tau_prompts, demo, or held out of data.path (dflash.data.holdout)
            if prompts is None:
                run.event(
                    "tau_skipped",
                    reason=f"no held-out prompts for the in-job tau: data.path has at most train.tau_prompt_count "
                    f"({cfg.train.tau_prompt_count}) records to hold out; set train.tau_prompts to a JSONL file "
                    "of prompts the job does not train on",
                )
            else:
                sup.tau = TauEval(cfg, run, prompts, device=tau_device(devices[0]))
        signal.signal(signal.SIGTERM, sup.on_signal)
        signal.signal(signal.SIGINT, sup.on_signal)
        early.check()  # from here on, a signal is the Supervisor's to handle
    except StoppedBeforeStart as e:
        remove_copies(name)
        if queue is not None:
            queue.close()
            queue.unlink()
        run.event("stopped", node_rank=args.node_rank, reason=e.reason, before_workers=True)
        print(f"{e.reason} before any worker started; run directory: {run.root}", flush=True)
        return 0
    except BaseException:
        remove_copies(name)
        if queue is not None:
            queue.close()
            queue.unlink()
        raise
    # Every worker (targets, torchrun and its drafters) inherits this and stops itself if the
    # supervisor vanishes without cleaning up (SIGKILL, OOM killer): see Heartbeat.
    os.environ[SUPERVISOR_ENV] = supervisor_token()
    try:
        sup.start(name)
        if sup.stopping:  # a signal arrived while the workers were starting
            sup.stop_drafters()
        code = sup.watch()
        outcome = sup.shutdown(code)
    finally:
        for p in sup.all_procs():
            p.kill_tree()
        if sup.queue_name:
            shutil.rmtree(sup.spare_dir, ignore_errors=True)
        remove_copies(name)
        stats = queue.stats()
        queue.close()
        queue.unlink()
    counters = {k: stats[k] for k in ("produced", "delivered", "acked", "redelivered")}
    run.event(
        "stopped",
        node_rank=args.node_rank,
        queue=counters,
        ready_at_end=stats.get("ready"),
        target_starts={p.name: p.starts for p in sup.targets},
        **outcome,
    )
    print(f"{outcome['reason']}; run directory: {run.root}", flush=True)
    return 0 if outcome["reason"] == "completed" or outcome["reason"].startswith("signal") else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return launch(args)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StoppedBeforeStart as e:  # a second signal while the run directory was being opened
        print(f"{e.reason} before the run directory was open", file=sys.stderr)
        return 0


if __name__ == "__main__":
    with without_final_gc():
        raise SystemExit(main())
