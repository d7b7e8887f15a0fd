"""Helpers shared by the bench scripts: where results go, and GPU-correct timing."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIG_8B = REPO / "configs" / "qwen3-8b.toml"
"""The shipped 8B config: what the GPU runs of the benches measure."""
CONFIG_TINY = REPO / "configs" / "demo-cpu.toml"
"""The demo's config: the benches' --tiny CPU runs."""


def report_header(bench: str, on_gpu: bool) -> dict[str, Any]:
    """The fields every bench's JSON report starts with: which bench, when, the exact command, the
    torch build and the device."""
    import datetime
    import sys

    import torch

    return {
        "bench": bench,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
    }


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    """A bench's JSON result, atomically (the job's own writer)."""
    from dflash.rundir import atomic_write_json

    atomic_write_json(Path(path), report)


def time_loop(fn: Callable[[], object], device: str, iters: int, warmup: int = 1) -> float:
    """Milliseconds per call: CUDA events around the timed loop on GPU, perf_counter on CPU."""
    import torch

    for _ in range(warmup):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) * 1000 / iters


def default_out(name: str) -> str:
    return str(Path(os.environ["OUT"]) / f"{name}.json") if os.environ.get("OUT") else f"./{name}.json"


def bench_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    """Triton's do_bench on GPU where available, else time_loop."""
    if device == "cuda":
        try:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=5, rep=max(25, reps * 10)))
        except ImportError:
            pass
    return time_loop(fn, device, reps)
