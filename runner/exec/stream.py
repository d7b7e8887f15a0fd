"""The one subprocess line streamer: every long-running command whose output the user watches
(image builds, venv builds, warm runs) goes through `stream`."""

from __future__ import annotations

import collections
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from runner.errors import RunnerError

TAIL_LINES = 30
STDERR_KEPT = 1 << 20
"""Of a failed command's own stderr (merge_stderr=False), the last bytes StreamFailed carries."""


class StreamFailed(RunnerError):
    """A streamed command exited non-zero: the message quotes its tail; the exit code and stderr
    are kept for a caller that knows the command's own error protocol."""

    def __init__(self, message: str, *, returncode: int, stderr: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr


def stream(
    argv: Sequence[str],
    *,
    on_line: Callable[[str], None],
    stdin_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    merge_stderr: bool = True,
    what: str | None = None,
) -> None:
    """Run argv, handing each stdout line (without its newline) to on_line as it arrives.

    merge_stderr=False keeps stderr out of on_line (a JSON-lines protocol on stdout) but still quotes
    its tail when the command fails. A non-zero exit raises StreamFailed naming `what` (default: the
    command) with the last lines of output."""
    label = what or f"`{' '.join(argv[:4])}{' ...' if len(argv) > 4 else ''}`"
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    with tempfile.TemporaryFile() as err:
        stdin = stdin_path.open("rb") if stdin_path else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(
                list(argv),
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if merge_stderr else err,
                env=dict(env) if env is not None else None,
            )
        except FileNotFoundError as e:
            raise RunnerError(f"cannot run {argv[0]!r}: {e.strerror}; is it installed and on PATH?") from None
        finally:
            if stdin_path:
                stdin.close()  # type: ignore[union-attr]
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\r\n")
            if merge_stderr:
                tail.append(line)
            on_line(line)
        rc = proc.wait()
        if rc != 0:
            stderr = ""
            if not merge_stderr:
                err.seek(max(0, err.seek(0, 2) - STDERR_KEPT))
                stderr = err.read().decode(errors="replace")
                tail.extend(stderr.strip().splitlines()[-TAIL_LINES:])
            raise StreamFailed(
                f"{label} failed with exit code {rc}; last lines:\n" + "\n".join(tail),
                returncode=rc,
                stderr=stderr,
            )
