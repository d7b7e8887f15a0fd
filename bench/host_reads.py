"""The step's small reads to the host beside a long device-to-host copy on another stream (the
drafter state copy, dflash.pipeline.state_copy: 12.6 GB at 8B, about 0.22 s on an H100's PCIe 5).

A copy through the copy engine waits there behind the long copy, and the stream that queued it, the
step's own, stalls as long: every state copy then cost the step its whole length, however long the
step (H100, 2026-12-07: bench/drafter_step.py --state-copy-every 1, +27% at 6 x 4096 and +22% at
8 x 4096, about 0.21 s a copy). dflash.step.objective.HostCopy writes the values with a kernel
instead (KERNEL_READS), which passes beside the copy engine.

This times a stream of matrix products (the step's stand-in) with two HostCopy reads queued among
them, alone and beside a --copy-gb copy into page-locked memory on another stream, with the job's
HostCopy both ways (KERNEL_READS on, off). Needs a GPU:
    python bench/host_reads.py --out $OUT/host_reads.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from common import default_out

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copy-gb", type=float, default=8.0, help="the long copy's size")
    ap.add_argument("--matmuls", type=int, default=150, help="8192^2 bf16 products in the timed stream")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=default_out("host_reads"))
    args = ap.parse_args()

    import torch

    from dflash.step import objective

    if not torch.cuda.is_available():
        raise SystemExit("bench/host_reads.py needs a CUDA device")
    dev = torch.device("cuda")
    n = int(args.copy_gb * 1e9)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    x = torch.arange(35, device=dev, dtype=torch.float32)
    compute, side = torch.cuda.current_stream(), torch.cuda.Stream()
    read_at = {5, args.matmuls // 2}

    def once(copy: bool, reads: bool) -> float:
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        if copy:
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
        held = []
        for i in range(args.matmuls):
            a @ a
            if reads and i in read_at:
                held.append(objective.HostCopy(x))
        t1.record()
        torch.cuda.synchronize()
        assert all(torch.equal(h.get(), x.cpu()) for h in held)
        return t0.elapsed_time(t1)

    def timed(copy: bool, reads: bool) -> float:
        once(copy, reads)
        return min(once(copy, reads) for _ in range(args.reps))

    torch.cuda.synchronize()
    c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        c0.record(side)
        dst.copy_(src, non_blocking=True)
        c1.record(side)
    torch.cuda.synchronize()
    res: dict = {"device": torch.cuda.get_device_name(), "copy_gb": n / 1e9, "copy_ms": c0.elapsed_time(c1)}
    res["products_ms"] = timed(False, False)
    res["products_beside_copy_ms"] = timed(True, False)
    for mode in (False, True):
        objective.KERNEL_READS = mode
        key = "kernel" if mode else "copy_engine"
        res[f"reads_{key}_ms"] = timed(False, True)
        res[f"reads_{key}_beside_copy_ms"] = timed(True, True)
    print(f"{res['device']}: the {res['copy_gb']:.1f} GB copy alone {res['copy_ms']:.0f} ms")
    print(
        f"products alone {res['products_ms']:.0f} ms, beside the copy {res['products_beside_copy_ms']:.0f} ms"
    )
    for key in ("copy_engine", "kernel"):
        print(
            f"with 2 reads through {key.replace('_', ' ')}: {res[f'reads_{key}_ms']:.0f} ms alone, "
            f"{res[f'reads_{key}_beside_copy_ms']:.0f} ms beside the copy"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
