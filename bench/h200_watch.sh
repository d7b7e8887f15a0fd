#!/usr/bin/env bash
# dflashctl run + watch on real hardware, in one device call (about 5 minutes):
#   NVML as watch reads it against nvidia-smi; the CPU demo config moved to the GPU, launched with
#   `dflashctl run` in tmux; `watch --once --json` (workers joined to the GPU by pid); a drafter
#   SIGKILLed under a live watch; stop; report. Results under $OUT (default ./h200-watch-out).
# Needs the zstandard wheel in .whl/ (runner.cache uses it; the device image lacks it).
set -u
OUT=${OUT:-$PWD/h200-watch-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DFLASH_STATE_DIR=/tmp/dfstate HOME=/tmp/dfhome COLUMNS=160
mkdir -p "$HOME"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
CLI="python3 -m runner.cli"
{ date -u; nvidia-smi; python3 -c 'import torch; print(torch.__version__, torch.version.cuda)'; } > "$OUT/env.txt" 2>&1
echo "== nvml vs nvidia-smi"; timeout 90 python3 bench/nvml_check.py --out "$OUT/nvml.json" > "$OUT/nvml.log" 2>&1; echo "nvml_check rc=$?"
echo "== run"
timeout 300 $CLI run configs/demo-cpu.toml --backend tmux --runs-root /tmp/dfruns --name gpu \
  --set run.device=cuda --set train.total_steps=100000 --set run.status_interval_s=2 > "$OUT/run.log" 2>&1
echo "run rc=$?"; RD=$(ls -d /tmp/dfruns/gpu-* | head -1); echo "run dir $RD"
for _ in $(seq 1 150); do
  s=$(python3 -c "import json;print(json.load(open('$RD/workers/drafter-0.json'))['step'])" 2>/dev/null || echo 0)
  [ "$s" -ge 5 ] 2>/dev/null && break; sleep 2
done
echo "drafter step $s"
timeout 60 $CLI watch gpu --once --json > "$OUT/watch_once.json" 2>"$OUT/watch_once.err"; echo "watch --once rc=$?"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader > "$OUT/apps.csv"
cp "$RD"/workers/*.json "$OUT/" 2>/dev/null; tar -C "$RD" -czf "$OUT/workers.tgz" workers
echo "== kill a drafter under a live watch"
(timeout 100 $CLI watch gpu > "$OUT/watch_live.log" 2>&1 &)
sleep 12
DP=$(python3 -c "import json;print(json.load(open('$RD/workers/drafter-0.json'))['pid'])"); date +%s.%N > "$OUT/killed_at"
kill -9 "$DP"; echo "killed drafter pid $DP"
for _ in $(seq 1 40); do grep -q '"recovered"' "$RD/events.jsonl" && break; sleep 2; done
sleep 4
timeout 120 $CLI stop gpu --json > "$OUT/stop.json" 2>&1; echo "stop rc=$?"
timeout 60 $CLI report gpu --out "$OUT/report.png" > "$OUT/report.txt" 2>&1; echo "report rc=$?"
grep -v '"event": "batch"' "$RD/events.jsonl" > "$OUT/events.jsonl"
tail -c 3000 "$RD/logs/supervisor.log" > "$OUT/supervisor_tail.log"
# At most 8 files come back from a device call: everything small travels in one archive.
(cd "$OUT" && tar -czf bundle.tgz --exclude=bundle.tgz --exclude=report.png --exclude=nvml.json --exclude=events.jsonl . && \
  find . -maxdepth 1 -type f ! -name bundle.tgz ! -name report.png ! -name nvml.json ! -name events.jsonl -delete)
ls -la "$OUT"
