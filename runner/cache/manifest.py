"""The artifact manifest: what an artifact promises, checked field by field when read.

Layout of one artifact: `<store>/<key>/manifest.json` + `<store>/<key>/cache.tar.zst`, and for
artifacts pulled from elsewhere an `origin.json` beside them (not signed: it only ever lowers trust).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.cache.errors import ArtifactError, UnsafeArchiveError
from runner.canonical import HEX64, canonical_json, fingerprint_key
from runner.fsutil import atomic_write_text

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
ARCHIVE_NAME = "cache.tar.zst"
ORIGIN_NAME = "origin.json"


def check_member_path(path: str) -> str:
    """A relative, normalized POSIX path with no '..': the only names an archive may hold."""
    if not isinstance(path, str) or not path:
        raise UnsafeArchiveError(f"empty or non-string path {path!r} in the artifact")
    if path.startswith("/"):
        raise UnsafeArchiveError(f"absolute path {path!r} in the artifact: refused")
    if "\0" in path:
        raise UnsafeArchiveError(f"path {path!r} with a NUL byte in the artifact: refused")
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
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ArtifactError(f"{path} not found: not an artifact directory") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArtifactError(
                f"{path} is not valid JSON ({e}): the artifact is corrupt; delete it or pull it again"
            ) from None
        return cls.from_dict(data, where=str(path))

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "manifest") -> Manifest:
        def bad(problem: str) -> ArtifactError:
            return ArtifactError(f"{where}: {problem}; the artifact is corrupt or tampered with")

        if not isinstance(data, dict):
            raise bad("not a JSON object")
        fmt = data.get("format")
        if fmt != FORMAT_VERSION:
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
        if fingerprint_key(fingerprint) != key:
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
