"""Reads the job's status line back into a metrics record, for logs of jobs that predate
metrics.jsonl (the field's). The runner cannot import dflash, so this is the runner's own reader of
the format documented in docs/run-directory.md:

    [23m] step=14 loss=10.6894 acc=0.011 streak=0.0 lr=7.53e-06 noise=0.0006 | tgt=0.11b/s
    dft=0.11b/s (4.6Ktok/s) | q_pre=[50, 46, 48, 46, 47] q_hs=[0] | epoch~0.01 ETA=36.9d
"""

from __future__ import annotations

import re
from typing import Any

_NUM = r"(---|[-+0-9.eE]+)"
_LINE = re.compile(
    rf"\[(\d+)m\] step=(\d+) loss={_NUM} acc={_NUM} streak={_NUM} lr={_NUM} noise={_NUM} \| "
    rf"tgt={_NUM}b/s dft={_NUM}b/s \(([0-9.]+)Ktok/s\) \| q_pre=\[([^\]]*)\] q_hs=\[([^\]]*)\] \| "
    rf"epoch~{_NUM} ETA=(--|[0-9.]+[mhd])"
)
_UNIT_S = {"m": 60, "h": 3600, "d": 86400}


def _num(s: str) -> float | None:
    return None if s == "---" else float(s)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_status_line(line: str) -> dict[str, Any]:
    """The metrics fields a status line carries; ValueError if `line` holds none."""
    m = _LINE.search(line)
    if not m:
        raise ValueError(f"not a DFlash status line: {line[:120]!r}")
    mins, step, loss, acc, streak, lr, noise, tgt, dft, ktok, q_pre, q_hs, epoch, eta = m.groups()
    return {
        "elapsed_s": int(mins) * 60,
        "step": int(step),
        "loss": _num(loss),
        "acc": _num(acc),
        "streak": _num(streak),
        "lr": _num(lr),
        "noise": _num(noise),
        "tgt_bps": _num(tgt),
        "dft_bps": _num(dft),
        "tok_s": float(ktok) * 1000,
        "q_pre": _ints(q_pre),
        "q_hs": _ints(q_hs),
        "epoch": _num(epoch),
        "eta_s": None if eta == "--" else float(eta[:-1]) * _UNIT_S[eta[-1]],
    }
