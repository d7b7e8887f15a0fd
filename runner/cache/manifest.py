"""The artifact manifest: what an artifact promises, checked field by field when read.

Layout of one artifact: `<store>/<key>/manifest.json` + `<store>/<key>/cache.tar.zst`, and for
artifacts pulled from elsewhere an `origin.json` beside them (not signed: it only ever lowers trust).
"""

from __future__ import annotations

import json
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.cache.errors import ArtifactError, BrokenArtifactError, UnsafeArchiveError
from runner.canonical import HEX64, canonical_json, fingerprint_key
from runner.fsutil import atomic_write_text

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
ARCHIVE_NAME = "cache.tar.zst"
ORIGIN_NAME = "origin.json"
NAME_MAX = 255
"""Bytes per path component on Linux filesystems; longer names cannot be created anywhere."""
PATH_MAX = 3072
"""Bytes per member path: below Linux's 4096, leaving room for the destination directory."""
MANIFEST_MAX_BYTES = 1 << 30
"""A million files (the extraction cap) take ~250 MB of manifest; anything far larger is not one."""
MAX_DEPTH = 64
"""Nesting depth allowed in the fingerprint and warm statistics (real ones nest 4 deep)."""


def check_member_path(path: str) -> str:
    """A relative, normalized POSIX path with no '..': the only names an archive may hold."""
    if not isinstance(path, str) or not path:
        raise UnsafeArchiveError(f"empty or non-string path {path!r} in the artifact")
    if path.startswith("/"):
        raise UnsafeArchiveError(f"absolute path {path!r} in the artifact: refused")
    if "\0" in path:
        raise UnsafeArchiveError(f"path {path!r} with a NUL byte in the artifact: refused")
    try:
        raw = path.encode()
    except UnicodeEncodeError:
        raise UnsafeArchiveError(f"path {path!r} is not valid UTF-8: refused") from None
    if len(raw) > PATH_MAX or any(len(p.encode()) > NAME_MAX for p in path.split("/")):
        raise UnsafeArchiveError(
            f"path {path[:80]!r}... is too long (a name over {NAME_MAX} bytes or a path over "
            f"{PATH_MAX}): no cache writes such names; refused"
        )
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafeArchiveError(f"path {path!r} is not normalized or climbs out with '..': refused")
    return path


@dataclass(kw_only=True, slots=True)
class FileEntry:
    path: str
    sha256: str
    size: int
    mode: int


@dataclass(kw_only=True, slots=True)
class ArchiveInfo:
    sha256: str
    size: int


@dataclass(kw_only=True, slots=True)
class Signature:
    alg: str
    """hmac-sha256 | ed25519"""
    key_id: str
    value: str


@dataclass(kw_only=True, slots=True)
class Manifest:
    key: str
    fingerprint: dict[str, Any]
    files: list[FileEntry]
    archive: ArchiveInfo
    created_at: str
    tool_version: str
    config_name: str
    warm: dict[str, Any] = field(default_factory=dict)
    """Warm statistics: per-shape compile seconds and cache counters."""
    format: int = FORMAT_VERSION
    signature: Signature | None = None

    @property
    def files_size(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self, *, with_signature: bool = True) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": self.format,
            "key": self.key,
            "fingerprint": self.fingerprint,
            "files": [
                {"path": f.path, "sha256": f.sha256, "size": f.size, "mode": f.mode} for f in self.files
            ],
            "archive": {"sha256": self.archive.sha256, "size": self.archive.size},
            "created_at": self.created_at,
            "tool_version": self.tool_version,
            "config_name": self.config_name,
            "warm": self.warm,
        }
        if with_signature and self.signature is not None:
            data["signature"] = {
                "alg": self.signature.alg,
                "key_id": self.signature.key_id,
                "value": self.signature.value,
            }
        return data

    def signing_payload(self) -> bytes:
        """What a signature covers: the canonical manifest without its signature."""
        return canonical_json(self.to_dict(with_signature=False))

    def write(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")

    @classmethod
    def read(cls, path: Path) -> Manifest:
        def broken(problem: str) -> BrokenArtifactError:
            return BrokenArtifactError(
                f"{path} {problem}: the artifact is corrupt; delete its directory or pull it again "
                "(cache pull --force)"
            )

        try:
            st = path.stat()
            if stat.S_ISDIR(st.st_mode):
                raise broken("is a directory, not a file")
            if not stat.S_ISREG(st.st_mode):  # a FIFO or a device would block or never end
                raise broken("is not a regular file")
            if st.st_size > MANIFEST_MAX_BYTES:
                raise broken(f"is over {MANIFEST_MAX_BYTES >> 20} MiB, far larger than any manifest")
            text = path.read_text()
        except FileNotFoundError:
            raise BrokenArtifactError(
                f"{path} not found: not an artifact directory; delete it or pull the artifact again"
            ) from None
        except UnicodeDecodeError:
            raise broken("is not UTF-8 text") from None
        except OSError as e:
            raise broken(f"cannot be read ({e.strerror})") from None
        try:
            data = json.loads(text, parse_constant=_no_constant)
        except ValueError as e:  # not JSON, NaN or Infinity, an integer past Python's digit limit
            raise broken(f"is not valid JSON ({e})") from None
        except RecursionError:
            raise broken("nests too deeply to be a manifest") from None
        return cls.from_dict(data, where=str(path))

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "manifest") -> Manifest:
        def bad(problem: str) -> BrokenArtifactError:
            return BrokenArtifactError(f"{where}: {problem}; the artifact is corrupt or tampered with")

        if not isinstance(data, dict):
            raise bad("not a JSON object")
        fmt = data.get("format")
        # bool is an int subclass and `True == 1`: a manifest saying `"format": true` is not format 1.
        if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt != FORMAT_VERSION:
            raise ArtifactError(
                f"{where}: artifact format {fmt!r}, this dflashctl reads format "
                f"{FORMAT_VERSION}; use a matching dflashctl version"
            )
        required = ("key", "fingerprint", "files", "archive", "created_at", "tool_version", "config_name")
        missing = [k for k in required if k not in data]
        if missing:
            raise bad(f"missing {', '.join(missing)}")
        key, fingerprint = data["key"], data["fingerprint"]
        if not isinstance(key, str) or not HEX64.match(key):
            raise bad(f"key {key!r} is not a sha256 hex digest")
        if not isinstance(fingerprint, dict):
            raise bad("fingerprint is not an object")
        for name in ("fingerprint", "warm"):
            if _depth(data.get(name)) > MAX_DEPTH:
                raise bad(f"{name} nests more than {MAX_DEPTH} levels deep")
        try:
            computed = fingerprint_key(fingerprint)
        except ValueError as e:  # a float that JSON cannot carry
            raise bad(f"fingerprint is not canonical JSON ({e})") from None
        if computed != key:
            raise bad("key is not the sha256 of the fingerprint")
        files = []
        seen: set[str] = set()
        if not isinstance(data["files"], list):
            raise bad("files is not a list")
        for item in data["files"]:
            if not isinstance(item, dict):
                raise bad("a files entry is not an object")
            path = check_member_path(item.get("path"))  # type: ignore[arg-type]
            if path in seen:
                raise bad(f"{path} is listed twice")
            seen.add(path)
            sha, size, mode = item.get("sha256"), item.get("size"), item.get("mode")
            if not isinstance(sha, str) or not HEX64.match(sha):
                raise bad(f"{path}: sha256 {sha!r} is not a hex digest")
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise bad(f"{path}: size {size!r} is not a non-negative integer")
            if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o7777:
                raise bad(f"{path}: mode {mode!r} is not a permission mode")
            files.append(FileEntry(path=path, sha256=sha, size=size, mode=mode))
        archive = data["archive"]
        if (
            not isinstance(archive, dict)
            or not isinstance(archive.get("sha256"), str)
            or not HEX64.match(archive["sha256"])
            or not isinstance(archive.get("size"), int)
            or isinstance(archive["size"], bool)
            or archive["size"] < 0
        ):
            raise bad("archive must be {sha256, size}")
        for k in ("created_at", "tool_version", "config_name"):
            if not isinstance(data[k], str):
                raise bad(f"{k} is not a string")
        warm = data.get("warm", {})
        if not isinstance(warm, dict):
            raise bad("warm is not an object")
        signature = None
        if data.get("signature") is not None:
            sig = data["signature"]
            if not isinstance(sig, dict) or not all(
                isinstance(sig.get(k), str) for k in ("alg", "key_id", "value")
            ):
                raise bad("signature must be {alg, key_id, value} strings")
            signature = Signature(alg=sig["alg"], key_id=sig["key_id"], value=sig["value"])
        return cls(
            key=key,
            fingerprint=fingerprint,
            files=files,
            archive=ArchiveInfo(sha256=archive["sha256"], size=archive["size"]),
            created_at=data["created_at"],
            tool_version=data["tool_version"],
            config_name=data["config_name"],
            warm=warm,
            format=fmt,
            signature=signature,
        )


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _depth(value: Any) -> int:
    """How deeply value nests (iterative: the value may be nested past Python's recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if level > MAX_DEPTH:
                return level
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest
