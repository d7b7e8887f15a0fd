"""Each degraded-kernel mode triggered for real on CPU: the event, and the strict-mode error."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch.nn.attention.flex_attention import flex_attention

from dflash.errors import DegradedKernelError
from dflash.step.guard import (
    FORCE_COMPILE_DURING_FX_TRACE,
    RECOMPILE_LIMIT,
    UNFUSED_FLEX,
    KernelGuard,
    compile_counters,
)


def recorder():
    events: list[tuple[str, str]] = []
    return events, lambda kind, detail: events.append((kind, detail))


def call_unfused_flex() -> None:
    q = torch.randn(1, 2, 8, 4)
    with torch.no_grad():
        flex_attention(q, q, q)


def test_unfused_flex_is_reported_every_time_and_strict_stops():
    events, sink = recorder()
    with KernelGuard(sink, strict=False) as guard:
        guard.check()
        assert events == []
        call_unfused_flex()
        guard.check()
        assert [k for k, _ in events] == [UNFUSED_FLEX]
        call_unfused_flex()  # flex itself warns once per process; the guard must still see this one
        guard.check()
        assert [k for k, _ in events] == [UNFUSED_FLEX, UNFUSED_FLEX]
    with KernelGuard(sink, strict=True) as guard:
        call_unfused_flex()
        with pytest.raises(DegradedKernelError, match="unfused_flex") as e:
            guard.check()
    assert "attention.compile = true" in str(e.value)


def test_compiled_flex_is_not_degraded():
    torch._dynamo.reset()  # a fresh compile: not the recompiles of flex by earlier tests in this process
    events, sink = recorder()
    q = torch.randn(1, 2, 8, 4)
    with KernelGuard(sink, strict=True) as guard, torch.no_grad():
        torch.compile(flex_attention, backend="eager")(q, q, q)
        guard.check()
    assert events == []


def test_force_compile_during_fx_trace_is_reported():
    events, sink = recorder()
    with torch._dynamo.config.patch(force_compile_during_fx_trace=True):
        with KernelGuard(sink, strict=False) as guard:
            guard.check()
            guard.check()  # reported once, not every step
        assert [k for k, _ in events] == [FORCE_COMPILE_DURING_FX_TRACE]
        with KernelGuard(sink, strict=True) as guard, pytest.raises(DegradedKernelError) as e:
            guard.check()
    assert "force_compile_during_fx_trace" in str(e.value) and "unset it" in str(e.value)


def test_recompile_limit_is_reported_and_recompiles_counted():
    def scaled(x):
        return x * 2 + 1

    before = compile_counters()
    events, sink = recorder()
    compiled = torch.compile(scaled, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2, automatic_dynamic_shapes=False):
        with KernelGuard(sink, strict=False) as guard:
            for n in (3, 4, 5, 6):  # each shape is a new compile; the third one is over the limit
                assert torch.equal(compiled(torch.ones(n)), torch.full((n,), 3.0))
            guard.check()
        assert RECOMPILE_LIMIT in [k for k, _ in events], events
        assert any("recompile_limit" in d for k, d in events if k == RECOMPILE_LIMIT)
        after = compile_counters()
        assert after["recompiles"] >= before["recompiles"] + 1
        assert after["graphs"] >= before["graphs"] + 2
        assert after["recompile_limit_hits"] > before["recompile_limit_hits"]

        def other(x):
            return x - 1

        compiled_other = torch.compile(other, backend="eager", dynamic=False)
        with KernelGuard(sink, strict=True) as guard:
            for n in (3, 4, 5):
                compiled_other(torch.ones(n))
            with pytest.raises(DegradedKernelError, match="recompile_limit"):
                guard.check()


def test_compile_counters_fields():
    c = compile_counters()
    assert set(c) == {
        "fxgraph_hits",
        "fxgraph_misses",
        "autograd_hits",
        "autograd_misses",
        "graphs",
        "recompiles",
        "recompile_limit_hits",
    }
    assert all(isinstance(v, int) and v >= 0 for v in c.values())
