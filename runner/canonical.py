"""Canonical JSON and hashing shared by every artifact check.

The job side (dflash/cache/fingerprint.py) spells the same canonical form; the two must agree byte for
byte, because the key of an artifact is sha256 of its fingerprint's canonical JSON.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


def canonical_json(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def fingerprint_key(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(fingerprint)).hexdigest()


def sha256_file(path: Path) -> tuple[str, int]:
    """(hex digest, size) of a file, read in chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as {dotted.key: leaf}, so two fingerprints can be compared field by field."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}
