"""Prompts held out of a job's own data for its in-job tau (train.tau_eval on, train.tau_prompts
empty, a data.path of the user's): train.tau_prompt_count lines spread evenly over data.path go to a
prompts file, every other line to the file the job trains on (and answers with its target, with
data.responses), so tau is measured on prompts the drafter never saw. Both files are made once per
content of data.path and count, under <data.cache_dir or runs root/.tokcache>/.holdout/<key>/
(assembled in a temp dir, then renamed into place), and reused by every later start and worker.
A later start finds the split by data.path's path, size and modification time (a pointer under
.holdout/by-stat/) without reading the file again; a file changed in place gets a new split.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflash.errors import DFlashError
from dflash.rundir import atomic_write_bytes

if TYPE_CHECKING:
    from dflash.config import JobConfig

HOLDOUT_FORMAT = "holdout-v1"
TRAIN_FILE = "train.jsonl"
PROMPTS_FILE = "prompts.jsonl"
BY_STAT = "by-stat"


@dataclass(frozen=True)
class JobSource:
    data_path: str
    """The JSONL the job trains on (before data.responses): data.path, or its lines not held out."""
    tau_prompts: str | None
    """The in-job tau's prompts: train.tau_prompts, `demo` for the demo corpus, the held-out lines
    of data.path, or None when tau is off."""


def holdout_root(cfg: JobConfig) -> Path:
    return Path(cfg.data.cache_dir or Path(cfg.run.runs_root) / ".tokcache") / ".holdout"


def job_source(cfg: JobConfig, data_path: str, *, measures_tau: bool = True) -> JobSource:
    """data_path: where data.path is (dflash.data.inputs.locate_data). measures_tau: the job
    measures tau in itself (the pipeline's supervisor; the single-process dflash.train does not)."""
    from dflash.plan.resolve import resolve_tau_eval

    if not (measures_tau and resolve_tau_eval(cfg)):
        return JobSource(data_path, None)
    if cfg.train.tau_prompts:
        return JobSource(data_path, str(cfg.train.tau_prompts))
    if cfg.data.path == "demo":
        return JobSource(data_path, "demo")  # demo records of another seed (dflash.eval)
    train, prompts = split(Path(data_path), cfg.train.tau_prompt_count, holdout_root(cfg))
    return JobSource(str(train), None if prompts is None else str(prompts))


def held_lines(n: int, count: int) -> set[int]:
    """Indices of the `count` lines, of n, held out: spread evenly, the first at the middle of the
    first stretch (n > count)."""
    return {(2 * i + 1) * n // (2 * count) for i in range(count)}


def split(path: Path, count: int, root: Path) -> tuple[Path, Path | None]:
    """(training file, prompts file) of path's non-blank lines (see the module doc); (path, None)
    when it has no more than `count` of them, too few to hold any out."""
    pointer = _stat_pointer(path, count, root)
    if pointer is not None and pointer.is_file():
        final = root / pointer.read_text().strip()
        if (final / TRAIN_FILE).is_file() and (final / PROMPTS_FILE).is_file():
            return final / TRAIN_FILE, final / PROMPTS_FILE
    digest = hashlib.sha256(f"{HOLDOUT_FORMAT}\n{count}\n".encode())
    try:
        with path.open("rb") as f:
            n = 0
            for line in f:
                digest.update(line)
                n += bool(line.strip())
    except OSError as e:
        raise DFlashError(f"data.path {path} cannot be read: {e}") from None
    if n <= count:
        return path, None
    final = root / digest.hexdigest()[:40]
    train, prompts = final / TRAIN_FILE, final / PROMPTS_FILE
    if train.is_file() and prompts.is_file():
        _write_pointer(pointer, final.name)
        return train, prompts
    held = held_lines(n, count)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".split-", dir=root))
        with path.open("rb") as f, (tmp / TRAIN_FILE).open("wb") as t, (tmp / PROMPTS_FILE).open("wb") as p:
            i = 0
            for line in f:
                if not line.strip():
                    continue
                (p if i in held else t).write(line if line.endswith(b"\n") else line + b"\n")
                i += 1
        try:
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process of the job made it first
            if not (train.is_file() and prompts.is_file()):
                raise
    except OSError as e:
        raise DFlashError(
            f"cannot write the held-out tau prompts under {root}: {e}; set data.cache_dir to a writable "
            "directory, or train.tau_prompts to a prompts file of your own"
        ) from None
    _write_pointer(pointer, final.name)
    return train, prompts


def _stat_pointer(path: Path, count: int, root: Path) -> Path | None:
    """Where the content key of path's split is recorded under its path, size and mtime; None when
    path cannot be stat'ed (split reports the unreadable file)."""
    try:
        st = path.stat()
    except OSError:
        return None
    ident = f"{HOLDOUT_FORMAT}\n{count}\n{path.resolve()}\n{st.st_size}\n{st.st_mtime_ns}\n"
    return root / BY_STAT / hashlib.sha256(ident.encode()).hexdigest()[:40]


def _write_pointer(pointer: Path | None, key: str) -> None:
    """Record key at pointer; a pointer that cannot be written only costs the next start a read of
    data.path."""
    if pointer is None:
        return
    try:
        atomic_write_bytes(pointer, f"{key}\n".encode(), durable=False)
    except OSError:
        pass
