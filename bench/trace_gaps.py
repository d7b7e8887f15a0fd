"""Where a profiled step's device time and idle time go, from torch.profiler's Chrome trace.

    from trace_gaps import analyse
    report = analyse(json.load(open("trace.json")), steps=3)

Three things bench/drafter_step.py --profile cannot see from kernel totals alone:
  - gaps: the GPU idle between kernels (the step's "host gaps"), each with the host op that launched
    the kernel after it and the host ops running during it (a device sync shows up as the op that
    waited, e.g. aten::item or aten::nonzero);
  - per phase (the trainer's dflash.forward / loss / backward / optimizer ranges, by time) the device
    time of compiled code (launched inside a compiled region) and of eager ops;
  - the eager kernels by the op that launched them: what is left outside torch.compile;
  - every kernel launched in the window by name, with its device time per phase (each device event
    counted once: the profiler's own per-op kernel lists counted some kernels many times over);
  - the timeline: each phase range's host start and end beside the device's span of the kernels
    launched in it (which phase the host was late for);
  - host waits: runtime or driver calls that took long on the host (cudaStreamSynchronize,
    cudaEventSynchronize, a blocking copy, an allocation that synchronizes), by call, the host op
    they ran in and the phase: the waits that leave the device idle behind the host afterwards;
  - matrix products by shape (a trace recorded with record_shapes=True): the device time of the
    kernels each aten::mm / addmm / bmm / baddbmm launched, grouped by the op's input shapes, with
    their FLOPs (2*M*K*N per product) and TFLOP/s: which of the step's products run below the rest.

Pure Python over the trace's events (no torch), so its tests run on any machine.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from typing import Any

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
HOST_CATS = ("cpu_op", "user_annotation", "python_function")
PHASE_PREFIX = "dflash."
COMPILED_MARKS = ("Torch-Compiled Region", "CompiledFunction", "CompiledFxGraph")
GAP_MIN_US = 5.0
"""Idle stretches shorter than this are launch latency, not gaps."""
HOST_WAIT_MIN_US = 200.0
"""A runtime or driver call this long on the host waited for something (a launch takes microseconds)."""


def _enclosing(ops: list[tuple[float, float, str]], queries: list[tuple[float, int]]) -> dict[int, list[str]]:
    """For each (time, id) query, the names of the host ops on one thread that contain the time,
    outermost first. ops: (start, end, name); a sweep over both sorted lists."""
    ops = sorted(ops, key=lambda o: (o[0], -o[1]))
    out: dict[int, list[str]] = {}
    stack: list[tuple[float, float, str]] = []
    i = 0
    for t, qid in sorted(queries):
        while i < len(ops) and ops[i][0] <= t:
            while stack and stack[-1][1] < ops[i][0]:
                stack.pop()
            stack.append(ops[i])
            i += 1
        while stack and stack[-1][1] < t:
            stack.pop()
        out[qid] = [name for start, end, name in stack if start <= t <= end]
    return out


MATMUL_OPS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2)}
"""The host ops of matrix products and which of their inputs are the two factors."""


def _product_flops(op: str, dims: list[Any]) -> float | None:
    """2*M*K*N (times the batch for bmm) of a matrix-product op from its recorded input dims."""
    a_i, b_i = MATMUL_OPS[op]
    if len(dims) <= b_i:
        return None
    a, b = dims[a_i], dims[b_i]
    if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
        return None
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def _innermost_op(stack: list[str]) -> str:
    """The innermost host op worth naming (aten ops, compiled regions, our ranges)."""
    for name in reversed(stack):
        if not name.startswith(("cuda", "cu", "void ")):
            return name
    return "(no host op)"


def analyse(
    trace: dict[str, Any], steps: int, top: int = 15, wait_min_us: float = HOST_WAIT_MIN_US
) -> dict[str, Any]:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") in DEVICE_CATS]
    if not kernels:
        return {"gaps_ms_per_step": 0.0, "top_gaps": [], "phases": {}, "eager_ops": [], "host_waits": []}
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    host_by_tid: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)
    phases: list[tuple[float, float, str]] = []
    product_flops: dict[str, float | None] = {}  # a matrix product's label (op and dims): its FLOPs
    product_calls: Counter[str] = Counter()  # and how many times the op ran
    for e in events:
        if e.get("cat") in HOST_CATS:
            start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
            name = e["name"]
            dims = e.get("args", {}).get("Input Dims")
            if name in MATMUL_OPS and dims:
                # Labelled with its shapes: kernels launched in it are grouped by them below.
                name = f"{name} {[d for d in dims if d]}"
                product_flops.setdefault(name, _product_flops(e["name"], dims))
                product_calls[name] += 1
            host_by_tid[e["tid"]].append((start, end, name))
            if e.get("cat") == "user_annotation" and e["name"].startswith(PHASE_PREFIX):
                phases.append((start, end, e["name"][len(PHASE_PREFIX) :]))
    phases.sort()
    phase_starts = [p[0] for p in phases]

    def phase_index(t: float) -> int | None:
        """The phase range that contains time t (its index in phases), None outside every range."""
        i = bisect.bisect_right(phase_starts, t) - 1
        return i if i >= 0 and phases[i][0] <= t <= phases[i][1] else None

    def phase_at(t: float) -> str:
        i = phase_index(t)
        return "outside" if i is None else phases[i][2]

    # Host stack at every kernel's launch, per launching thread.
    queries: dict[Any, list[tuple[float, int]]] = defaultdict(list)
    for i, k in enumerate(kernels):
        launch = launches.get(k.get("args", {}).get("correlation"))
        if launch is not None:
            queries[launch["tid"]].append((float(launch["ts"]), i))
    stacks: dict[int, list[str]] = {}
    launch_ts: dict[int, float] = {}
    for tid, qs in queries.items():
        stacks.update(_enclosing(host_by_tid.get(tid, []), qs))
        launch_ts.update({i: t for t, i in qs})

    # Device time per phase, compiled or eager; eager kernels by launching op.
    per_phase: dict[str, dict[str, float]] = defaultdict(
        lambda: {"compiled": 0.0, "eager": 0.0, "unlinked": 0.0}
    )
    eager_ops: dict[str, float] = defaultdict(float)
    products: dict[str, float] = defaultdict(float)  # label: device us of its kernels
    # Every device event launched in the window once, by name and the phase of its launch. Unlinked
    # ones (no launch recorded: launched before the window opened, as the step queued ahead of a
    # window that starts in the job's steady state) count in `phases` only: the window's steps
    # are the ones it launched.
    by_kernel: dict[str, dict[str, Any]] = {}
    for i, k in enumerate(kernels):
        dur = float(k.get("dur", 0.0))
        if i not in stacks:
            per_phase[phase_at(float(k["ts"]))]["unlinked"] += dur
            continue
        row = by_kernel.setdefault(k["name"], {"us": 0.0, "calls": 0, "phases": defaultdict(float)})
        row["us"] += dur
        row["calls"] += 1
        row["phases"][phase_at(launch_ts[i])] += dur
        stack = stacks[i]
        product = next((n for n in reversed(stack) if n in product_flops), None)
        if product is not None:
            products[product] += dur
        kind = "compiled" if any(n.startswith(COMPILED_MARKS) for n in stack) else "eager"
        per_phase[phase_at(launch_ts[i])][kind] += dur
        if kind == "eager":
            eager_ops[_innermost_op(stack)] += dur

    # Idle stretches of the device between the first and the last kernel (all streams merged).
    order = sorted(range(len(kernels)), key=lambda i: float(kernels[i]["ts"]))
    gaps: list[dict[str, Any]] = []
    busy_until = float(kernels[order[0]]["ts"]) + float(kernels[order[0]].get("dur", 0.0))
    for i in order[1:]:
        k = kernels[i]
        start = float(k["ts"])
        if start - busy_until >= GAP_MIN_US:
            gap = {"us": start - busy_until, "start": busy_until, "next_kernel": k["name"][:100]}
            gap["launched_by"] = _innermost_op(stacks.get(i, []))
            gap["phase"] = phase_at(launch_ts.get(i, start))
            gaps.append(gap)
        busy_until = max(busy_until, start + float(k.get("dur", 0.0)))
    ranked_gaps = sorted(gaps, key=lambda g: -g["us"])[:top]
    # What the host threads were in at the middle of each of the largest gaps (innermost ops last).
    mids = [(g["start"] + g["us"] / 2, n) for n, g in enumerate(ranked_gaps)]
    during: dict[int, list[str]] = defaultdict(list)
    for ops in host_by_tid.values():
        for n, stack in _enclosing(ops, mids).items():
            inner = [name for name in stack if not name.startswith(PHASE_PREFIX)][-3:]
            if inner:
                during[n].append(" > ".join(inner))
    for n, g in enumerate(ranked_gaps):
        g["host_during"] = during.get(n, [])[:3]
    by_op: dict[str, float] = defaultdict(float)
    by_phase: dict[str, float] = defaultdict(float)
    for g in gaps:
        by_op[g["launched_by"]] += g["us"]
        by_phase[g["phase"]] += g["us"]

    # Host calls into the CUDA runtime/driver that took long: a wait for the device (a sync, an
    # event wait, a blocking copy, an allocation that synchronizes), by call and the host op it was in.
    waits: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    wait_queries: dict[Any, list[tuple[float, int]]] = defaultdict(list)
    slow = [e for e in events if e.get("cat") in LAUNCH_CATS and float(e.get("dur", 0.0)) >= wait_min_us]
    for n, e in enumerate(slow):
        wait_queries[e["tid"]].append((float(e["ts"]), n))
    wait_stacks: dict[int, list[str]] = {}
    for tid, qs in wait_queries.items():
        wait_stacks.update(_enclosing(host_by_tid.get(tid, []), qs))
    for n, e in enumerate(slow):
        stack = [name for name in wait_stacks.get(n, []) if not name.startswith(PHASE_PREFIX)]
        row = waits[(e["name"], " > ".join(stack[-3:]) or "(no host op)", phase_at(float(e["ts"])))]
        row[0] += float(e["dur"])
        row[1] += 1

    def ms(us: float) -> float:
        return round(us / 1000.0 / steps, 3)

    # The timeline: each phase range as the host ran it, beside the device's span of the kernels
    # launched in it (ms from the first range's start). A range whose kernels start as soon as the
    # host launches them, with the device idle before, is one the host was late for.
    launched_in: dict[int, list[int]] = defaultdict(list)
    for i, t in launch_ts.items():
        n = phase_index(t)
        if n is not None:
            launched_in[n].append(i)
    t0 = phases[0][0] if phases else 0.0
    timeline = []
    for n, (start, end, name) in enumerate(phases):
        row: dict[str, Any] = {
            "phase": name,
            "host_ms": [round((start - t0) / 1e3, 3), round((end - t0) / 1e3, 3)],
        }
        if launched_in[n]:
            first = min(float(kernels[i]["ts"]) for i in launched_in[n])
            last = max(float(kernels[i]["ts"]) + float(kernels[i].get("dur", 0.0)) for i in launched_in[n])
            row["device_ms"] = [round((first - t0) / 1e3, 3), round((last - t0) / 1e3, 3)]
        timeline.append(row)

    by_shape = []
    for label, us in sorted(products.items(), key=lambda kv: -kv[1]):
        flops = product_flops[label]
        # Every call of a label has the same shapes: its FLOPs once per call of the op. The calls are
        # counted by the op's events, not its kernels (a product may launch a kernel and a reduction).
        calls = product_calls[label]
        by_shape.append(
            {
                "op": label,
                "ms": ms(us),
                "calls": round(calls / steps, 2),
                "tflops": round(flops * calls / (us * 1e-6) / 1e12, 1) if flops and us else None,
            }
        )

    return {
        "gaps_ms_per_step": ms(sum(g["us"] for g in gaps)),
        "gaps_per_step": round(len(gaps) / steps, 1),
        "gap_ms_by_phase": {p: ms(v) for p, v in sorted(by_phase.items(), key=lambda kv: -kv[1])},
        "gap_ms_by_next_launcher": {
            op: ms(v) for op, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
        },
        "top_gaps": [
            {
                "ms": round(g["us"] / 1000.0, 3),
                "phase": g["phase"],
                "next_kernel": g["next_kernel"],
                "launched_by": g["launched_by"],
                "host_during": g.get("host_during", []),
            }
            for g in ranked_gaps
        ],
        "host_waits": [
            {"call": call, "in": where, "phase": phase, "ms": ms(v[0]), "calls": round(v[1] / steps, 2)}
            for (call, where, phase), v in sorted(waits.items(), key=lambda kv: -kv[1][0])[:top]
        ],
        "phases": {p: {k: ms(v) for k, v in d.items()} for p, d in per_phase.items()},
        "timeline": timeline,
        "matmul_by_shape": by_shape[: top * 3],
        "eager_ops": [
            {"op": op, "ms": ms(v)} for op, v in sorted(eager_ops.items(), key=lambda kv: -kv[1])[: top * 2]
        ],
        "kernels": [
            {
                "name": name,
                "ms": ms(row["us"]),
                "calls": round(row["calls"] / steps, 2),
                "ms_by_phase": {p: ms(v) for p, v in row["phases"].items()},
            }
            for name, row in sorted(by_kernel.items(), key=lambda kv: -kv[1]["us"])
        ],
    }
