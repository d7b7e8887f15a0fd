"""Helpers shared by the bench scripts: where results go, and GPU-correct timing."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path


def default_out(name: str) -> str:
    return str(Path(os.environ["OUT"]) / f"{name}.json") if os.environ.get("OUT") else f"./{name}.json"


def bench_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    import torch  # here, not at import: the pipeline bench's parent process stays torch-free

    if device == "cuda":
        try:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=5, rep=max(25, reps * 10)))
        except ImportError:
            pass
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) * 1000 / reps
