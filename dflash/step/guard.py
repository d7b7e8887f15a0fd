"""Degraded kernels are never silent, and compile work is counted.

KernelGuard watches, for the life of a worker, for the three ways the field lost its fast kernels
without a crash:
  unfused_flex                    flex_attention ran without torch.compile (it materialises the full
                                  score matrix: slow and memory hungry);
  recompile_limit                 dynamo hit its recompile limit and now runs that code eagerly;
  force_compile_during_fx_trace   the flag that hid the multi-thread compile crash and gave slow kernels.
Detections are queued by hooks (a warnings hook, a logging handler, counters) and delivered by
`check()`, once per step, to `on_degraded(kind, detail)`; in strict mode `check()` then raises
DegradedKernelError saying what happened and what to do.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from dflash.errors import DegradedKernelError

UNFUSED_FLEX = "unfused_flex"
RECOMPILE_LIMIT = "recompile_limit"
FORCE_COMPILE_DURING_FX_TRACE = "force_compile_during_fx_trace"

_FLEX_WARNING = "flex_attention called without torch.compile()"
_FLEX_WARNING_ID = "flex_attention_performance"
_RECOMPILE_LIMIT_LOG = "torch._dynamo hit config."

ADVICE = {
    UNFUSED_FLEX: "flex attention ran unfused (no torch.compile): set attention.compile = true, or use "
    "attention.backend = sdpa; never call flex outside dflash.step.attention.flex",
    RECOMPILE_LIMIT: "dynamo stopped compiling after too many recompiles and now runs eagerly: too many distinct "
    "shapes reach the compiled code; raise data.bucket_multiple (fewer length buckets) or fix the recompile "
    "reason (run with TORCH_LOGS=recompiles)",
    FORCE_COMPILE_DURING_FX_TRACE: "torch._dynamo.config.force_compile_during_fx_trace is True, the workaround "
    "that trades a compile crash for slow kernels: unset it and run one compiling worker per process "
    "(dflash never compiles from several threads)",
}

_recompiles = 0
_recompile_hook_installed = False


def _count_recompile() -> str:
    # Called by dynamo for every frame it compiles, after it has decided whether this compile is a
    # recompilation (the metrics context holds the reason). No public counter exists for it.
    global _recompiles
    try:
        reason = torch._dynamo.utils.get_metrics_context()._metrics.get("recompile_reason")
    except AttributeError:
        reason = None
    if reason:
        _recompiles += 1
    return ""


def _install_recompile_hook() -> None:
    global _recompile_hook_installed
    if not _recompile_hook_installed:
        torch._dynamo.utils.register_hook_for_recompile_user_context(_count_recompile)
        _recompile_hook_installed = True


_install_recompile_hook()


def _recompile_limit_hits() -> int:
    # Dynamo records the "recompile limit exceeded" Unsupported in counters["unimplemented"].
    return sum(n for msg, n in counters["unimplemented"].items() if "recompile limit" in str(msg).lower())


def compile_counters() -> dict[str, int]:
    """Process-wide compile statistics (cumulative since process start / import)."""
    return {
        "fxgraph_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fxgraph_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
        "autograd_hits": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "autograd_misses": int(counters["aot_autograd"]["autograd_cache_miss"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "recompiles": _recompiles,
        "recompile_limit_hits": _recompile_limit_hits(),
    }


class _RecompileLimitHandler(logging.Handler):
    def __init__(self, sink: Callable[[str, str], None]) -> None:
        super().__init__(level=logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # a malformed record must never break the compile that logged it
            return
        if msg.startswith(_RECOMPILE_LIMIT_LOG):
            self.sink(RECOMPILE_LIMIT, " ".join(msg.splitlines()[:2]).strip())


class KernelGuard:
    """Use as `with KernelGuard(on_degraded, strict): ... guard.check() each step ...`."""

    def __init__(self, on_degraded: Callable[[str, str], None], strict: bool) -> None:
        self.on_degraded = on_degraded
        self.strict = strict
        self._pending: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._handler = _RecompileLimitHandler(self._queue)
        self._prev_showwarning: Any = None
        self._warnings_ctx: Any = None
        self._limit_hits_seen = 0
        self._limit_logged = 0
        self._force_reported = False
        self.events: list[tuple[str, str]] = []
        """Every event delivered so far (kind, detail)."""

    def _queue(self, kind: str, detail: str) -> None:
        with self._lock:
            self._pending.append((kind, detail))
            if kind == RECOMPILE_LIMIT:
                self._limit_logged += 1

    def _showwarning(
        self, message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        if _FLEX_WARNING in str(message):
            self._queue(UNFUSED_FLEX, f"{_FLEX_WARNING} (warned at {filename}:{lineno})")
        self._prev_showwarning(message, category, filename, lineno, file, line)

    def start(self) -> KernelGuard:
        _install_recompile_hook()
        self._warnings_ctx = warnings.catch_warnings()
        self._warnings_ctx.__enter__()
        # flex warns once per process; forget that it did so every later unfused call is seen too,
        # and show the warning every time (not once per call site).
        shown = getattr(torch.nn.attention.flex_attention, "_WARNINGS_SHOWN", None)
        if isinstance(shown, set):
            shown.discard(_FLEX_WARNING_ID)
        warnings.filterwarnings("always", message=_FLEX_WARNING)
        self._prev_showwarning = warnings.showwarning
        warnings.showwarning = self._showwarning
        logging.getLogger("torch._dynamo").addHandler(self._handler)
        self._limit_hits_seen = _recompile_limit_hits()
        return self

    def stop(self) -> None:
        logging.getLogger("torch._dynamo").removeHandler(self._handler)
        if self._warnings_ctx is not None:
            warnings.showwarning = self._prev_showwarning
            self._warnings_ctx.__exit__(None, None, None)
            self._warnings_ctx = None
        self._drain()

    def __enter__(self) -> KernelGuard:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _drain(self) -> list[tuple[str, str]]:
        # flex re-arms its once-per-process warning after each report so the next unfused call warns again.
        shown = getattr(torch.nn.attention.flex_attention, "_WARNINGS_SHOWN", None)
        if isinstance(shown, set):
            shown.discard(_FLEX_WARNING_ID)
        hits = _recompile_limit_hits()
        with self._lock:
            new_hits, self._limit_hits_seen = hits - self._limit_hits_seen, hits
            # Logging can be silenced (TORCH_LOGS); the counter cannot. Report hits the log missed.
            for _ in range(max(0, new_hits - self._limit_logged)):
                self._pending.append(
                    (RECOMPILE_LIMIT, "dynamo recompile limit exceeded (counters['unimplemented'])")
                )
            self._limit_logged = 0
            events, self._pending = self._pending, []
        if torch._dynamo.config.force_compile_during_fx_trace and not self._force_reported:
            self._force_reported = True
            events.append(
                (FORCE_COMPILE_DURING_FX_TRACE, "torch._dynamo.config.force_compile_during_fx_trace = True")
            )
        for kind, detail in events:
            self.events.append((kind, detail))
            self.on_degraded(kind, detail)
        return events

    def check(self) -> None:
        events = self._drain()
        if self.strict and events:
            kinds = sorted({k for k, _ in events})
            lines = [f"degraded kernels ({', '.join(kinds)}) with strict_kernels on:"]
            lines += [f"  {kind}: {detail}" for kind, detail in events]
            lines += [f"  what to do: {ADVICE[k]}" for k in kinds]
            lines.append(
                "  (attention.strict_kernels = false lets the run continue slowly, still reporting these)"
            )
            raise DegradedKernelError("\n".join(lines))
