"""The watch's real NVML path on a GPU host, against nvidia-smi (run on the H200 by bench/h200_watch.sh):

    python bench/nvml_check.py --out OUT.json [--gib 10] [--seconds 8]

A child process holds `--gib` GiB on GPU 0 and keeps it busy with matmuls; meanwhile the sampler's
own NVML reader (runner.watch.nvml, as `dflashctl watch` runs it) and `nvidia-smi` are read side by
side, three times. Reported: memory used/total, utilization, temperature, power, SM clock, the
child's per-process memory (by pid), throttle reasons and ECC, and the largest differences.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import sys, time, torch
gib = float(sys.argv[1])
hold = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
print("ready", flush=True)
end = time.time() + float(sys.argv[2])
while time.time() < end:
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
"""


def smi() -> dict:
    q = "index,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw,clocks.sm"
    gpu = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()[0]  # fmt: skip
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, check=True).stdout.strip().splitlines()  # fmt: skip
    f = [x.strip() for x in gpu.split(",")]
    return {
        "mem_used_mb": float(f[1]), "mem_total_mb": float(f[2]), "util_gpu": float(f[3]),
        "temp_c": float(f[4]), "power_w": float(f[5]), "sm_clock_mhz": float(f[6]),
        "procs": {int(p.split(",")[0]): float(p.split(",")[1]) for p in apps if p.strip()},
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from runner.watch.nvml import NVML

    child = subprocess.Popen([sys.executable, "-c", CHILD, str(args.gib), str(args.seconds + 20)],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    time.sleep(2)
    nvml = NVML()
    rows = []
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            g = nvml.read_gpus()[0]
            read_ms = (time.perf_counter() - t0) * 1e3
            s = smi()
            mine = {p["pid"]: p["mem_mb"] for p in g["procs"]} if isinstance(g.get("procs"), list) else {}
            rows.append({
                "nvml": {k: g.get(k) for k in ("name", "mem_used_mb", "mem_total_mb", "util_gpu", "temp_c",
                                               "power_w", "sm_clock_mhz", "throttle", "ecc_mode", "ecc_uncorrected")},
                "nvml_child_mem_mb": mine.get(child.pid), "nvml_read_ms": round(read_ms, 2),
                "smi": {k: v for k, v in s.items() if k != "procs"}, "smi_child_mem_mb": s["procs"].get(child.pid),
            })  # fmt: skip
            time.sleep(1.0)
        xid = nvml.poll_xids()
        status = nvml.status
    finally:
        child.kill()
        nvml.close()
    diff = {
        "mem_used_mb": max(abs(r["nvml"]["mem_used_mb"] - r["smi"]["mem_used_mb"]) for r in rows),
        "mem_total_mb": max(abs(r["nvml"]["mem_total_mb"] - r["smi"]["mem_total_mb"]) for r in rows),
        "child_mem_mb": max(abs((r["nvml_child_mem_mb"] or 0) - (r["smi_child_mem_mb"] or -1)) for r in rows),
    }
    result = {"nvml_status": status, "child_pid": child.pid, "rows": rows, "max_abs_diff": diff, "xid": xid,
              "ok": diff["mem_used_mb"] <= 64 and diff["child_mem_mb"] <= 64 and diff["mem_total_mb"] <= 1}  # fmt: skip
    text = json.dumps(result, indent=2, default=str)
    tmp = args.out + ".tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, args.out)
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
