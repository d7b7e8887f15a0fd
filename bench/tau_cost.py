"""What the in-job tau costs training: the real job (`python -m dflash.launch`) with train.tau_eval
on, every checkpoint measured (train.tau_budget=1) and a checkpoint every --checkpoint-every steps,
run until --measurements `tau` events are written and --after seconds more; then the drafter's
steps/s while an eval ran, against its steps/s outside the evals and the checkpoint writes, from the
job's own metrics records and events.

The cost to training of the shipped setting follows from three measured figures:
  share   = min(train.tau_budget, eval seconds / seconds between the shipped checkpoints)
  cost    = slowdown while an eval runs x share
(the pacing keeps the evals to tau_budget of the wall time; between them training runs as without).

H200 (configs/qwen3-8b.toml as shipped, co-located on cuda:0; the random 8B-size target of
bench/pipeline.py, one 4096 bucket; the eval on the same GPU, beside both workers; the cache warmed
first, as bench/restart.py does):
    python bench/tau_cost.py --work /tmp/dflash-bench --out $OUT/tau_cost.json
CPU (configs/demo-cpu.toml, its tiny target and held-out demo prompts; about 2 minutes on 2 cores):
    .venv/bin/python bench/tau_cost.py --tiny --work /tmp/dflash-bench-tiny --out /tmp/tau_cost.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import report_header, write_report  # noqa: E402  (bench/)
from restart import job_parser, job_sets, read_events, set_args, stop_job, wait_for, warm  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = job_parser(__doc__, "tau_cost")
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="train.checkpoint_every (0: 40 on the CPU, 30 on a GPU)",
    )
    ap.add_argument("--measurements", type=int, default=2, help="tau events to wait for")
    ap.add_argument("--after", type=float, default=10.0, help="seconds of training kept after the last one")
    return ap.parse_args()


def intervals(records: list[dict[str, Any]]) -> list[tuple[float, float, int]]:
    """(start, end, steps) between consecutive metrics records, past the first two (compile, warm-up)."""
    rows = [r for r in records if isinstance(r.get("t"), int | float) and isinstance(r.get("step"), int)]
    return [
        (a["t"], b["t"], b["step"] - a["step"])
        for a, b in zip(rows[2:], rows[3:], strict=False)
        if b["t"] > a["t"]
    ]


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def split_rates(
    spans: list[tuple[float, float, int]], evals: list[tuple[float, float]], writes: list[tuple[float, float]]
) -> dict[str, Any]:
    """Steps/s over the intervals inside an eval (at least 80% of the interval) and over those that
    touch neither an eval nor a checkpoint write; intervals in between are left out."""
    inside = [0.0, 0]
    outside = [0.0, 0]
    for t0, t1, steps in spans:
        dt = t1 - t0
        in_eval = sum(overlap((t0, t1), w) for w in evals)
        in_write = sum(overlap((t0, t1), w) for w in writes)
        if in_eval >= 0.8 * dt and in_write == 0:
            inside[0] += dt
            inside[1] += steps
        elif in_eval == 0 and in_write == 0:
            outside[0] += dt
            outside[1] += steps
    during = inside[1] / inside[0] if inside[0] else None
    steady = outside[1] / outside[0] if outside[0] else None
    return {
        "steps_per_s_outside": None if steady is None else round(steady, 4),
        "steps_per_s_during_eval": None if during is None else round(during, 4),
        "seconds_outside": round(outside[0], 1),
        "seconds_during_eval": round(inside[0], 1),
        "slowdown": None if not (steady and during is not None) else round(1 - during / steady, 4),
    }


def shipped_cost(config: Path, rates: dict[str, Any], eval_s: float) -> dict[str, Any]:
    """The cost at the config's own checkpoint interval and tau budget, from the measured figures."""
    from dflash.config import load_config

    cfg = load_config(config, [])
    steady, slowdown = rates["steps_per_s_outside"], rates["slowdown"]
    if not steady or slowdown is None:
        return {"cost": None}
    between = cfg.train.checkpoint_every / steady
    share = min(cfg.train.tau_budget, eval_s / between)
    return {
        "checkpoint_every": cfg.train.checkpoint_every,
        "tau_budget": cfg.train.tau_budget,
        "seconds_between_checkpoints": round(between, 1),
        "eval_share": round(share, 5),
        "cost": round(max(0.0, slowdown) * share, 5),
    }


def main() -> None:
    args = parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    import torch

    every = args.checkpoint_every or (40 if args.tiny else 30)
    config, sets = job_sets(args, work)
    sets = [s for s in sets if not s.startswith("train.checkpoint_every=")]
    sets += [f"train.checkpoint_every={every}", "run.status_interval_s=1", "pipeline.spare_drafters=off"]
    if not args.tiny:
        from pipeline import write_data

        prompts = write_data(work / "tau-prompts.jsonl", 16, 512, work / "target-qwen3-8b")
        sets += [f"train.tau_prompts={prompts}"]
    cache = work / ("restart-cache-tiny" if args.tiny else "restart-cache-8b")
    warm_s = warm(config, sets, cache, work / "tau-warm.log")
    run_dir = work / "tau-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    tau_sets = [*sets, "train.tau_eval=true", "train.tau_budget=1"]
    argv = [
        sys.executable,
        "-m",
        "dflash.launch",
        str(config),
        *set_args(tau_sets),
        "--run-dir",
        str(run_dir),
    ]
    env = {**os.environ, "DFLASH_CACHE_DIR": str(cache)}
    with open(work / "tau-launch.log", "w") as log:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.time() + args.timeout
            wait_for(
                lambda: len([e for e in read_events(run_dir) if e.get("event") in ("tau", "tau_failed", "tau_skipped")])
                >= args.measurements, deadline, proc, f"{args.measurements} tau measurements",
            )  # fmt: skip
            time.sleep(args.after)
        finally:
            stop_job(proc)
    events = read_events(run_dir)
    from dflash.rundir import read_jsonl

    records = list(read_jsonl(run_dir / "metrics.jsonl"))
    taus = [e for e in events if e.get("event") == "tau"]
    failed = [e for e in events if e.get("event") in ("tau_failed", "tau_skipped")]
    evals = [(e["t"] - e["seconds"], e["t"]) for e in taus]
    writes = [
        (e["t"] - e.get("seconds", 0) - 1.0, e["t"] + 1.0) for e in events if e.get("event") == "checkpoint"
    ]
    rates = split_rates(intervals(records), evals, writes)
    eval_s = sum(e["seconds"] for e in taus) / len(taus) if taus else 0.0
    report = {
        **report_header("tau_cost", torch.cuda.is_available() and not args.tiny),
        "config": str(config.relative_to(REPO)),
        "sets": tau_sets,
        "warm_s": round(warm_s, 1),
        "taus": [
            {k: e.get(k) for k in ("step", "tau", "seconds", "device", "prompts", "tokens")} for e in taus
        ],
        "not_measured": failed,
        "eval_s": round(eval_s, 2),
        **rates,
        "shipped": shipped_cost(config, rates, eval_s) if taus else {"cost": None},
    }
    write_report(args.out, report)
    if (run_dir / "logs" / "tau-eval.log").is_file():  # kept beside the launch log: the run dir goes
        shutil.copy(run_dir / "logs" / "tau-eval.log", work / "tau-eval.log")
    shutil.rmtree(run_dir, ignore_errors=True)  # 8B checkpoints are GBs each
    s = report["shipped"]
    print(
        f"{len(taus)} tau measurement(s) of {eval_s:.1f} s each on {taus[0]['device'] if taus else '-'}; "
        f"training {rates['steps_per_s_outside']} steps/s outside them, {rates['steps_per_s_during_eval']} "
        f"during (slowdown {rates['slowdown']})"
    )
    if s.get("cost") is not None:
        print(
            f"at the config's checkpoint_every {s['checkpoint_every']} ({s['seconds_between_checkpoints']} s) "
            f"and tau_budget {s['tau_budget']}: evals take {100 * s['eval_share']:.2f}% of the wall time, "
            f"training loses {100 * s['cost']:.2f}%"
        )
    for e in failed:
        print(f"not measured: {e.get('event')}: {e.get('reason') or e.get('error')}")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
