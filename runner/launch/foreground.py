"""foreground backend: the supervisor runs in this terminal (CI, Slurm, a container entrypoint),
with the same plan and records as the other backends; its output also goes to
logs/supervisor.log. Ctrl-C reaches the job as SIGINT (a graceful stop with a checkpoint)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

from runner.exec import remote
from runner.launch.backend import Backend
from runner.launch.plan import HostPlan, shell_line
from runner.rundir import layout


def run(hosts: list[HostPlan], *, on_line: Callable[[str, str], None] | None = None) -> int:
    """Start every host's supervisor, stream their output, and return the worst exit code. Called
    from the main thread it ignores SIGINT (the job has it from the terminal) and forwards SIGTERM
    to the job; from another thread it leaves the signals to the main thread."""
    procs: list[subprocess.Popen[bytes]] = []
    for hp in hosts:
        if hp.host is None:
            # Local: the job writes through us into the log, so a dying tee cannot break its pipe.
            procs.append(
                subprocess.Popen(
                    hp.argv,
                    cwd=hp.cwd,
                    env={**os.environ, **hp.env},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
        else:
            # -t: Ctrl-C travels to the remote job as SIGINT through its terminal.
            argv = remote.remote_argv(hp.host, ["sh", "-c", shell_line(hp, log=True)], tty=sys.stdin.isatty())
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    emit = on_line or (lambda prefix, line: print(f"{prefix}{line}", flush=True))
    prefix = len(hosts) > 1

    def pump(hp: HostPlan, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        # Remote hosts tee into their own run directory; a local job writes its log through us.
        path = f"{hp.run_dir}/{layout.SUPERVISOR_LOG}" if hp.host is None else os.devnull
        with open(path, "ab") as log:
            for raw in proc.stdout:
                log.write(raw)
                log.flush()
                emit(f"[node{hp.node_rank}] " if prefix else "", raw.decode(errors="replace").rstrip("\n"))

    threads = [
        threading.Thread(target=pump, args=(hp, p), daemon=True) for hp, p in zip(hosts, procs, strict=True)
    ]
    for t in threads:
        t.start()

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    # Python sets signal handlers in the main thread only (elsewhere signal.signal raises). Off it,
    # the caller's main thread owns the signals; the job still gets Ctrl-C from the terminal.
    handle = threading.current_thread() is threading.main_thread()
    # The job gets Ctrl-C from the terminal itself (same process group); we only wait for it.
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if handle else None
    old_term = signal.signal(signal.SIGTERM, forward) if handle else None
    try:
        codes = [p.wait() for p in procs]
        for t in threads:
            t.join(timeout=10)
    finally:
        if handle:
            signal.signal(signal.SIGINT, old)
            signal.signal(signal.SIGTERM, old_term)
    return max(codes, key=abs) if codes else 0


class ForegroundBackend(Backend):
    """The supervisor in the launching terminal: `run` calls run() above; no handle is kept, so the
    run directory and the recorded pids answer ps and stop."""

    name = "foreground"
    runs_here = True


BACKEND = ForegroundBackend()
