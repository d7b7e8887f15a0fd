"""Where a job's inputs are: the target's directory (`tiny` built once under the runs root), the
data file (`demo` written once there), and the target's tokenizer with its mask token."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.errors import DFlashError
from dflash.rundir import unusable_reason

if TYPE_CHECKING:
    from dflash.config import JobConfig


def tiny_target_dir(cfg: JobConfig) -> Path:
    """Where `target.path = "tiny"` lives: under the runs root, named by all its weights depend on
    (jobs with other seeds never swap it out)."""
    name = f".tiny-target-l{cfg.target.tiny_layers}-h{cfg.target.tiny_hidden}-s{cfg.run.seed}"
    return Path(cfg.run.runs_root) / name


def tiny_target_built(cfg: JobConfig) -> bool:
    """`tiny` and already built under the runs root (read only)."""
    from dflash.data.demo import tiny_target_ready

    return cfg.target.path == "tiny" and tiny_target_ready(
        tiny_target_dir(cfg), layers=cfg.target.tiny_layers, hidden=cfg.target.tiny_hidden, seed=cfg.run.seed
    )


def locate_target(cfg: JobConfig) -> str:
    """`tiny` builds (once) a tiny random Qwen3 under the runs root and returns its directory."""
    if cfg.target.path != "tiny":
        return cfg.target.path
    from dflash.data.demo import make_tiny_target

    path = tiny_target_dir(cfg)
    try:
        made = make_tiny_target(
            path, layers=cfg.target.tiny_layers, hidden=cfg.target.tiny_hidden, seed=cfg.run.seed
        )
    except OSError as e:
        raise _runs_root_error(cfg, "build the tiny target", path, e) from None
    return str(made)


def _runs_root_error(cfg: JobConfig, what: str, path: Path, e: OSError) -> DFlashError:
    return DFlashError(
        f"run.runs_root {cfg.run.runs_root}: cannot {what} there: {unusable_reason(path, e)}; "
        "set run.runs_root to a directory this user can write"
    )


def locate_data(cfg: JobConfig) -> str:
    if cfg.data.path != "demo":
        return cfg.data.path
    from dflash.data.demo import write_demo_corpus

    path = Path(cfg.run.runs_root) / ".demo" / "corpus.jsonl"
    if not path.exists():
        try:
            write_demo_corpus(path)
        except OSError as e:
            raise _runs_root_error(cfg, "write the demo corpus", path.parent, e) from None
    return str(path)


def open_target(cfg: JobConfig) -> tuple[str, Any, int]:
    """(target directory, tokenizer, mask token id): what the drafter side needs, without the data."""
    from dflash.data.tokenizer import load_tokenizer, require_mask_token

    target_path = locate_target(cfg)
    tok = load_tokenizer(cfg.data.tokenizer, target_path)
    return target_path, tok, require_mask_token(tok, cfg.drafter.mask_token_id)
