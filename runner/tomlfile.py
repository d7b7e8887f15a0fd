"""Reading a TOML file the runner must understand (a job config's run.* keys, dflashctl's own config
file) with the job's checks (dflash.config.read_config_file): text that is not UTF-8, nesting too deep
for the parser, an integer past Python's digit limit, or a section that is not a table is one
BadInput line naming the file, what is wrong and what to do, never a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runner.envs import tomllib
from runner.errors import BadInput


def read_toml(path: Path, what: str = "config") -> dict[str, Any]:
    """The file's document; BadInput naming `what` and the file when it cannot be read as TOML."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise BadInput(
            f"{what} {path}: cannot be read ({e.strerror or e}); pass a readable TOML file"
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(
            f"{what} {path}: is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); save it as UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"{what} {path}: is not valid TOML: {e}") from None
    except RecursionError:
        raise BadInput(
            f"{what} {path}: is nested too deeply to read as TOML; flatten its arrays and tables"
        ) from None
    except ValueError:  # an integer past Python's int-string digit limit
        raise BadInput(
            f"{what} {path}: has an integer too long to read (over 4300 digits); shorten it"
        ) from None


def table(doc: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    """Section `name` of a document ({} when absent); BadInput when it is there but not a table."""
    value = doc.get(name, {})
    if not isinstance(value, dict):
        raise BadInput(
            f"{where}: [{name}] must be a table, got {type(value).__name__}: write it as a [{name}] section"
        )
    return value
