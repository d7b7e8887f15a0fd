"""Throughput baselines: the healthy tok/s of one environment fingerprint and one job config, so a
run that silently got slower (a workaround trading a crash for slow kernels) is measured against
what the same environment did before, not against a guess.

    <root>/<fingerprint key>/<config hash>.json

`root` is passed in; kept beside the compile-cache artifacts (e.g. `<store root>/../baselines`)
since both are keyed by the same fingerprint. A baseline keeps the steady tok/s (median past the
warm-up) of its last few healthy runs; its value is their median, so one odd run moves it little.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.canonical import HEX64, canonical_json
from runner.fsutil import atomic_write_text, file_lock
from runner.rundir.schema import BASELINE, read_record_file
from runner.watch.signals import median

SPEED_NEUTRAL = {
    "run": None,  # name, seed, runs_root, status interval: none changes the kernels' speed
    "train": ("total_steps", "lr", "warmup_steps", "min_lr_ratio", "weight_decay", "betas", "grad_clip")
    + ("checkpoint_every", "keep_last", "epochs", "gamma"),
    "pipeline": ("max_restarts", "restart_targets", "rdzv_endpoint", "rdzv_id", "rdzv_timeout_s"),
    "data": ("cache_dir",),
}
"""Config fields left out of the config hash (None: the whole section)."""
KEEP_RUNS = 5


def config_hash(config: Mapping[str, Any]) -> str:
    """sha256 of the job config's canonical JSON without the fields that cannot change throughput."""
    kept: dict[str, Any] = {}
    for section, value in config.items():
        drop = SPEED_NEUTRAL.get(section, ())
        if drop is None:
            continue
        kept[section] = (
            {k: v for k, v in value.items() if k not in drop} if isinstance(value, Mapping) else value
        )
    return hashlib.sha256(canonical_json(kept)).hexdigest()


def key_of(manifest: Mapping[str, Any]) -> tuple[str, str] | None:
    """(fingerprint key, config hash) of a run.json: the fingerprint key is the cache artifact's
    key (the artifact is keyed by the fingerprint); None when the run names no artifact."""
    key, config = manifest.get("cache_artifact"), manifest.get("config")
    if not isinstance(key, str) or not HEX64.match(key) or not isinstance(config, Mapping):
        return None
    return key, config_hash(config)


@dataclass(kw_only=True, slots=True)
class Baseline:
    fingerprint_key: str
    config_hash: str
    tok_s: float
    """The median of the kept runs' steady tok/s."""
    runs: list[dict[str, Any]] = field(default_factory=list)
    """[{run_id, tok_s, records, at}], oldest first, at most KEEP_RUNS."""
    updated_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "fingerprint_key": self.fingerprint_key,
            "config_hash": self.config_hash,
            "tok_s": self.tok_s,
            "runs": self.runs,
            "updated_at": self.updated_at,
        }


def _path(root: Path, key: str, chash: str) -> Path:
    if not HEX64.match(key) or not HEX64.match(chash):
        raise ValueError("a baseline is keyed by two sha256 hex digests")
    return root / key / f"{chash}.json"


def _read(path: Path) -> Baseline | None:
    """The baseline stored there; None when absent or damaged (runner.rundir.schema): no baseline
    is better than a wrong one."""
    d, _why = read_record_file(path, BASELINE)
    if d is None:
        return None
    return Baseline(
        fingerprint_key=d["fingerprint_key"],
        config_hash=d["config_hash"],
        tok_s=float(d["tok_s"]),
        runs=list(d.get("runs", [])),
        updated_at=float(d.get("updated_at", 0.0)),
    )


def load(root: Path, fingerprint_key: str, chash: str) -> Baseline | None:
    return _read(_path(root, fingerprint_key, chash))


def steady_tok_s(
    metrics: Iterable[Mapping[str, Any]], *, warmup_s: float = 300.0
) -> tuple[float, int] | None:
    """(median tok/s past the warm-up, records used) of a run's metrics."""
    values = [
        float(m["tok_s"])
        for m in metrics
        if isinstance(m.get("tok_s"), (int, float)) and isinstance(m.get("elapsed_s"), (int, float))
        if m["elapsed_s"] >= warmup_s and m["tok_s"] > 0
    ]
    return (median(values), len(values)) if values else None


def update_from_healthy_run(
    root: Path,
    fingerprint_key: str,
    chash: str,
    metrics: Iterable[Mapping[str, Any]],
    *,
    run_id: str,
    warmup_s: float = 300.0,
    min_records: int = 5,
) -> Baseline | None:
    """Fold a run the caller judged healthy into its baseline (watch's rule, WatchSession.
    record_baseline: the run completed and had no critical finding after warm-up; warnings do not
    disqualify it). `metrics` are distinct records, each once. None when fewer than `min_records`
    of them are past `warmup_s` with a tok/s. A run already recorded is replaced, so updating twice
    from one run counts it once."""
    steady = steady_tok_s(metrics, warmup_s=warmup_s)
    if steady is None or steady[1] < min_records:
        return None
    path = _path(root, fingerprint_key, chash)
    with file_lock(root / ".locks" / f"{fingerprint_key}-{chash}.lock"):
        old = _read(path)
        runs = [r for r in (old.runs if old else []) if r.get("run_id") != run_id]
        runs = [*runs, {"run_id": run_id, "tok_s": steady[0], "records": steady[1], "at": time.time()}][
            -KEEP_RUNS:
        ]
        base = Baseline(
            fingerprint_key=fingerprint_key,
            config_hash=chash,
            tok_s=median([float(r["tok_s"]) for r in runs]),
            runs=runs,
            updated_at=time.time(),
        )
        atomic_write_text(path, json.dumps(base.to_dict(), indent=2, sort_keys=True) + "\n")
    return base


def list_baselines(root: Path) -> list[Baseline]:
    """Every readable baseline under root, newest first."""
    if not root.is_dir():
        return []
    found = [b for p in sorted(root.glob("*/*.json")) if (b := _read(p)) is not None]
    return sorted(found, key=lambda b: -b.updated_at)


def for_manifest(root: Path, manifest: Mapping[str, Any]) -> Baseline | None:
    key = key_of(manifest)
    return None if key is None else load(root, *key)
