"""Builders for compile-cache tests: cache trees, artifacts, and hand-made (hostile) archives."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import zstandard

from runner.cache.manifest import ARCHIVE_NAME, MANIFEST_NAME, ArchiveInfo, FileEntry, Manifest
from runner.cache.signing import Keyring, sign
from runner.cache.snapshot import snapshot
from runner.cache.store import Store
from runner.canonical import fingerprint_key, sha256_file


def fingerprint(tag: str = "a") -> dict[str, Any]:
    return {
        "format": 1,
        "env": {
            "python": "3.11.7",
            "torch": "2.13.0+cpu",
            "triton": None,
            "device_type": "cpu",
            "gpus": [],
            "cpu_isa": "avx2",
        },
        "job": {"shapes": [[8, 256]], "tag": tag},
        "sources": {"model.py": "0" * 64},
    }


def make_cache_tree(root: Path, seed: str = "x") -> Path:
    """A directory shaped like an inductor + triton cache (names and nesting as inductor writes them)."""
    files = {
        "inductor/fxgraph/r4/fr4abc/entry": f"graph {seed}".encode() * 50,
        "inductor/aotautograd/a56/fz/entry": f"aot {seed}".encode() * 20,
        "inductor/g4/cg4f.main.cpp": f"// kernel {seed}\n".encode(),
        "inductor/g4/cg4f.main.so": os.urandom(2048),
        "triton/ab/kernel.json": b"{}",
    }
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    os.chmod(root / "inductor/g4/cg4f.main.so", 0o755)
    return root


def make_artifact(store: Store, tmp: Path, tag: str = "a", ring: Keyring | None = None) -> Any:
    tree = make_cache_tree(tmp / f"tree-{tag}", seed=tag)
    return snapshot(
        store,
        tree,
        fingerprint=fingerprint(tag),
        config_name=f"cfg-{tag}",
        warm={"seconds": 1.5, "shapes": []},
        ring=ring,
    )


def write_hostile(
    dest: Path,
    members: list[tuple[tarfile.TarInfo, bytes | None]],
    *,
    manifest_files: list[FileEntry] | None = None,
    tag: str = "h",
    ring: Keyring | None = None,
) -> Path:
    """An artifact dir whose manifest honestly describes a malicious archive (hashes all match),
    so only the extraction checks stand between it and the filesystem."""
    dest.mkdir(parents=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    (dest / ARCHIVE_NAME).write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    if manifest_files is None:
        manifest_files = [
            FileEntry(
                path=i.name, sha256=hashlib.sha256(d or b"").hexdigest(), size=len(d or b""), mode=0o644
            )
            for i, d in members
            if i.isreg()
        ]
    sha, size = sha256_file(dest / ARCHIVE_NAME)
    fp = fingerprint(tag)
    m = Manifest(
        key=fingerprint_key(fp),
        fingerprint=fp,
        files=manifest_files,
        archive=ArchiveInfo(sha256=sha, size=size),
        created_at="2025-01-01T00:00:00Z",
        tool_version="test",
        config_name="hostile",
    )
    if ring is not None:
        m.signature = sign(m, ring)
    (dest / MANIFEST_NAME).write_text(json.dumps(m.to_dict()))
    return dest


def tree_listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}
