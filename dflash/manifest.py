"""Assembling a job from its config: run directory, data, target, drafter, resume, metrics, events.

The pieces are separate functions because the single-process trainer (dflash.train) uses them all
in one process while the pipeline's target and drafter workers each use their half.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.errors import DFlashError
from dflash.rundir import RUN_FORMAT, RunDir, unusable_reason

if TYPE_CHECKING:
    from dflash.config import JobConfig

REPO_ROOT = Path(__file__).resolve().parents[1]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def open_run_dir(cfg: JobConfig, run_dir: str | None, argv: list[str]) -> RunDir:
    """The run directory: created with its manifest when new, or when dflashctl made it with a
    stub run.json (no `config` yet); one whose run.json has a config is resumed. Also points inductor and triton at DFLASH_CACHE_DIR, before anything compiles."""
    from dflash.cache.job_side import cache_dir_from_env

    cache_dir_from_env()
    given = run_dir is not None
    if run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = str(Path(cfg.run.runs_root) / f"{cfg.run.name}-{stamp}")
    try:
        run = RunDir(run_dir).create()
        run.hold()
        _write_manifest(cfg, run, argv)
    except OSError as e:
        fix = (
            "pass another --run-dir (a directory this user can write; it is created when missing)"
            if given
            else "set run.runs_root to a directory this user can write, or pass --run-dir"
        )
        raise DFlashError(
            f"run directory {run_dir} cannot be used: {unusable_reason(run_dir, e)}; {fix}"
        ) from None
    return run


def _write_manifest(cfg: JobConfig, run: RunDir, argv: list[str]) -> None:
    commands = [{"t": time.time(), "host": socket.gethostname(), "argv": argv}]
    manifest = _existing_manifest(run)
    if "config" in manifest:  # the job wrote it at its first start: a resume
        manifest.setdefault("format", RUN_FORMAT)
        manifest.setdefault("command_lines", []).extend(commands)
    else:  # new, or created by dflashctl (its `runner` fields and any others are kept as they are)
        manifest = {
            "format": RUN_FORMAT,
            "run_id": run.root.name,
            **manifest,
            "config": cfg.to_dict(),
            "started_at": time.time(),
            "project_commit": _git_commit(),
            "hosts": [socket.gethostname()],
            "command_lines": commands,
            "image_digest": os.environ.get("DFLASH_IMAGE_DIGEST"),
            "lock_sha256": os.environ.get("DFLASH_LOCK_SHA256"),
            "cache_artifact": os.environ.get("DFLASH_CACHE_ARTIFACT") or _restored_key(),
        }
    run.write_manifest(manifest)


def _existing_manifest(run: RunDir) -> dict[str, Any]:
    """run.json as found ({} when absent), refused when this job cannot honour its format."""
    if not run.manifest.exists():
        return {}
    try:
        manifest = run.read_manifest()
    except (OSError, ValueError) as e:
        raise DFlashError(
            f"{run.manifest} cannot be read ({e}); fix or remove it, or pass another --run-dir"
        ) from e
    if not isinstance(manifest, dict):
        raise DFlashError(f"{run.manifest} is not a JSON object; fix or remove it, or pass another --run-dir")
    found = manifest.get("format", RUN_FORMAT)
    if found != RUN_FORMAT:
        raise DFlashError(
            f"{run.manifest} has format {found!r} but this job writes format {RUN_FORMAT}: run the job "
            "from the same dflash version as the dflashctl that created the run directory"
        )
    return manifest


def _restored_key() -> str | None:
    from dflash.cache.job_side import cache_dir_from_env, restored_artifact

    artifact = restored_artifact(cache_dir_from_env())
    return artifact.get("key") if artifact else None
