"""bench/eval.py, one real tiny run on the CPU: a drafter of the demo config's sizes built and
exported by the job's own writers, then `python -m dflash.eval` on it as users run it; the report
holds the eval's own result and the process's loading time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_tiny_eval_bench_runs_the_job_eval_on_an_exported_random_drafter(tmp_path: Path) -> None:
    out = tmp_path / "eval.json"
    proc = subprocess.run(
        [sys.executable, "bench/eval.py", "--tiny", "--work", str(tmp_path / "work"), "--prompts", "3",
         "--max-new", "20", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    ev = report["eval"]
    assert report["bench"] == "eval" and report["eval_argv"][:2] == ["-m", "dflash.eval"]
    assert ev["kind"] == "export" and ev["prompts"] == 3 and ev["tokens"] == 3 * 20  # --ignore-eos
    assert 1.0 <= ev["tau"] <= 16 and ev["tokens_per_s"] > 0 and ev["target_alone_tokens_per_s"] > 0
    assert 0 < report["load_s"] < report["process_s"]
    export = Path(ev["drafter"])
    assert (export / "model.safetensors").is_file()
    assert json.loads((export / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert report["drafter"]["trainable_params"] > 0 and "tok/s" in proc.stdout
