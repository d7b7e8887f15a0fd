"""The DFlash attention's kernels: flex's own against dflash.step.attention.triton_attention's, on the
drafter step's shape, through the job's FlexBackend, then dflash's forward and backward alone for
each tile candidate.

H200 (2 x 4096 context, 512 anchors x 16, 32/8 heads, head dim 128, bf16; full and sliding 2048):
    python bench/attention_backward.py --out $OUT/attention_backward.json
CPU smoke run (tiny, through Triton's interpreter; checks the mechanics, not the numbers):
    TRITON_INTERPRET=1 python bench/attention_backward.py --tiny --out /tmp/attention_backward.json

Per layer kind: forward, forward + backward (the backward = the difference) with flex's kernels and
with dflash's (kernels="dflash": the job's path, one op), then dflash's forward alone for each
forward tile candidate and its backward alone for each backward candidate (its dQ programs
of their own), the first of each in every launch order (ORDERS: longest first, grid, grouped; the others
in their own ORDER field, longest first unless given). Effective TFLOP/s count unmasked pairs only: 4*D per pair and head
forward, 2.5x that backward (bench/attention.py's convention). Numerics: dflash's out, dq, dk, dv
against flex's (relative error of each).

--flash: flex's op with kernel_options BACKEND=FLASH (FlashAttention-4's CuTe DSL kernels, Hopper's
FlashAttention-3 port, with the plan's BlockMask and mask_mod) timed and checked beside the two. Its
packages (flash-attn-4, nvidia-cutlass-dsl and its libs) are not in the job's environments: a
comparison, measured on the H200 on 2026-12-04 (docs/benchmarks-history.md), not a path of the job.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import bench_ms, default_out, report_header, write_report  # noqa: E402  (bench/, the script's own directory)
from flex_tune import LAYOUTS, make_inputs, rel_err  # noqa: E402  (the same inputs as flex_tune's)

# (BLOCK_M, BLOCK_N, num_warps, num_stages); the first is flex's tuned forward.
FWD_CANDIDATES = [
    (64, 64, 4, 3),
    (64, 64, 4, 2),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (64, 128, 4, 2),
    (128, 32, 4, 3),
]

# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages[, ORDER]); the first is flex's
# tuned backward.
CANDIDATES = [
    (64, 128, 128, 64, 8, 2),
    (64, 128, 128, 64, 8, 3),
    (64, 128, 128, 64, 4, 2),
    (32, 128, 128, 32, 4, 2),
    (64, 128, 64, 64, 8, 2),
    (64, 64, 64, 64, 4, 2),
    (32, 64, 64, 32, 4, 3),
    (128, 128, 128, 128, 8, 1),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=default_out("attention_backward"))
    ap.add_argument("--windows", default="full,2048")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--candidates", default="", help="comma list of CANDIDATES indices (default: all)")
    ap.add_argument(
        "--tiles",
        default="",
        help="candidates instead of CANDIDATES: 'M1,N1,M2,N2,warps,stages[,order[,tma]];...' (the first is "
        "also timed in every order; a 7th field is its ORDER, an index into ORDERS; an 8th its TMA: 1 copies "
        "the tiles the loops step over by TMA)",
    )
    ap.add_argument(
        "--fwd-tiles",
        default="",
        help="forward candidates instead of FWD_CANDIDATES: 'M,N,warps,stages[,order[,tma]];...'",
    )
    ap.add_argument(
        "--write-table",
        default="",
        help="merge each layer kind's fastest tiles (longest first) into this table as kernel_fwd_* and "
        "kernel_bwd_* options "
        "(dflash/step/attention/flex_tuned.json is the job's)",
    )
    ap.add_argument(
        "--layout",
        default="step",
        choices=LAYOUTS,
        help="q, k and dO in memory (flex_tune.LAYOUTS): step, the job's, or heads, this bench's "
        "layout until 2026-12-04",
    )
    ap.add_argument(
        "--flash",
        action="store_true",
        help="also time flex with kernel_options BACKEND=FLASH (FlashAttention-4's CuTe kernels; needs the "
        "flash-attn-4 and nvidia-cutlass-dsl packages, which the job's environments do not ship)",
    )
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.flash and args.tiny:
        ap.error("--flash needs a GPU: FlashAttention-4's kernels have no CPU path; drop --tiny or --flash")
    if args.flash and importlib.util.find_spec("flash_attn") is None:
        ap.error(
            "--flash needs the flash-attn-4 package (and nvidia-cutlass-dsl with its libs-base, libs-core "
            "and libs-cu12/cu13) importable: install them beside torch or put them on PYTHONPATH, as "
            "docs/benchmarks-history.md's 2026-12-04 12:57 section did"
        )

    import torch

    from dflash.step.attention.flex import FlexBackend, layer_kind
    from dflash.step.attention.mask import allowed_pairs
    from dflash.step.attention.triton_attention import (
        FwdTiles,
        Tiles,
        attention_backward,
        attention_forward,
    )

    tiny = args.tiny
    device = "cpu" if tiny else "cuda"
    B, S, A, K, H, G, D = (1, 200, 40, 4, 4, 2, 16) if tiny else (2, 4096, 512, 16, 32, 8, 128)
    windows = ["full", "13"] if tiny else args.windows.split(",")
    reps = 1 if tiny else args.reps
    cand = [CANDIDATES[int(i)] for i in args.candidates.split(",")] if args.candidates else CANDIDATES
    if args.tiles:
        cand = [tuple(int(x) for x in c.split(",")) for c in args.tiles.split(";")]
    fwd_cand = FWD_CANDIDATES
    if args.fwd_tiles:
        fwd_cand = [tuple(int(x) for x in c.split(",")) for c in args.fwd_tiles.split(";")]
    if tiny:
        cand = [(32, 64, 64, 32, 4, 1), (32, 64, 64, 32, 4, 1, 2), (32, 64, 64, 32, 4, 1, 0, 1)]
        fwd_cand = [(32, 64, 4, 1), (32, 64, 4, 1, 0, 1)]
    sizes = argparse.Namespace(
        tiny=tiny, batch=B, context=S, anchors=A, block=K, heads=H, kv_heads=G, head_dim=D
    )
    inputs = make_inputs(sizes, args.layout)
    anchors, seq_lens = inputs["anchors"], inputs["seq_lens"]
    q, k, v, grad = inputs["q"], inputs["k"], inputs["v"], inputs["grad"]
    report: dict[str, Any] = {
        **report_header("attention_backward", device == "cuda"),
        "layout": args.layout,
        "layers": [],
    }
    for wname in windows:
        window = None if wname == "full" else int(wname)
        pairs = allowed_pairs(anchors.cpu(), seq_lens.cpu(), context_len=S, block_size=K, window=window)
        fwd_flop = 4 * D * H * pairs
        row: dict[str, Any] = {"window": wname, "fwd_tflop": fwd_flop / 1e12}
        results = {}
        for bwd in ("flex", "dflash", *(("flash",) if args.flash else ())):
            if tiny and bwd == "flex":
                continue  # flex has no CPU backward
            if bwd == "flash":  # flex's own op, its FlashAttention-4 backend in place of its Triton kernels
                backend = FlexBackend(kernel_options={layer_kind(window): {"BACKEND": "FLASH"}})
            else:
                backend = FlexBackend(kernels=bwd, compile=not tiny)
            plan = backend.prepare(anchors, seq_lens, context_len=S, block_size=K, windows=[window])[window]
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))

            def fwd(backend: Any = backend, plan: Any = plan) -> Any:
                with torch.no_grad():
                    return backend.attend(q, k, v, plan)

            def fwd_bwd(
                backend: Any = backend, plan: Any = plan, qq: Any = qq, kk: Any = kk, vv: Any = vv
            ) -> None:
                qq.grad = kk.grad = vv.grad = None
                backend.attend(qq, kk, vv, plan).backward(grad)

            fwd()
            fwd_bwd()
            f_ms, fb_ms = bench_ms(fwd, device, reps), bench_ms(fwd_bwd, device, reps)
            fwd_bwd()
            with torch.no_grad():
                results[bwd] = (fwd(), qq.grad.clone(), kk.grad.clone(), vv.grad.clone())
            row[bwd] = {
                "fwd_ms": f_ms,
                "fwd_bwd_ms": fb_ms,
                "bwd_ms": fb_ms - f_ms,
                "fwd_bwd_tflops": 3.5 * fwd_flop / fb_ms / 1e9,
                "bwd_tflops": 2.5 * fwd_flop / (fb_ms - f_ms) / 1e9 if fb_ms > f_ms else None,
            }
            print(
                f"{wname} {bwd}: fwd {f_ms:.3f} ms, fwd+bwd {fb_ms:.3f} ms ({row[bwd]['fwd_bwd_tflops']:.0f} "
                f"TFLOP/s), bwd {fb_ms - f_ms:.3f} ms",
                flush=True,
            )
            if bwd == "dflash":
                t = plan.tables  # the plan dflash's candidates run on
        reference = results.get("flex", results["dflash"])  # each candidate's output or gradients against it
        for name, key in (("dflash", "kernel_vs_flex_rel_err"), ("flash", "flash_vs_flex_rel_err")):
            if "flex" in results and name in results:
                row[key] = {
                    n: rel_err(a, b)
                    for n, a, b in zip(("out", "dq", "dk", "dv"), results[name], results["flex"], strict=True)
                }
                print(f"{wname} {name} vs flex: {row[key]}", flush=True)
        # dflash's forward alone, each forward candidate; then its output and lse feed the backward's.
        row["fwd_candidates"] = time_candidates(
            fwd_cand,
            FwdTiles,
            lambda tiles, order, t=t: attention_forward(
                q, k, v, t, scale=D**-0.5, sparse=128, tiles=tiles, order=order
            ),
            name=f"{wname} forward",
            key="fwd",
            flop=fwd_flop,
            device=device,
            reps=reps,
            check=lambda got, reference=reference: {"out": rel_err(got[0], reference[0])},
        )
        with torch.no_grad():
            out, lse = attention_forward(q, k, v, t, scale=D**-0.5, sparse=128)
        row["candidates"] = time_candidates(
            cand,
            Tiles,
            lambda tiles, order, out=out, lse=lse, t=t: attention_backward(
                grad, q, k, v, out, lse, t, scale=D**-0.5, sparse=128, tiles=tiles, order=order
            ),
            name=f"{wname} backward",
            key="bwd",
            flop=2.5 * fwd_flop,
            device=device,
            reps=reps,
            check=lambda got, reference=reference: {
                n: rel_err(a, b) for n, a, b in zip(("dq", "dk", "dv"), got, reference[1:], strict=True)
            },
        )
        report["layers"].append(row)
    report["interpreted"] = os.environ.get("TRITON_INTERPRET") == "1"
    if args.write_table:
        report["capability"] = list(torch.cuda.get_device_capability()) if device == "cuda" else [0, 0]
        write_table(Path(args.write_table), report, D)
    write_report(args.out, report)


def time_candidates(
    candidates: list[tuple[int, ...]],
    tile_type: Any,
    run: Any,
    *,
    name: str,
    key: str,
    flop: float,
    device: str,
    reps: int,
    check: Any = None,
) -> list[dict[str, Any]]:
    """run(tiles, order) timed for each candidate tile tuple: the first in every launch order, the
    others in their own ORDER. Entries: tiles (with the order timed), order, {key}_ms and
    {key}_tflops, check(its result) as rel_err when given, or the error of a tile that does not fit
    (shared memory, registers)."""
    from dflash.step.attention.triton_attention import ORDERS

    entries = []
    for c in candidates:
        tiles = tile_type(*c)
        for order in ORDERS if c == candidates[0] else (ORDERS[tiles.ORDER],):
            entry: dict[str, Any] = {
                "tiles": tiles._replace(ORDER=ORDERS.index(order))._asdict(),
                "order": order,
            }

            def call(tiles: Any = tiles, order: str = order) -> Any:
                return run(tiles, order)

            try:
                got = call()
                if check is not None:
                    entry["rel_err"] = check(got)
                ms = bench_ms(call, device, reps)
                entry.update({f"{key}_ms": ms, f"{key}_tflops": flop / ms / 1e9})
                errs = f", rel_err {entry['rel_err']}" if "rel_err" in entry else ""
                print(f"{name} {c} {order}: {ms:.3f} ms ({flop / ms / 1e9:.0f} TFLOP/s){errs}", flush=True)
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                print(f"{name} {c} {order}: {entry['error']}", flush=True)
            entries.append(entry)
    return entries


MAX_REL_ERR = 1e-2
"""A candidate whose output or gradients differ from flex's by more than this (relative) never goes
into the table; dflash's kernels at the table's tiles differ by about 1e-3 (bf16)."""


def matches(candidate: dict[str, Any]) -> bool:
    """The candidate's errors against flex (rel_err) are all within MAX_REL_ERR (none measured: true)."""
    return all(e <= MAX_REL_ERR for e in candidate.get("rel_err", {}).values())


def write_table(path: Path, report: dict[str, Any], head_dim: int) -> None:
    """Each layer kind's fastest candidates (tiles and order) as kernel_fwd_* and kernel_bwd_*
    options of that kind's entry in dflash.step.attention.flex's table (its flex options and other
    entries kept)."""
    import json

    from dflash.rundir import atomic_write_json
    from dflash.step.attention.flex import KERNEL_PREFIX, layer_kind

    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        table = {"entries": []}
    for row in report["layers"]:
        # Only candidates that compute what flex computes: a fast wrong one (a miscompile) stays out.
        timed = [c for c in row["candidates"] if "bwd_ms" in c and matches(c)]
        fwd_timed = [c for c in row["fwd_candidates"] if "fwd_ms" in c and matches(c)]
        if not timed or not fwd_timed:
            continue
        best = min(timed, key=lambda c: c["bwd_ms"])
        best_fwd = min(fwd_timed, key=lambda c: c["fwd_ms"])
        kind = layer_kind(None if row["window"] == "full" else int(row["window"]))
        key = (report["capability"], head_dim, kind)
        entry = next(
            (e for e in table["entries"] if (e["capability"], e["head_dim"], e["kind"]) == key), None
        )
        if entry is None:
            entry = {"capability": report["capability"], "head_dim": head_dim, "kind": kind, "options": {}}
            table["entries"].append(entry)
        opts = {k: v for k, v in entry["options"].items() if not k.startswith(KERNEL_PREFIX)}
        entry["options"] = {
            **opts,
            **{f"{KERNEL_PREFIX}fwd_{k}": v for k, v in best_fwd["tiles"].items()},
            **{f"{KERNEL_PREFIX}bwd_{k}": v for k, v in best["tiles"].items()},
        }
        entry["kernel_measured"] = {
            "device": report["device"],
            "torch": report["torch"],
            "date": report["date"],
            "command": report["command"],
            "fwd_ms": round(best_fwd["fwd_ms"], 3),
            "fwd_tflops": round(best_fwd["fwd_tflops"], 1),
            "flex_fwd_ms": round(row["flex"]["fwd_ms"], 3) if "flex" in row else None,
            "bwd_ms": round(best["bwd_ms"], 3),
            "bwd_tflops": round(best["bwd_tflops"], 1),
            "flex_bwd_ms": round(row["flex"]["bwd_ms"], 3) if "flex" in row else None,
        }
    atomic_write_json(path, table)


if __name__ == "__main__":
    main()
