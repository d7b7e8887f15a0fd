"""Running a test file's check_* functions under Triton's interpreter (TRITON_INTERPRET=1), for the
hand-written kernels (dflash.step.loss_kernel, dflash.step.optim_kernel) on the CPU.

The interpreter must be on before Triton is first imported (triton.language's own helpers are
jitted at import), and other tests import it through inductor: the checks run in a process of
their own, the test file run as a script."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(test_file: str, checks: Mapping[str, Callable[[], None]]) -> None:
    """Run test_file as a script with the interpreter on; every check must report that it passed."""
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
    }
    r = subprocess.run([sys.executable, test_file], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ran = [line for line in r.stdout.splitlines() if line.startswith("passed ")]
    assert ran == [f"passed {name}" for name in checks], r.stdout


def main(checks: Mapping[str, Callable[[], None]]) -> None:
    """The script side: run each check, report it."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for name, check in checks.items():
        check()
        print(f"passed {name}", flush=True)
