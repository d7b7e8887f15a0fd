#!/usr/bin/env bash
# Every GPU check and benchmark of the project in ONE device call (<= 10 min wall clock), results under $OUT.
#
#   OUT=/some/dir bash bench/h200.sh          # on the GPU machine, repo root as working dir
#   PYTHON=.venv/bin/python OUT=/tmp/h200 bash bench/h200.sh   # CPU smoke run: tiny sizes instead of GPU ones
#
# Steps (rough H200 time budget; each runs under `timeout`, a failure does not stop the next):
#   0. pip install zstandard from .carry/wheels (if present)            ~5 s
#   a. pytest -m gpu -q tests/          -> $OUT/pytest.log             <= 75 s
#   b. bench/attention.py               -> $OUT/attention.json         <= 40 s   (log: benches.log)
#  b2. only with H200_ONLY=... flex_tune: bench/flex_tune.py, winners written into
#      dflash/step/attention/flex_tuned.json for the later steps -> $OUT/flex_tune.json, flex_tuned.json  ~150 s
#   c. bench/drafter_step.py --profile   -> $OUT/drafter_step.json      <= 150 s  (log: benches.log)
#  c2. only when asked: drafter_step_before (loss unfused, untuned flex) -> drafter_step_before.json
#  c3. only when asked: optimizer: bench/optimizer.py --sweep -> $OUT/optimizer.json   ~30 s
#  c4. only when asked: drafter_step_qk (flex with attention.fused_qk_norm_rope=$H200_QK, default
#      false: the A/B against c's flex row, where auto turns it on) -> $OUT/drafter_step_qk.json  <= 120 s
#  c4b. only when asked: drafter_step_ab (flex with the settings in H200_AB_SETS: the A/B against c's
#      flex row) -> $OUT/drafter_step_ab.json  <= 120 s
#  c5. only when asked: qk_norm_rope: bench/qk_norm_rope.py --sweep -> $OUT/qk_norm_rope.json      ~60 s
#  c6. only when asked: attention_backward: bench/attention_backward.py (H200_ABW_ARGS) -> $OUT/attention_backward.json
#      bench/head_loss.py               -> $OUT/head_loss.json         <= 20 s   (log: benches.log)
#   d. compile cache: warm-cache (cold) -> restore into an empty dir -> new process on the restored dir
#                                       -> $OUT/compile_cache.json     <= 85 s   (log: cache.log)
#  d2. only with H200_ONLY=compile_cache_8b (a call of its own, up to 540 s): the same round trip for
#      configs/qwen3-8b.toml on the random 8B-size target -> $OUT/compile_cache_8b.json
#  d3. only with H200_ONLY=cache_probe: qwen3-8b on two buckets, restored twice (compile workers on,
#      off), new cache files per restored run -> $OUT/cache_probe.json                    ~200 s
#   e. bench/pipeline.py                -> $OUT/pipeline.json          the rest, >= 280 s (log: pipeline.log)
#      (first time: build + save the 16 GB target ~60 s, baseline + target-only ~40 s, drafter-only with a
#      cold compile ~80 s, end-to-end job whatever is left, up to 150 s; it reuses the drafter's compile cache)
# A step that overruns its cap is cut by `timeout`; the caps of later steps are always kept for them.
# Eight files come back from a device call at most: choose steps with H200_ONLY. The summary goes to stdout.
set -u
OUT=${OUT:?set OUT to the results directory}
PY=${PYTHON:-python}
TOTAL_S=${H200_TOTAL_S:-570}        # the device call's 600 s minus slack for start-up and copying back
PIPELINE_MIN_S=${H200_PIPELINE_MIN_S:-280}
WORK=${DFLASH_BENCH_WORK:-/tmp/dflash-bench}   # scratch: the 16 GB random target lives here (reused)
mkdir -p "$OUT" "$WORK"
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SECONDS=0
declare -A STATUS

# runner.cache needs zstandard, which the device image lacks: carry its wheel in .whl/ (or .carry/wheels).
for wheels in .carry/wheels .whl; do
  if ls "$wheels"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$wheels"/*.whl && export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" \
      || echo "warning: zstandard install failed"
    break
  fi
done
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  GPU=1; TINY=(); echo "GPU: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(), torch.__version__)')"
else
  GPU=0; TINY=(--tiny); echo "no GPU: running the tiny CPU variants instead"
fi

# H200_PIPELINE_ARGS: extra bench/pipeline.py flags, e.g. "--target-compile false"; H200_STEP_ARGS and
# H200_HEAD_ARGS the same for bench/drafter_step.py ("--backends flex") and bench/head_loss.py
# ("--skip-unchunked --ce-sweep").
# budget CAP [RESERVE]: seconds this step may use, leaving RESERVE for the steps after it.
# asked NAME: H200_ONLY names the step. runs NAME: it runs in this call (H200_ONLY empty, or asked).
asked() { [[ " ${H200_ONLY:-} " == *" $1 "* ]]; }
runs() { [ -z "${H200_ONLY:-}" ] || asked "$1"; }
# The main steps in order with the seconds each keeps for itself from the steps before it (the
# steps only run when asked come between drafter_step and head_loss and keep nothing).
KEEPS=(pytest 0 attention 40 drafter_step 70 head_loss 20 compile_cache 85 pipeline "$PIPELINE_MIN_S")
# after NAME: the seconds to keep for the main steps after NAME that run in this call.
after() {
  local sum=0 seen=0 i
  for (( i = 0; i < ${#KEEPS[@]}; i += 2 )); do
    (( seen )) && runs "${KEEPS[i]}" && sum=$(( sum + KEEPS[i + 1] ))
    [ "${KEEPS[i]}" = "$1" ] && seen=1
  done
  echo "$sum"
}
budget() {
  local left=$(( TOTAL_S - SECONDS - ${2:-0} ))
  (( left < ${1} )) && echo $(( left > 10 ? left : 10 )) || echo "$1"
}

# step NAME SECONDS LOG CMD...: run with a timeout, append output to LOG, record the exit code.
step() {
  local name=$1 secs=$2 log=$3; shift 3
  # H200_ONLY="attention compile_cache" runs just those steps; H200_CAP_<name>=S overrides a cap.
  if ! runs "$name"; then STATUS[$name]="skipped"; return; fi
  local cap_var="H200_CAP_$name"; secs=${!cap_var:-$secs}
  echo "=== $name (timeout ${secs}s, t=${SECONDS}s) ===" | tee -a "$log"
  # A stack dump of every Python thread before the cap runs out says where a slow step is.
  PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1 timeout --signal=ABRT --kill-after=15 "$secs" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  STATUS[$name]="rc=$rc $([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo TIMEOUT)"
  echo "=== $name: rc=$rc at t=${SECONDS}s ===" | tee -a "$log"
}

# (a) GPU tests (they skip themselves without a GPU)
step pytest "$(budget 75 "$(after pytest)")" "$OUT/pytest.log" "$PY" -m pytest -m gpu -q tests/

# (b), (c) kernel and drafter-step benchmarks
step attention "$(budget 40 "$(after attention)")" "$OUT/benches.log" \
  "$PY" bench/attention.py "${TINY[@]}" --out "$OUT/attention.json"
# Only when asked (H200_ONLY=flex_tune): the kernel-option sweep behind dflash/step/attention/flex_tuned.json.
# Its winners are written into that table here, so every later step of this call runs with them; the
# table comes back as $OUT/flex_tuned.json (commit it). H200_TUNE_ARGS: e.g. "--only 0,4,6".
if asked flex_tune; then
  step flex_tune "$(budget 220)" "$OUT/tune.log" \
    "$PY" bench/flex_tune.py "${TINY[@]}" --work "$WORK/flex-tune" --out "$OUT/flex_tune.json" \
    --write-table dflash/step/attention/flex_tuned.json ${H200_TUNE_ARGS:-}
  cp dflash/step/attention/flex_tuned.json "$OUT/flex_tuned.json"
fi
# The job's own step (DrafterTrainer.train_step), both backends, profiled; one shared compile cache.
export TORCHINDUCTOR_CACHE_DIR="$WORK/step-inductor"
step drafter_step "$(budget 150 "$(after drafter_step)")" "$OUT/benches.log" \
  "$PY" bench/drafter_step.py "${TINY[@]}" --steps 5 --warmup 2 --profile --out "$OUT/drafter_step.json" ${H200_STEP_ARGS:-}
# flex_step NAME CAP SETTINGS: only when asked, drafter_step's flex row with other settings (a shell
# string of --set options), profiled the same way -> $OUT/NAME.json: an A/B against that row in one call.
flex_step() {
  asked "$1" || return 0
  step "$1" "$(budget "$2" "$(after drafter_step)")" "$OUT/benches.log" \
    bash -c "\"$PY\" bench/drafter_step.py ${TINY[*]} --backends flex --steps 5 --warmup 2 --profile --out \"$OUT/$1.json\" $3"
}
# The before: the loss unfused and inductor's default flex options.
flex_step drafter_step_before 90 "--set train.fused_loss=false --set attention.tuned_kernels=false"
# dflash's q/k norm + rotary kernel off (H200_QK=false, the default; auto turns it on in the row) or on.
flex_step drafter_step_qk 120 "--set attention.fused_qk_norm_rope=${H200_QK:-false}"
# Any other settings: H200_AB_SETS, e.g. "--set train.loss_chunk_tokens=16384".
if asked drafter_step_ab && [ -z "${H200_AB_SETS:-}" ]; then
  echo "drafter_step_ab: H200_AB_SETS is empty (the settings to compare, e.g. --set key=value): not run"
  STATUS[drafter_step_ab]="not run: H200_AB_SETS empty"
else
  flex_step drafter_step_ab 120 "${H200_AB_SETS:-}"
fi
# Only when asked: the q/k norm + rotary kernel against the module path inductor compiles, and swept.
if asked qk_norm_rope; then
  step qk_norm_rope "$(budget 90 "$(after drafter_step)")" "$OUT/benches.log" \
    env ${TINY[@]:+TRITON_INTERPRET=1} "$PY" bench/qk_norm_rope.py "${TINY[@]}" ${TINY[@]:+--reps 1} --sweep --out "$OUT/qk_norm_rope.json"
fi
# Only when asked: dflash's attention kernels alone per tile candidate (H200_ABW_ARGS: e.g.
# '--tiles "64,64,64,64,4,2;64,64,64,64,4,1"'; without it the bench's own candidate lists).
if asked attention_backward; then
  step attention_backward "$(budget 120 "$(after drafter_step)")" "$OUT/benches.log" \
    bash -c "${TINY[*]:+TRITON_INTERPRET=1 }\"$PY\" bench/attention_backward.py ${TINY[*]} --reps 10 --out \"$OUT/attention_backward.json\" ${H200_ABW_ARGS:-}"
fi
# Only when asked: the optimizer step alone, the job's KernelAdamW against torch's fused AdamW.
if asked optimizer; then
  step optimizer "$(budget 60 "$(after drafter_step)")" "$OUT/benches.log" \
    "$PY" bench/optimizer.py "${TINY[@]}" --sweep --out "$OUT/optimizer.json"
fi
unset TORCHINDUCTOR_CACHE_DIR
HEAD_ARGS=(--reps 5); [ "$GPU" = 1 ] || HEAD_ARGS=(--tokens 600 --hidden 64 --vocab 2048 --chunk 256 --reps 2)
step head_loss "$(budget 20 "$(after head_loss)")" "$OUT/benches.log" \
  "$PY" bench/head_loss.py "${HEAD_ARGS[@]}" --out "$OUT/head_loss.json" ${H200_HEAD_ARGS:-}

# (d) compile cache round trip (docs/compile-cache.md): warm cold into a fresh store, restore into an
# empty dir after checking the fingerprint against this interpreter, then a NEW process compiling the
# same steps on the restored dir must report hits and no misses.
# cache_roundtrip CONFIG RESULT_JSON [--set k=v ...]
cache_roundtrip() {
  local config=$1 result=$2; shift 2
  local scratch; scratch=$(mktemp -d "$WORK/cache-XXXXXX")   # 0700: the store refuses looser parents
  export XDG_CACHE_HOME="$scratch/xdg-cache" XDG_CONFIG_HOME="$scratch/xdg-config"
  unset DFLASH_CACHE_STORE DFLASH_CACHE_SIGNING_KEY
  local sets=(--set "run.runs_root=$scratch/runs" "$@")
  local pyabs; pyabs=$(command -v "$PY")
  "$PY" -m runner.cli warm-cache "$config" --python "$pyabs" "${sets[@]}" \
    --store "$scratch/store" --json > "$scratch/warm.json" || { echo "warm-cache failed"; return 1; }
  local key; key=$("$PY" -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])["key"])' "$scratch/warm.json")
  echo "artifact $key"
  "$PY" -m runner.cli cache restore "$key" --store "$scratch/store" --dest "$scratch/restored/cache" \
    --python "$pyabs" --config "$config" "${sets[@]}" || { echo "restore failed"; return 1; }
  "$PY" -m dflash.warm "$config" --out "$scratch/restored/cache" "${sets[@]}" \
    > "$scratch/again.jsonl" || { echo "warm run on the restored dir failed"; return 1; }
  : > "$scratch/again-threads1.jsonl"
  if [ "${RESTORE_THREADS1:-0}" = 1 ]; then
    # The same restored warm again from a fresh restore, without inductor's compile workers: what
    # the worker pool and loading kernels in the parent cost on a cache that only hits.
    rm -rf "$scratch/restored"
    "$PY" -m runner.cli cache restore "$key" --store "$scratch/store" --dest "$scratch/restored/cache" \
      --python "$pyabs" --config "$config" "${sets[@]}" > /dev/null || { echo "restore failed"; return 1; }
    TORCHINDUCTOR_COMPILE_THREADS=1 "$PY" -m dflash.warm "$config" --out "$scratch/restored/cache" \
      "${sets[@]}" > "$scratch/again-threads1.jsonl" || { echo "threads=1 warm failed"; return 1; }
  fi
  "$PY" - "$scratch/warm.json" "$scratch/again.jsonl" "$result" "$GPU" "$scratch/again-threads1.jsonl" <<'EOF'
import json, sys
warm = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
events = [json.loads(l) for l in open(sys.argv[2]) if l.startswith("{")]
t1 = [json.loads(l) for l in open(sys.argv[5]) if l.startswith("{")]
t1_done = next((e for e in t1 if e["event"] == "done"), None)
done = next(e for e in events if e["event"] == "done")
cold, hot = warm["warm"], done
c, cc = hot["counters"], cold["counters"]
res = {
    "key": warm["key"], "device": "cuda" if sys.argv[4] == "1" else "cpu", "artifact_bytes": warm["size"],
    "artifact_files": warm["files"], "warm_cache_cmd_s": warm["seconds"],
    "cold_compile_s": cold["seconds"], "restored_compile_s": hot["seconds"],
    "ratio": hot["seconds"] / cold["seconds"] if cold["seconds"] else None,
    "cold_counters": cc, "restored_counters": c,
    "all_hits": c.get("fxgraph_misses", 1) == 0 and c.get("autograd_misses", 1) == 0
                and c.get("fxgraph_hits", 0) == cc.get("fxgraph_misses", 0) + cc.get("fxgraph_hits", 0),
    "shapes": [e["shape"] for e in events if e["event"] == "shape"],
    "cold_breakdown": cold.get("breakdown"), "restored_breakdown": hot.get("breakdown"),
    "restored_per_shape": [{"shape": e["shape"], "seconds": e["seconds"], **(e.get("breakdown") or {})}
                           for e in events if e["event"] == "shape"],
    "memory": cold.get("memory"),
    "restored_threads1": t1_done and {
        "seconds": t1_done["seconds"], "ratio": t1_done["seconds"] / cold["seconds"],
        "counters": t1_done["counters"], "breakdown": t1_done.get("breakdown")},
}
open(sys.argv[3], "w").write(json.dumps(res, indent=2))
print(json.dumps({k: res[k] for k in ("cold_compile_s", "restored_compile_s", "ratio", "all_hits")}))
print(json.dumps({"restored_breakdown": res["restored_breakdown"], "restored_threads1": res["restored_threads1"]}))
sys.exit(0 if res["all_hits"] else 3)
EOF
  local rc=$?
  rm -rf "$scratch"
  return $rc
}
export GPU PY WORK OUT
DEMO_SETS=""; [ "$GPU" = 1 ] && DEMO_SETS="--set run.device=cuda --set attention.backend=flex"
step compile_cache "$(budget 85 "$(after compile_cache)")" "$OUT/cache.log" \
  bash -c "$(declare -f cache_roundtrip); cache_roundtrip configs/demo-cpu.toml $OUT/compile_cache.json $DEMO_SETS"

# (d2) only when asked (H200_ONLY=compile_cache_8b; it needs a call of its own): every shape of the
# qwen3-8b config warmed cold, restored, and compiled again in a new process. The drafter needs the
# target's config, tokenizer, embedding and head: the random 8B-size target of bench/pipeline.py.
cache_8b() {
  local target
  target=$("$PY" bench/pipeline.py --work "$WORK" --make-target-only $([ "$GPU" = 1 ] || echo --tiny)) \
    || { echo "building the target failed"; return 1; }
  local sets=(--set "target.path=$target")   # the shipped config unmodified but for its model path
  if [ "$GPU" = 0 ]; then   # CPU smoke: the same config at a size a CPU finishes
    sets+=(--set run.device=cpu --set target.dtype=float32 --set attention.backend=sdpa
           --set attention.strict_kernels=false --set data.max_seq_len=128 --set data.bucket_multiple=64
           --set train.token_budget=256 --set train.max_batch_size=4 --set train.num_anchors=8)
  fi
  RESTORE_THREADS1=${H200_RESTORE_THREADS1:-0} cache_roundtrip configs/qwen3-8b.toml "$OUT/compile_cache_8b.json" "${sets[@]}"
  local rc=$?
  [ "${H200_REFUSAL:-1}" = 1 ] || return $rc
  # The plan before the block-token budget (64 rows of 511 anchors at the 512 bucket): warm-cache
  # must refuse it at its first shape, naming it, exit 2, no artifact.
  local scratch; scratch=$(mktemp -d "$WORK/refuse-XXXXXX")
  "$PY" -m dflash.warm configs/qwen3-8b.toml --out "$scratch/out" "${sets[@]}" \
    --set "run.runs_root=$scratch/runs" --set train.block_token_budget=523264 > /dev/null 2> "$scratch/err"
  local refused=$?
  echo "over-budget plan: exit $refused, $(tail -1 "$scratch/err")"
  [ "$refused" = 2 ] && grep -q "64x512" "$scratch/err" && [ ! -e "$scratch/out/warm.json" ] \
    || { echo "over-budget plan was not refused as expected"; rc=4; }
  rm -rf "$scratch"
  return $rc
}
if asked compile_cache_8b; then
  step compile_cache_8b "$(budget 540)" "$OUT/cache.log" \
    bash -c "$(declare -f cache_roundtrip cache_8b); cache_8b"
fi

# (d3) only when asked (H200_ONLY=cache_probe): where a restored warm's kernel waits go. The qwen3-8b
# drafter on two buckets (512, 1024) warmed cold, restored, then compiled again in new processes twice:
# with inductor's compile workers as the job runs (default) and in-process (TORCHINDUCTOR_COMPILE_THREADS=1).
# Each restored run reports its breakdown and how many files it added to the restored cache (a kernel
# Triton or inductor compiled again instead of loading it) -> $OUT/cache_probe.json
cache_probe() {
  local target scratch pyabs
  target=$("$PY" bench/pipeline.py --work "$WORK" --make-target-only $([ "$GPU" = 1 ] || echo --tiny)) \
    || { echo "building the target failed"; return 1; }
  scratch=$(mktemp -d "$WORK/probe-XXXXXX"); pyabs=$(command -v "$PY")
  export XDG_CACHE_HOME="$scratch/xdg-cache" XDG_CONFIG_HOME="$scratch/xdg-config"
  # Two buckets of the shipped config's batching: its block-token budget as at max_seq_len 4096
  # (12 rows x 512 anchors x 16), which the derived budget of a 1024-token maximum would quadruple
  # (48 rows of 1024: the memory preflight refused that plan, 2026-12-01).
  local sets=(--set "target.path=$target" --set "run.runs_root=$scratch/runs" --set data.max_seq_len=1024
              --set data.bucket_multiple=512 --set train.block_token_budget=98304 ${H200_PROBE_SETS:-})
  if [ "$GPU" = 0 ]; then
    sets+=(--set run.device=cpu --set target.dtype=float32 --set attention.backend=sdpa
           --set attention.strict_kernels=false --set data.max_seq_len=128 --set data.bucket_multiple=64
           --set train.token_budget=256 --set train.max_batch_size=4 --set train.num_anchors=8
           --set drafter.mask_token_id=511)
  fi
  "$PY" -m runner.cli warm-cache configs/qwen3-8b.toml --python "$pyabs" "${sets[@]}" \
    --store "$scratch/store" --json > "$scratch/warm.json" || { echo "warm-cache failed"; return 1; }
  local key; key=$("$PY" -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])["key"])' "$scratch/warm.json")
  local variant threads
  for variant in default threads1; do
    rm -rf "$scratch/restored"
    "$PY" -m runner.cli cache restore "$key" --store "$scratch/store" --dest "$scratch/restored/cache" \
      --python "$pyabs" --config configs/qwen3-8b.toml "${sets[@]}" > /dev/null || { echo "restore failed"; return 1; }
    find "$scratch/restored/cache" -type f | sort > "$scratch/files-before"
    threads=${TORCHINDUCTOR_COMPILE_THREADS:-}; [ "$variant" = threads1 ] && threads=1
    env ${threads:+TORCHINDUCTOR_COMPILE_THREADS=$threads} "$PY" -m dflash.warm configs/qwen3-8b.toml \
      --out "$scratch/restored/cache" "${sets[@]}" > "$scratch/again-$variant.jsonl" \
      || { echo "restored warm failed"; return 1; }
    find "$scratch/restored/cache" -type f | sort > "$scratch/files-after"
    comm -13 "$scratch/files-before" "$scratch/files-after" | sed "s|$scratch/restored/cache/||" > "$scratch/new-$variant"
  done
  "$PY" - "$scratch" "$OUT/cache_probe.json" <<'EOF'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
cold = json.loads((d / "warm.json").read_text().strip().splitlines()[-1])["warm"]
res = {"cold_s": cold["seconds"], "cold_breakdown": cold.get("breakdown"), "restored": {}}
for v in ("default", "threads1"):
    events = [json.loads(l) for l in (d / f"again-{v}.jsonl").read_text().splitlines() if l.startswith("{")]
    done = next(e for e in events if e["event"] == "done")
    new = (d / f"new-{v}").read_text().split()
    res["restored"][v] = {
        "seconds": done["seconds"], "ratio": done["seconds"] / cold["seconds"], "breakdown": done.get("breakdown"),
        "counters": done["counters"], "per_shape": [e.get("breakdown") for e in events if e["event"] == "shape"],
        "new_files": len(new), "new_triton_files": [f for f in new if f.startswith("triton/")][:40],
        "new_other_files": [f for f in new if not f.startswith("triton/")][:20],
    }
pathlib.Path(sys.argv[2]).write_text(json.dumps(res, indent=2))
print(json.dumps({v: {k: r[k] for k in ("seconds", "ratio", "new_files")} for v, r in res["restored"].items()}))
EOF
  local rc=$?
  rm -rf "$scratch"
  return $rc
}
if asked cache_probe; then
  step cache_probe "$(budget 300)" "$OUT/cache.log" bash -c "$(declare -f cache_probe); cache_probe"
fi

# (e) the pipeline benchmark gets what is left; it shortens its end-to-end run to fit --budget-s.
PIPE_S=$(budget 9999)
step pipeline "$PIPE_S" "$OUT/pipeline.log" \
  "$PY" bench/pipeline.py "${TINY[@]}" --work "$WORK" --budget-s $((PIPE_S - 20)) --out "$OUT/pipeline.json" ${H200_PIPELINE_ARGS:-}

echo
echo "=== summary (t=${SECONDS}s) ==="
for s in pytest attention flex_tune drafter_step drafter_step_before drafter_step_qk drafter_step_ab qk_norm_rope attention_backward optimizer head_loss compile_cache compile_cache_8b cache_probe pipeline; do printf '%-20s %s\n' "$s" "${STATUS[$s]:-not run}"; done
"$PY" - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None
p = load("pipeline.json")
if p:
    s = p["summary"]
    fmt = lambda x, f="{:.0f}": f.format(x) if x is not None else "n/a"
    print(f"{p['device']}, torch {p['torch']}")
    for k in ("baseline_tok_s", "target_only_tok_s", "drafter_only_tok_s", "e2e_tok_s"):
        print(f"  {k:24} {fmt(s[k]):>10}")
    print(f"  capture speedup          {fmt(s['capture_speedup_vs_baseline'], '{:.2f}x'):>10}  (goal >= 1.25x)")
    print(f"  bound ({s['bound']})            {fmt(s['bound_tok_s']):>10}")
    print(f"  end-to-end / bound       {fmt(s['efficiency'], '{:.1%}'):>10}  (goal >= {s['goal_efficiency']:.0%})")
    for cause in ((p.get("e2e") or {}).get("gap_profile") or {}).get("causes", []):
        print(f"    gap: {cause}")
for name in ("drafter_step_before.json", "drafter_step.json", "drafter_step_qk.json", "drafter_step_ab.json"):
    for r in (load(name) or {}).get("results", []):
        split = (r.get("profile") or {}).get("per_step_ms") or {}
        print(f"  {name[:-5]:20} {r['backend']:5} fused_loss={r['fused_loss']!s:5} qk={r.get('fused_qk_norm_rope')!s:5} {r['step_ms']:8.1f} ms "
              f"{r['seq_tokens_per_s']:8.0f} tok/s  MFU {r['mfu']:.1%} (first count {r.get('mfu_first_count', r['mfu']):.1%})  " + " ".join(f"{k}={v:.1f}" for k, v in split.items())
              + f"  busy={(r.get('profile') or {}).get('device_ms_per_step', 0):.1f} gaps={((r.get('profile') or {}).get('trace') or {}).get('gaps_ms_per_step', 0):.2f}")
t = load("flex_tune.json")
for kind, b in ((t or {}).get("best") or {}).items():
    print(f"  flex_tune {kind}: {b.get('combined_fwd_bwd_tflops', 0):.0f} TFLOP/s fwd+bwd tuned "
          f"(defaults {b.get('default_fwd_bwd_tflops', 0):.0f}): {b['options']}")
h = load("head_loss.json")
for r in (h or {}).get("results", []):
    print(f"  head_loss {r['variant']:28} {r['ms']:8.2f} ms  {r['tflops']:6.1f} TFLOP/s")
for name in ("compile_cache.json", "compile_cache_8b.json"):
    c = load(name)
    if c:
        print(f"  {name}: cold {c['cold_compile_s']:.1f} s, restored {c['restored_compile_s']:.1f} s, all hits {c['all_hits']}")
a = load("attention.json")
if a:
    print(f"  attention.json: {len(json.dumps(a))} bytes")
EOF
ls -la "$OUT"
