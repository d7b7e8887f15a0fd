"""The `[cache]` table of dflashctl's config file, `~/.config/dflashctl/config.toml` (respecting
XDG_CONFIG_HOME). Settings besides the signing keys (runner/cache/signing.py):

    [cache]
    keep_previous = 2   # restore keeps the last N previous caches as <dest>.prev-<timestamp>; 0 keeps none
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from runner.errors import BadInput
from runner.tomlfile import read_toml

DEFAULT_KEEP_PREVIOUS = 2


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dflashctl" / "config.toml"


def cache_table(path: Path | None = None) -> dict[str, Any]:
    """The [cache] table ({} without a config file); a file that is not TOML is refused."""
    return config_table("cache", path)


def config_table(name: str, path: Path | None = None) -> dict[str, Any]:
    """A table of dflashctl's config file ({} without the file or the table); a file that is not
    TOML, or a `name` that is not a table, is refused naming the file."""
    cfg_file = path or config_path()
    if not cfg_file.is_file():
        return {}
    try:
        table = read_toml(cfg_file, "dflashctl's config file").get(name, {})
    except BadInput as e:
        raise BadInput(f"{e}; or move it aside") from None
    if not isinstance(table, dict):
        raise BadInput(f"{cfg_file}: `{name}` must be a table ([{name}]), not {type(table).__name__}")
    return dict(table)


def keep_previous(path: Path | None = None) -> int:
    value = cache_table(path).get("keep_previous", DEFAULT_KEEP_PREVIOUS)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadInput(
            f"[cache] keep_previous = {value!r} in {path or config_path()}: use a whole number >= 0 "
            f"(previous caches a restore keeps; default {DEFAULT_KEEP_PREVIOUS})"
        )
    return value
