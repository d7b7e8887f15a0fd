"""bench/trace_gaps.py reads a torch.profiler Chrome trace: gaps, who launched what, compiled vs eager.

The trace here is written by hand in the profiler's format (a GPU is needed for a real one): two
phases, an eager matmul, a kernel launched from a compiled region after a host sync, a kernel
whose launch the trace does not record."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from trace_gaps import analyse  # noqa: E402


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


TRACE = {
    "traceEvents": [
        _x("user_annotation", "dflash.forward", 0, 100),
        _x("user_annotation", "dflash.loss", 100, 100),
        _x("cpu_op", "aten::linear", 5, 20),
        _x("cpu_op", "aten::mm", 10, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 12, 2, correlation=1),
        _x("kernel", "nvjet_mm", 30, 10, tid=7, correlation=1),
        _x("cpu_op", "aten::nonzero", 45, 80),  # the host waits in here until the device is done
        _x("cuda_runtime", "cudaStreamSynchronize", 50, 70),
        _x("cpu_op", "Torch-Compiled Region: 0/0", 130, 30),
        _x("cuda_driver", "cuLaunchKernelEx", 135, 2, correlation=2),
        _x("kernel", "triton_red_fused_loss", 150, 20, tid=7, correlation=2),
        _x("kernel", "unlinked_copy", 172, 2, tid=7, correlation=99),
        _x("ac2g", "flow", 0, 0),  # not a complete event's category we read
    ]
}


def test_gaps_are_found_and_named_by_the_launch_that_ends_them():
    r = analyse(TRACE, steps=1)
    # Device idle: 40 -> 150 (110 us, ended by the compiled region's launch); 170 -> 172 is under 5 us.
    assert r["gaps_per_step"] == 1 and r["gaps_ms_per_step"] == 0.11
    (gap,) = r["top_gaps"]
    assert gap["launched_by"] == "Torch-Compiled Region: 0/0" and gap["phase"] == "loss"
    assert gap["next_kernel"] == "triton_red_fused_loss"
    assert gap["host_during"] == ["aten::nonzero"], gap
    assert r["gap_ms_by_phase"] == {"loss": 0.11}


def test_device_time_is_split_by_phase_into_compiled_eager_and_unlinked():
    r = analyse(TRACE, steps=2)  # per step: halved
    assert r["phases"]["forward"] == {"compiled": 0.0, "eager": 0.005, "unlinked": 0.0}
    assert r["phases"]["loss"] == {"compiled": 0.01, "eager": 0.0, "unlinked": 0.001}
    assert r["eager_ops"] == [{"op": "aten::mm", "ms": 0.005}]


def test_host_waits_name_the_call_the_op_it_ran_in_and_the_phase():
    r = analyse(TRACE, steps=2, wait_min_us=50)
    assert r["host_waits"] == [
        {
            "call": "cudaStreamSynchronize",
            "in": "aten::nonzero",
            "phase": "forward",
            "ms": 0.035,
            "calls": 0.5,
        }
    ]
    # The launches (2 us each) are no waits; by default only calls of 200 us or more are.
    assert analyse(TRACE, steps=1)["host_waits"] == []
    # Waits with the same call and place add up across threads and steps, the longest first; the
    # place is the last three host ops (phase ranges left out), on the wait's own thread.
    deep = ["dflash.optimizer", "Optimizer.step", "aten::_fused_adamw_", "aten::copy_", "aten::item"]
    trace = {
        "traceEvents": [
            _x("user_annotation", "dflash.optimizer", 0, 1000),
            *[_x("cpu_op", name, 10 + i, 900 - 2 * i, tid=2) for i, name in enumerate(deep[1:])],
            _x("cuda_runtime", "cudaStreamSynchronize", 100, 300, tid=2),
            _x("cuda_runtime", "cudaStreamSynchronize", 500, 250, tid=2),
            _x("cpu_op", "aten::nonzero", 10, 900, tid=3),
            _x("cuda_runtime", "cudaMemcpyAsync", 20, 600, tid=3),
            _x("cuda_runtime", "cudaMemcpyAsync", 700, 199, tid=3),  # under 200 us: no wait
            _x("kernel", "k", 0, 1, tid=7, correlation=1),
        ]
    }
    assert analyse(trace, steps=1)["host_waits"] == [
        {
            "call": "cudaMemcpyAsync",
            "in": "aten::nonzero",
            "phase": "optimizer",
            "ms": 0.6,
            "calls": 1.0,
        },
        {
            "call": "cudaStreamSynchronize",
            "in": "aten::_fused_adamw_ > aten::copy_ > aten::item",
            "phase": "optimizer",
            "ms": 0.55,
            "calls": 2.0,
        },
    ]


def test_a_trace_without_kernels_reports_nothing():
    assert analyse({"traceEvents": [_x("cpu_op", "aten::mm", 0, 5)]}, steps=1)["top_gaps"] == []


def test_every_device_event_is_counted_once_by_name_and_phase():
    """The kernel table bench/drafter_step.py splits into matmul / attention / loss / optimizer /
    other: each device event once (the profiler's per-op kernel lists had counted the sdpa step's
    optimizer kernels many times), in the phase it was launched in. A device event with no launch in
    the trace (launched before the window opened: the step queued ahead of it) is not the window's:
    it counts as unlinked device time of its phase only."""
    doubled = {
        "traceEvents": TRACE["traceEvents"]
        + [
            _x("cuda_runtime", "cudaLaunchKernel", 15, 2, correlation=3),  # in aten::mm, like the first
            _x("kernel", "nvjet_mm", 60, 10, tid=7, correlation=3),
        ]
    }
    r = analyse(doubled, steps=1)
    rows = {k["name"]: k for k in r["kernels"]}
    assert rows["nvjet_mm"] == {"name": "nvjet_mm", "ms": 0.02, "calls": 2, "ms_by_phase": {"forward": 0.02}}
    assert rows["triton_red_fused_loss"]["ms_by_phase"] == {"loss": 0.02}
    assert "unlinked_copy" not in rows and r["phases"]["loss"]["unlinked"] == 0.002
    assert [k["name"] for k in r["kernels"]] == ["nvjet_mm", "triton_red_fused_loss"]

    from drafter_step import profile_split

    split = profile_split(r, top=2)
    assert split["per_step_ms"] == {
        "matmul": 0.02,
        "attention": 0.0,
        "loss": 0.02,
        "optimizer": 0.0,
        "other": 0.0,
    }
    assert split["device_ms_per_step"] == 0.04
    assert [(k["name"], k["category"]) for k in split["top_kernels"]] == [
        ("nvjet_mm", "matmul"),
        ("triton_red_fused_loss", "loss"),
    ]


def test_timeline_puts_each_phase_host_range_beside_its_kernels_device_span():
    r = analyse(TRACE, steps=1)
    assert r["timeline"] == [
        {"phase": "forward", "host_ms": [0.0, 0.1], "device_ms": [0.03, 0.04]},
        # the loss's kernel ran 15 us after its launch at 135 us: the device had been idle (the gap)
        {"phase": "loss", "host_ms": [0.1, 0.2], "device_ms": [0.15, 0.17]},
    ]


def test_matrix_products_are_grouped_by_shape_with_their_rate():
    """With record_shapes, each mm/addmm/bmm host op carries its input dims: the kernels it launched
    are summed per shape, and the rate is the op's 2*M*K*N over their device time."""
    mm = {"Input Dims": [[1024, 512], [512, 256]]}
    addmm = {"Input Dims": [[256], [64, 512], [512, 256], [], []]}
    trace = {
        "traceEvents": [
            _x("user_annotation", "dflash.forward", 0, 300),
            _x("cpu_op", "aten::mm", 10, 5, **mm),
            _x("cuda_runtime", "cudaLaunchKernel", 11, 1, correlation=1),
            _x("cpu_op", "aten::mm", 20, 5, **mm),
            _x("cuda_runtime", "cudaLaunchKernel", 21, 1, correlation=2),
            _x("cpu_op", "aten::addmm", 30, 5, **addmm),
            _x("cuda_runtime", "cudaLaunchKernel", 31, 1, correlation=3),
            _x("cpu_op", "aten::add", 40, 5),
            _x("cuda_runtime", "cudaLaunchKernel", 41, 1, correlation=4),
            _x("kernel", "nvjet_a", 100, 10, tid=7, correlation=1),
            _x("kernel", "nvjet_a", 120, 30, tid=7, correlation=2),
            _x("kernel", "nvjet_b", 160, 2, tid=7, correlation=3),
            _x("kernel", "add_kernel", 170, 1, tid=7, correlation=4),
        ]
    }
    r = analyse(trace, steps=1)
    big = 2 * 1024 * 512 * 256  # per call; two calls in 40 us
    small = 2 * 64 * 512 * 256
    assert r["matmul_by_shape"] == [
        {
            "op": "aten::mm [[1024, 512], [512, 256]]",
            "ms": 0.04,
            "calls": 2,
            "tflops": round(2 * big / 40e-6 / 1e12, 1),
        },
        {
            "op": "aten::addmm [[256], [64, 512], [512, 256]]",
            "ms": 0.002,
            "calls": 1,
            "tflops": round(small / 2e-6 / 1e12, 1),
        },
    ]
    # A trace without shapes has no products to report.
    assert analyse(TRACE, steps=1)["matmul_by_shape"] == []
