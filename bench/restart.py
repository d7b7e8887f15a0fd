"""What a drafter death costs: SIGKILL drafter rank 0 of the real job, then time the new generation's
way to its first trained step, phase by phase (the job's own `generation_start` event), and count
the steps it rolled back. The first start (launch -> first trained step) is printed too.

H200 (configs/qwen3-8b.toml as shipped: one target and one drafter co-located on cuda:0; the random
8B-size target of bench/pipeline.py; one 4096 bucket; the cache warmed first, so the job's start
and restart find it warm, as after `dflashctl cache restore`):
    python bench/restart.py --work /tmp/dflash-bench --out $OUT/restart.json
CPU (configs/demo-cpu.toml, its tiny target, the cache warmed first; about 2 minutes on 2 cores):
    .venv/bin/python bench/restart.py --tiny --work /tmp/dflash-bench-tiny --out /tmp/restart.json

Steps: 1. the target and data (8B only: bench/pipeline.py's random target and data files, reused);
2. `python -m dflash.warm` into a cache dir under --work (reused when its warm.json matches);
3. `python -m dflash.launch` with DFLASH_CACHE_DIR on that dir, until drafter rank 0 has trained
--kill-at-step steps; 4. SIGKILL it; 5. wait for generation 1's `generation_start`; 6. stop the job
(two SIGTERMs: no final checkpoint). The gap is measured here, from just before the SIGKILL to the
event's own time (written right after the new generation's first step); the phases add up to the
job's own measure of it, from the dead rank's last heartbeat.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import CONFIG_8B, CONFIG_TINY, default_out, report_header, write_report  # noqa: E402  (bench/)


def job_parser(doc: str, name: str) -> argparse.ArgumentParser:
    """The options of a bench that runs the real job (this one, bench/tau_cost.py): the config
    (--tiny), the scratch dir, the job part's time limit, overrides and the report's path."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the CPU demo config instead of the 8B one on a GPU")
    ap.add_argument("--work", default="/tmp/dflash-bench", help="scratch: target, data, cache, run dir")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds for the whole job part")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=default_out(name))
    return ap


def parse_args() -> argparse.Namespace:
    ap = job_parser(__doc__, "restart")
    ap.add_argument(
        "--kill-at-step", type=int, default=6, help="SIGKILL drafter rank 0 once it trained this many steps"
    )
    ap.add_argument(
        "--checkpoint-every", type=int, default=0, help="train.checkpoint_every (0: none before the kill)"
    )
    ap.add_argument(
        "--spares",
        default="off,auto",
        help="pipeline.spare_drafters values to measure in turn, comma-separated (off: today's cold "
        "restart; auto: the spare the job chooses), each on the same warm cache",
    )
    ap.add_argument("--json", action="store_true", help="print the result as JSON, not the phase tables")
    return ap.parse_args()


def job_sets(args: argparse.Namespace, work: Path) -> tuple[Path, list[str]]:
    """The config and its overrides: only what a measurement needs (paths, one bucket, no checkpoint
    before the kill, no restart limit in the way)."""
    every = args.checkpoint_every or 1_000_000
    common = [
        "train.total_steps=1000000",
        f"train.checkpoint_every={every}",
        "run.status_interval_s=2",
        f"run.runs_root={work / 'runs'}",
        "pipeline.max_restarts=3",
    ]
    if args.tiny:
        return CONFIG_TINY, [*common, *args.sets]
    from pipeline import QWEN3_8B, make_target, write_data  # bench/pipeline.py: one random target for both

    target, _ = make_target(
        work / "target-qwen3-8b", {"version": 1, "sizes": QWEN3_8B, "dtype": "bfloat16", "seed": 0}, "cuda"
    )
    data = write_data(work / "restart-data.jsonl", 256, 4096, target)
    sets = [
        f"target.path={target}",
        f"data.path={data}",
        f"data.cache_dir={work / 'tokcache'}",
        "data.max_seq_len=4096",
        "data.bucket_multiple=4096",
        *common,
    ]
    return CONFIG_8B, [*sets, *args.sets]


def set_args(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def warm(config: Path, sets: list[str], cache: Path, log: Path) -> float:
    """The job's warm run into `cache` (reused when it warmed this config and these sets before)."""
    stamp = cache / "restart-bench.json"
    want = {"config": str(config), "sets": sets}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return 0.0
    shutil.rmtree(cache, ignore_errors=True)
    t0 = time.time()
    with open(log, "w") as f:
        subprocess.run(
            [sys.executable, "-m", "dflash.warm", str(config), "--out", str(cache), *set_args(sets)],
            cwd=REPO, stdout=f, stderr=subprocess.STDOUT, check=True,
        )  # fmt: skip
    stamp.write_text(json.dumps(want))
    return time.time() - t0


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    from dflash.rundir import read_jsonl

    path = run_dir / "events.jsonl"
    return list(read_jsonl(path)) if path.is_file() else []


def heartbeat(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "workers" / "drafter-0.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for(pred: Any, deadline: float, proc: subprocess.Popen[bytes], what: str) -> Any:
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        if proc.poll() is not None:
            raise RuntimeError(f"the job exited (code {proc.returncode}) before {what}")
        time.sleep(0.05)
    raise TimeoutError(f"no {what} within the time given (--timeout)")


def stop_job(proc: subprocess.Popen[bytes]) -> None:
    """Two SIGTERMs: the second makes the supervisor kill its workers at once (no final checkpoint)."""
    for _ in range(2):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            time.sleep(1)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def measure(
    config: Path, sets: list[str], cache: Path, work: Path, args: argparse.Namespace
) -> dict[str, Any]:
    run_dir = work / "restart-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [sys.executable, "-m", "dflash.launch", str(config), *set_args(sets), "--run-dir", str(run_dir)]
    env = {**os.environ, "DFLASH_CACHE_DIR": str(cache), "DFLASH_EXPECT_WARM_CACHE": "1"}
    deadline = time.time() + args.timeout
    with open(work / "restart-launch.log", "w") as log:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            hb = wait_for(
                lambda: (b := heartbeat(run_dir)).get("step", 0) >= args.kill_at_step and b, deadline, proc,
                f"step {args.kill_at_step}",
            )  # fmt: skip
            plan = next((e for e in read_events(run_dir) if e.get("event") == "spare_plan"), {})
            if plan.get("mode", "off") != "off":  # the kill comes once the spare is ready to take over
                wait_for(
                    lambda: any(e.get("event") == "spare_ready" for e in read_events(run_dir)), deadline, proc,
                    "the spare drafter's spare_ready",
                )  # fmt: skip
                hb = heartbeat(run_dir)
            killed_at = time.time()
            os.kill(hb["pid"], signal.SIGKILL)

            def restarted() -> dict[str, Any] | None:
                return next(
                    (e for e in read_events(run_dir) if e.get("event") == "generation_start"
                     and e.get("role") == "drafter-group" and e.get("generation") == 1),
                    None,
                )  # fmt: skip

            restart = wait_for(restarted, deadline, proc, "the new generation's first step")
        finally:
            stop_job(proc)
    events = read_events(run_dir)
    first = next(e for e in events if e.get("event") == "generation_start" and e.get("generation") == 0
                 and e.get("role") == "drafter-group")  # fmt: skip
    misses = [e for e in events if e.get("event") == "cache_miss"]
    spare = {
        k: [e for e in events if e.get("event") == k] for k in ("spare_plan", "spare_ready", "spare_takeover")
    }
    shutil.rmtree(run_dir, ignore_errors=True)  # a killed 8B drafter's partial state is GBs
    return {
        "command": " ".join(argv),
        "spare_plan": spare["spare_plan"][0] if spare["spare_plan"] else None,
        "spare_ready": spare["spare_ready"],
        "spare_takeover": spare["spare_takeover"],
        "killed_at_step": hb.get("step"),
        "gap_s": round(restart["t"] - killed_at, 3),
        "restart": restart,
        "first_start": first,
        "cache_misses": misses,
    }


def table(ev: dict[str, Any], title: str) -> list[str]:
    total = ev.get("total_s") or 0.0
    lines = [title, f"  {'phase':<18}{'from s':>9}{'seconds':>10}{'share':>8}"]
    for p in ev["phases"]:
        share = f"{100 * p['seconds'] / total:.0f}%" if total else "-"
        lines.append(f"  {p['phase']:<18}{p['start'] - ev['origin_at']:>9.2f}{p['seconds']:>10.2f}{share:>8}")
    lines.append(f"  {'total':<18}{'':>9}{total:>10.2f}")
    if ev.get("graphs"):
        lines.append(
            "  first step per shape: " + ", ".join(f"{k} {v:.2f} s" for k, v in ev["graphs"].items())
        )
    return lines


def main() -> None:
    args = parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    config, sets = job_sets(args, work)
    cache = work / ("restart-cache-tiny" if args.tiny else "restart-cache-8b")
    warm_s = warm(config, sets, cache, work / "restart-warm.log")
    import torch

    report = {
        **report_header("restart", torch.cuda.is_available() and not args.tiny),
        "config": str(config.relative_to(REPO)),
        "sets": sets,
        "warm_s": round(warm_s, 1),
        "runs": {},
    }
    for mode in [m.strip() for m in args.spares.split(",") if m.strip()]:
        res = measure(config, [*sets, f"pipeline.spare_drafters={mode}"], cache, work, args)
        report["runs"][mode] = res
        write_report(args.out, report)  # each measured run kept, should a later one fail
        if not args.json:
            print_run(mode, res)
    if args.json:
        print(json.dumps(report, indent=2))
    print(f"-> {args.out}")


def print_run(mode: str, res: dict[str, Any]) -> None:
    r = res["restart"]
    rolled = r.get("rolled_back_steps")
    plan = res.get("spare_plan") or {}
    ready = res.get("spare_ready") or []
    print(f"== pipeline.spare_drafters={mode}: spares {plan.get('mode', 'off')} ({plan.get('why', '')})")
    if ready:
        print(f"   spare ready {ready[0].get('seconds')} s after its start ({ready[0].get('mode')})")
    print(
        f"SIGKILL of drafter-0 at step {res['killed_at_step']} -> first trained step of generation 1: "
        f"{res['gap_s']:.1f} s measured here, {r['total_s']:.1f} s by the job's phases (from the last "
        f"heartbeat); {rolled} step(s) rolled back (died at step {r.get('died_at_step')}, resumed from "
        f"{r.get('resumed_from_kind') or 'step 0'}{'' if r.get('resumed_from') is None else ' ' + str(r['resumed_from'])}); "
        f"taken over by a spare: {r.get('spare') or 'no'}"
    )
    print("\n".join(table(r, "restart (generation 1), from the death:")))
    print("\n".join(table(res["first_start"], "first start (generation 0), from the launch:")))
    if res["cache_misses"]:
        print(f"warning: {len(res['cache_misses'])} cache_miss event(s): the cache was not warm")


if __name__ == "__main__":
    main()
