"""The job's side of the compile cache: where inductor/triton write, and whether the cache was warm.

One cache dir holds both caches: `<dir>/inductor` (TORCHINDUCTOR_CACHE_DIR) and `<dir>/triton`
(TRITON_CACHE_DIR): the layout `dflashctl warm-cache` snapshots and `dflashctl cache restore`
recreates. The job points at it with DFLASH_CACHE_DIR (or use_cache_dir) before anything compiles.
Never inductor's default /tmp/torchinductor_<user>: one `rm -rf` there cost the field 80% of its
throughput, and /tmp is shared by every user of the host.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

CACHE_DIR_ENV = "DFLASH_CACHE_DIR"
EXPECT_WARM_ENV = "DFLASH_EXPECT_WARM_CACHE"
RESTORED_NAME = "artifact.json"
"""Written by `dflashctl cache restore` into the cache dir: the artifact key it came from."""


def use_cache_dir(path: str | os.PathLike[str]) -> Path:
    """Point inductor and triton at <path>/inductor and <path>/triton (created 0700).

    Call before torch compiles anything: inductor reads the variables when it first needs a dir."""
    root = Path(path).expanduser().absolute()
    for sub in ("", "inductor", "triton"):
        d = root / sub if sub else root
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = d.stat()
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise PermissionError(
                f"{d} must be owned by you and not writable by others (a cache holds code); "
                f"run `chmod 700 {d}` or use another directory"
            )
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    os.environ[CACHE_DIR_ENV] = str(root)
    return root


def cache_dir_from_env() -> Path | None:
    """Apply DFLASH_CACHE_DIR if set (the runner sets it); returns the dir in use, if any."""
    value = os.environ.get(CACHE_DIR_ENV)
    return use_cache_dir(value) if value else None


def restored_artifact(cache_dir: Path | None) -> dict[str, Any] | None:
    """The artifact a restored cache dir came from ({key, config_name, ...}), for run.json."""
    if cache_dir is None:
        return None
    try:
        data = json.loads((cache_dir / RESTORED_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def warm_expected() -> bool:
    return os.environ.get(EXPECT_WARM_ENV) == "1"


def counters_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def compiled_event(seconds: float, delta: dict[str, int], **extra: Any) -> dict[str, Any]:
    """Fields of the `compiled` event for one first call of a shape."""
    return {
        "seconds": round(seconds, 3),
        "hits": delta.get("fxgraph_hits", 0) + delta.get("autograd_hits", 0),
        "misses": delta.get("fxgraph_misses", 0) + delta.get("autograd_misses", 0),
        "counters": delta,
        **extra,
    }


def expect_warm(
    delta: dict[str, int], *, expected: bool | None = None, **extra: Any
) -> dict[str, Any] | None:
    """Fields of a `cache_miss` event when a warm cache was expected but inductor compiled cold, else None."""
    if not (warm_expected() if expected is None else expected):
        return None
    misses = delta.get("fxgraph_misses", 0)
    if misses <= 0:
        return None
    return {
        "fxgraph_misses": misses,
        "autograd_misses": delta.get("autograd_misses", 0),
        "cache_dir": os.environ.get(CACHE_DIR_ENV) or os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "detail": "a warm compile cache was expected but inductor compiled cold: restore the artifact for "
        "this fingerprint (dflashctl cache restore) or warm one (dflashctl warm-cache)",
        **extra,
    }
