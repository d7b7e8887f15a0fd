"""Tune flex attention's kernel options for the DFlash mask: each candidate's forward and backward
timed through the job's own FlexBackend.attend, per layer kind, and the best pair reported.

H200, the drafter step's shape (2 x 4096 context, 512 anchors x 16, 32/8 heads, head dim 128, bf16):
    python bench/flex_tune.py --work /tmp/flex-tune --out $OUT/flex_tune.json
CPU smoke run (forward only, tiny; checks the mechanics, not the numbers):
    python bench/flex_tune.py --tiny --work /tmp/flex-tune-tiny --out /tmp/flex_tune.json

A candidate sets the forward kernel's tile (BLOCK_M x BLOCK_N), pipeline stages and warps (fwd_*) and
the backward kernels' tiles (BLOCK_M1/N1 for dK/dV, M2/N2 for dQ), stages and warps (bwd_*). Cold
flex compiles take seconds each, so every candidate is first compiled in a process of its own, in
parallel (--jobs), into one inductor cache under --work; then this process times them one after the
other from that cache (nothing else on the GPU). The best forward and the best backward options
per layer kind are then compiled together and timed again: that pair is what goes into
dflash.step.attention.flex.TUNED_KERNEL_OPTIONS. Effective TFLOP/s counts unmasked pairs only (as
bench/attention.py: 4*D per pair forward, 3.5x that for forward + backward).

USE_TMA candidates are timed but do not win unless --allow-tma. A TMA kernel takes tensor
descriptors (Triton's global scratch or nvTmaDesc arguments), which inductor's static CUDA launcher
refuses (torch/_inductor/runtime/static_triton_launcher.py), so with compile workers every such kernel
is loaded a second time, through Triton, in the parent process: on a restored cache that is the
whole cost of the kernel. The H200's restored 8B warm waited 17.1 s for kernels with the TMA forward,
0.7 s in the run before without it (docs/BENCHMARKS.md; the A/B of TMA alone is not run yet). The TMA
forward was 4-6% faster per call: 0.3 ms of the 277 ms 8B step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import bench_ms, default_out, report_header, write_report  # noqa: E402  (bench/, the script's own directory)

FWD = [  # (BLOCK_M, BLOCK_N, num_stages, num_warps, USE_TMA)
    (128, 64, 3, 8, False),  # inductor's sm90 default for bf16, head dim 128
    (128, 128, 2, 8, False),
    (128, 64, 2, 8, False),
    (64, 128, 3, 4, False),
    (128, 64, 3, 4, False),
    (64, 64, 3, 4, False),
    (128, 64, 4, 8, False),
    (128, 64, 3, 8, True),
    (128, 128, 2, 8, True),
    (128, 32, 3, 4, False),
]
BWD = [  # (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_stages, num_warps, USE_TMA)
    (64, 128, 128, 64, 3, 8, False),  # inductor's sm90 default for head dim 128
    (64, 64, 64, 64, 3, 4, False),
    (32, 128, 128, 32, 3, 4, False),
    (64, 128, 128, 64, 2, 8, False),
    (64, 128, 128, 64, 3, 4, False),
    (64, 64, 64, 64, 2, 8, False),
    (32, 64, 64, 32, 3, 4, False),
    (64, 128, 128, 64, 4, 8, False),
    (64, 128, 128, 64, 3, 8, True),
    (32, 128, 128, 32, 2, 4, False),
]


def fwd_options(c: tuple) -> dict[str, Any]:
    m, n, s, w, tma = c
    return {"fwd_BLOCK_M": m, "fwd_BLOCK_N": n, "fwd_num_stages": s, "fwd_num_warps": w, "fwd_USE_TMA": tma}


def bwd_options(c: tuple) -> dict[str, Any]:
    m1, n1, m2, n2, s, w, tma = c
    return {
        "bwd_BLOCK_M1": m1,
        "bwd_BLOCK_N1": n1,
        "bwd_BLOCK_M2": m2,
        "bwd_BLOCK_N2": n2,
        "bwd_num_stages": s,
        "bwd_num_warps": w,
        "bwd_USE_TMA": tma,
    }


SECOND_ROUND = [  # around the first round's winners on the H200 (2026-12-01): fwd 64x64, bwd 64x128/128x64
    ((64, 64, 2, 4, False), (64, 128, 128, 64, 1, 8, False), {}),
    ((64, 64, 4, 4, False), (32, 64, 64, 32, 2, 4, False), {}),
    ((64, 64, 3, 8, False), (32, 64, 64, 32, 4, 4, False), {}),
    ((64, 128, 2, 4, False), (32, 128, 128, 32, 2, 8, False), {}),
    ((64, 64, 3, 4, True), (64, 128, 128, 64, 2, 8, True), {}),
    ((64, 32, 3, 4, False), (64, 128, 128, 64, 2, 4, False), {}),
    # every row of the DFlash mask sees at least its own block, so no row is fully masked
    ((64, 64, 3, 4, False), (64, 128, 128, 64, 2, 8, False), {"ROWS_GUARANTEED_SAFE": True}),
]


FWD_WINNER = (64, 64, 3, 4, False)
"""The forward tile that won the first two rounds on the H200 (FWD[5])."""
THIRD_ROUND = [  # the backward (80% of the step's attention time) around the winner 64x128 / 128x64, 2 stages
    (FWD_WINNER, bwd, {})
    for bwd in (
        (64, 128, 64, 64, 2, 8, False),
        (128, 128, 128, 64, 2, 8, False),
        (64, 64, 128, 64, 2, 8, False),
        (128, 64, 64, 128, 2, 8, False),
        (64, 128, 128, 128, 2, 8, False),
        (32, 128, 64, 64, 2, 4, False),
        (64, 128, 128, 32, 2, 8, False),
        (64, 128, 64, 128, 2, 8, False),
    )
]


def candidates() -> list[dict[str, Any] | None]:
    """None = inductor's defaults (no options); then FWD[i] paired with BWD[i]; then SECOND_ROUND and
    THIRD_ROUND (indices 18-25)."""
    pairs = [{**fwd_options(f), **bwd_options(b)} for f, b in zip(FWD, BWD, strict=True)]
    rounds = SECOND_ROUND + THIRD_ROUND
    return [None, *pairs, *({**fwd_options(f), **bwd_options(b), **x} for f, b, x in rounds)]


def write_table(path: Path, best: dict[str, Any], args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The winners as dflash.step.attention.flex's table (entries of other GPUs and head dims kept)."""
    from dflash.rundir import atomic_write_json
    from dflash.step.attention.flex import layer_kind

    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        table = {"entries": []}
    cap = report["capability"]
    for w in windows(args):
        entry = best.get(str("full" if w is None else w))
        if not entry or "combined_fwd_bwd_tflops" not in entry:
            continue
        if entry.get("default_fwd_bwd_tflops", 0) >= entry["combined_fwd_bwd_tflops"]:
            continue  # the defaults are as fast: no entry
        kind = layer_kind(w)
        table["entries"] = [
            e
            for e in table["entries"]
            if (e["capability"], e["head_dim"], e["kind"]) != (cap, args.head_dim, kind)
        ]
        table["entries"].append(
            {
                "capability": cap,
                "head_dim": args.head_dim,
                "kind": kind,
                "options": entry["options"],
                "measured": {
                    "device": report["device"],
                    "torch": report["torch"],
                    "date": report["date"],
                    "command": report["command"],
                    "fwd_bwd_tflops": round(entry["combined_fwd_bwd_tflops"], 1),
                    "default_fwd_bwd_tflops": round(entry.get("default_fwd_bwd_tflops", 0), 1),
                },
            }
        )
    table["about"] = (
        "flex kernel options for the DFlash mask, bf16; written by bench/flex_tune.py --write-table"
    )
    atomic_write_json(path, table)


LAYOUTS = ("heads", "step")
"""How make_inputs lays q, k and dO out in memory (always viewed as [B, heads, T, D]): heads: contiguous
[B, heads, T, D]; step: [B, T, heads, D], the drafter layer's projection rows, as the job hands them
to the attention op. v is contiguous [B, kv_heads, T, D] in both, as the layer makes it."""


def make_inputs(args: argparse.Namespace, layout: str = "heads") -> dict[str, Any]:
    """Random q, k, v, dO and the trainer's anchors at the bench's sizes; q, k and dO in `layout`."""
    import torch

    from dflash.step.objective import sample_anchors

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    B, S, A, K = args.batch, args.context, args.anchors, args.block
    mask = torch.ones(B, S, dtype=torch.bool)
    seq_lens = torch.full((B,), S)
    anchors = sample_anchors(mask, seq_lens, A, gen)  # as the trainer samples them: a full-length batch
    q = torch.randn(B, args.heads, A * K, args.head_dim, generator=gen).to(device, dtype)
    k = torch.randn(B, args.kv_heads, S + A * K, args.head_dim, generator=gen).to(device, dtype)
    v = torch.randn(B, args.kv_heads, S + A * K, args.head_dim, generator=gen).to(device, dtype)
    grad = torch.randn(q.shape, generator=gen).to(device, dtype)
    if layout == "step":  # the same values, stored [B, T, heads, D]
        q, k, grad = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, grad))
    return {
        "q": q,
        "k": k,
        "v": v,
        "grad": grad,
        "anchors": anchors.to(device),
        "seq_lens": seq_lens.to(device),
    }


def measure(
    args: argparse.Namespace,
    inputs: dict[str, Any],
    opts: dict[str, Any] | None,
    window: int | None,
    time_it: bool,
) -> dict[str, Any]:
    """Compile (first call) and, with time_it, time forward and forward + backward of one candidate."""
    import torch

    from dflash.step.attention.flex import FlexBackend, layer_kind

    kind = layer_kind(window)
    backend = FlexBackend(kernel_options={kind: opts or {}})
    plan = backend.prepare(
        inputs["anchors"],
        inputs["seq_lens"],
        context_len=args.context,
        block_size=args.block,
        windows=[window],
    )[window]
    q, k, v, grad = inputs["q"], inputs["k"], inputs["v"], inputs["grad"]
    device = q.device.type
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def fwd() -> Any:
        with torch.no_grad():
            return backend.attend(q, k, v, plan)

    def fwd_bwd() -> None:
        qq.grad = kk.grad = vv.grad = None
        backend.attend(qq, kk, vv, plan).backward(grad)

    t0 = time.perf_counter()
    out = fwd()
    can_bwd = device == "cuda"
    if can_bwd:
        fwd_bwd()
    res: dict[str, Any] = {"first_call_s": round(time.perf_counter() - t0, 2)}
    if time_it:
        res["fwd_ms"] = bench_ms(fwd, device, args.reps)
        if can_bwd:
            res["fwd_bwd_ms"] = bench_ms(fwd_bwd, device, args.reps)
            res["bwd_ms"] = res["fwd_bwd_ms"] - res["fwd_ms"]
            fwd_bwd()
            res["grads"] = (out.detach(), qq.grad.detach(), kk.grad.detach(), vv.grad.detach())
        else:
            res["grads"] = (out.detach(),)
    return res


def windows(args: argparse.Namespace) -> list[int | None]:
    return [None if w == "full" else int(w) for w in args.windows.split(",")]


def compile_only(args: argparse.Namespace, index: int) -> None:
    """Child process: compile candidate `index` for every layer kind into the shared cache."""
    inputs = make_inputs(args)
    status = {}
    for w in windows(args):
        try:
            measure(args, inputs, candidates()[index], w, time_it=False)
            status[str(w)] = "ok"
        except Exception as e:  # a tile that does not fit (shared memory) fails here; report it
            status[str(w)] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    print(json.dumps({"candidate": index, "status": status}), flush=True)


def rel_err(a: Any, b: Any) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="scratch: the shared inductor cache of the candidates")
    ap.add_argument("--out", default=default_out("flex_tune"))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--windows", default="full,2048")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=8, help="candidates compiled at once")
    ap.add_argument("--only", default="", help="comma list of candidate indices (0 = inductor's defaults)")
    ap.add_argument(
        "--write-table",
        default="",
        help="merge the winners into this table file (dflash/step/attention/flex_tuned.json is the job's)",
    )
    ap.add_argument(
        "--allow-tma",
        action="store_true",
        help="let USE_TMA candidates win (off: their kernels need Triton's global scratch, which "
        "inductor's static launcher cannot launch, so a restored cache reloads each one in the "
        "parent process: ~2.4 s per length bucket of the 8B plan on the H200)",
    )
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--compile-only", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tiny:
        args.batch, args.context, args.anchors, args.block = 1, 64, 6, 4
        args.heads, args.kv_heads, args.head_dim, args.windows, args.reps = 4, 2, 16, "full,13", 2
    cache = Path(args.work).resolve() / "inductor"
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    import torch

    torch._dynamo.config.recompile_limit = 1024  # one graph per candidate and layer kind, by design
    torch._dynamo.config.accumulated_recompile_limit = 4096
    if args.compile_only is not None:
        compile_only(args, args.compile_only)
        return
    if args.tiny:  # CPU: the options are GPU tile sizes; run the defaults and one candidate for the mechanics
        args.only = args.only or "0,1"
    cands = candidates()
    picked = [int(i) for i in args.only.split(",")] if args.only else list(range(len(cands)))

    t0 = time.perf_counter()
    status: dict[int, dict[str, str]] = {}
    running: list[tuple[int, subprocess.Popen]] = []
    queue = list(picked)
    argv = [sys.executable, __file__, *sys.argv[1:]]
    while queue or running:
        while queue and len(running) < args.jobs:
            i = queue.pop(0)
            running.append(
                (i, subprocess.Popen([*argv, "--compile-only", str(i)], stdout=subprocess.PIPE, text=True))
            )
        i, proc = running.pop(0)
        out, _ = proc.communicate()
        line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("{")), None)
        status[i] = (
            json.loads(line)["status"] if line else {"all": f"compile process exited {proc.returncode}"}
        )
    compile_s = time.perf_counter() - t0
    print(f"compiled {len(picked)} candidates in {compile_s:.0f} s", flush=True)

    inputs = make_inputs(args)
    flops_fwd = {}
    from dflash.step.attention.mask import allowed_pairs

    for w in windows(args):
        pairs = allowed_pairs(
            inputs["anchors"].cpu(),
            inputs["seq_lens"].cpu(),
            context_len=args.context,
            block_size=args.block,
            window=w,
        )
        flops_fwd[w] = 4 * args.head_dim * args.heads * pairs
    results: list[dict[str, Any]] = []
    reference: dict[int | None, tuple] = {}
    for i in picked:
        opts = cands[i]
        for w in windows(args):
            row: dict[str, Any] = {"candidate": i, "window": "full" if w is None else w, "options": opts}
            if status.get(i, {}).get(str(w), "ok") != "ok" or "all" in status.get(i, {}):
                row["error"] = status[i].get(str(w)) or status[i].get("all")
                results.append(row)
                print(f"candidate {i} {row['window']}: {row['error']}", flush=True)
                continue
            try:
                m = measure(args, inputs, opts, w, time_it=True)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                results.append(row)
                continue
            grads = m.pop("grads")
            reference.setdefault(w, grads)
            row.update(m)
            row["rel_err_vs_first"] = max(rel_err(a, b) for a, b in zip(grads, reference[w], strict=True))
            row["fwd_tflops"] = flops_fwd[w] / m["fwd_ms"] / 1e9
            if "fwd_bwd_ms" in m:
                row["fwd_bwd_tflops"] = 3.5 * flops_fwd[w] / m["fwd_bwd_ms"] / 1e9
            results.append(row)
            print(
                f"candidate {i} {row['window']}: fwd {m['fwd_ms']:.3f} ms ({row['fwd_tflops']:.0f} TFLOP/s)"
                + (
                    f", fwd+bwd {m['fwd_bwd_ms']:.3f} ms ({row['fwd_bwd_tflops']:.0f} TFLOP/s)"
                    if "fwd_bwd_ms" in m
                    else ""
                )
                + f", first call {m['first_call_s']} s",
                flush=True,
            )
    best: dict[str, Any] = {}
    for w in windows(args):
        name = "full" if w is None else w
        ok = [r for r in results if r["window"] == name and "fwd_ms" in r]
        if not ok:
            continue
        fwd_ok = [r for r in ok if args.allow_tma or not (r["options"] or {}).get("fwd_USE_TMA")]
        f = min(fwd_ok, key=lambda r: r["fwd_ms"])
        entry: dict[str, Any] = {"fwd_from": f["candidate"], "fwd_ms": f["fwd_ms"]}
        opts: dict[str, Any] = {k: v for k, v in (f["options"] or {}).items() if k.startswith("fwd_")}
        with_bwd = [
            r for r in ok if "bwd_ms" in r and (args.allow_tma or not (r["options"] or {}).get("bwd_USE_TMA"))
        ]
        if with_bwd:
            b = min(with_bwd, key=lambda r: r["bwd_ms"])
            entry.update(bwd_from=b["candidate"], bwd_ms=b["bwd_ms"])
            opts.update({k: v for k, v in (b["options"] or {}).items() if k.startswith("bwd_")})
            # The pair compiled together: what the table will hold (a default half stays default).
            m = measure(args, inputs, opts or None, w, time_it=True)
            m.pop("grads")
            entry.update(
                combined_fwd_ms=m["fwd_ms"],
                combined_fwd_bwd_ms=m["fwd_bwd_ms"],
                combined_fwd_bwd_tflops=3.5 * flops_fwd[w] / m["fwd_bwd_ms"] / 1e9,
            )
            default = next((r for r in ok if r["candidate"] == 0 and "fwd_bwd_ms" in r), None)
            if default:
                entry["default_fwd_bwd_tflops"] = default["fwd_bwd_tflops"]
        entry["options"] = opts
        best[str(name)] = entry
    report = {
        **report_header("flex_tune", torch.cuda.is_available() and not args.tiny),
        "capability": list(torch.cuda.get_device_capability())
        if torch.cuda.is_available() and not args.tiny
        else None,
        "config": vars(args),
        "compile_s": compile_s,
        "results": results,
        "best": best,
    }
    write_report(args.out, report)
    if args.write_table and report["capability"]:
        write_table(Path(args.write_table), best, args, report)
        print(f"table: {args.write_table}")
    print(json.dumps(best, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
