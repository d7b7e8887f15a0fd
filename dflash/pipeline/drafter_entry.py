"""The command torchrun runs for each drafter rank: hand the rank to this host's ready spare drafter
process (dflash.pipeline.spare), else become the drafter worker itself.

    torchrun ... -m dflash.pipeline.drafter_entry CONFIG --run-dir DIR --queue NAME [--set k=v ...]

No torch here: this process starts in a fraction of a second. With a spare listening on its socket
(the launcher's DFLASH_SPARE_DIR, one socket per local rank), the spare takes the rank (this
process's torchrun environment and command line) and trains it; this process stays as torchrun's
worker: it forwards SIGTERM and SIGINT to the spare, and exits with the spare's exit code, or 1 the
moment the spare's end of the socket closes without one (the spare died: the kernel closes it, so a
death is seen at once). The spare in turn exits when this process dies (torchrun stopped the group).
Without a spare, or when the spare refuses (another config, another device) or does not answer,
this process execs `python -m dflash.pipeline.drafter_worker` with the same arguments: today's path,
same pid, same start time (the timeline's process start).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

SPARE_DIR_ENV = "DFLASH_SPARE_DIR"
"""Set by the launcher for torchrun when spares run: the directory of their sockets."""
HANDOVER_TIMEOUT_S = 10.0
"""How long a spare has to answer a takeover request before the rank starts on its own."""


def socket_dir(queue_name: str) -> Path:
    """This host's spare sockets' directory, named after its hidden-state queue (short: a socket's
    path has at most 107 bytes)."""
    import hashlib
    import tempfile

    return (
        Path(tempfile.gettempdir()) / f"dflash-spare-{hashlib.sha256(queue_name.encode()).hexdigest()[:12]}"
    )


def spare_socket(directory: Path, local_rank: int) -> Path:
    return directory / f"drafter-{local_rank}.sock"


def send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


def receive(stream: Any) -> dict[str, Any] | None:
    """One newline-ended JSON message from a socket's binary file (socket.makefile("rb"): messages
    that arrive together stay apart); None when the other end closed first."""
    line = stream.readline()
    if not line.endswith(b"\n"):
        return None
    message = json.loads(line)
    return message if isinstance(message, dict) else None


def process_started() -> float | None:
    from dflash.pipeline.timeline import process_start_time

    return process_start_time()


def hand_to_spare(path: Path, argv: list[str]) -> int | None:
    """The spare's exit code once it trained this rank (1 if it died), or None when no spare took it."""
    if not path.exists():
        print(f"dflash: no spare drafter ready ({path}): this rank starts on its own", flush=True)
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(HANDOVER_TIMEOUT_S)
    try:
        conn.connect(str(path))
        stream = conn.makefile("rb")
        send(conn, {"argv": argv, "env": dict(os.environ), "pid": os.getpid(), "started": process_started()})
        reply = receive(stream)
    except (OSError, ValueError) as e:
        print(
            f"dflash: the spare drafter at {path} did not take the rank ({e}): it starts on its own",
            flush=True,
        )
        conn.close()
        return None
    if not reply or not reply.get("ok"):
        reason = reply.get("reason") if reply else "it closed the connection"
        print(f"dflash: the spare drafter refused the rank ({reason}): it starts on its own", flush=True)
        conn.close()
        return None
    pid = int(reply["pid"])
    print(f"dflash: spare drafter pid {pid} took the rank", flush=True)

    def forward(signum: int, _frame: Any) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    conn.settimeout(None)
    try:
        end = receive(stream)
    except (OSError, ValueError):
        end = None
    if end is None or "exit" not in end:
        print(f"dflash: the spare drafter pid {pid} died while training the rank", flush=True)
        return 1
    return int(end["exit"])


def main(argv: list[str]) -> None:
    directory = os.environ.get(SPARE_DIR_ENV)
    if directory:
        code = hand_to_spare(spare_socket(Path(directory), int(os.environ.get("LOCAL_RANK", "0"))), argv)
        if code is not None:
            sys.stdout.flush()
            os._exit(code)
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "dflash.pipeline.drafter_worker", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
