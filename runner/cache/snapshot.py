"""Turn a warmed cache directory into a store artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runner import __version__
from runner.cache.archive import write_archive
from runner.cache.errors import ArtifactError
from runner.cache.manifest import ARCHIVE_NAME, MANIFEST_NAME, ArchiveInfo, Manifest
from runner.cache.signing import Keyring, sign
from runner.cache.store import Artifact, Store, now_iso
from runner.canonical import fingerprint_key

CACHE_ROOTS = ["inductor", "triton"]
"""Subdirectories of a cache dir: TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR (dflash.cache.job_side)."""


def snapshot(
    store: Store,
    cache_dir: Path,
    *,
    fingerprint: dict[str, Any],
    config_name: str,
    warm: dict[str, Any],
    ring: Keyring | None = None,
    locked: bool = False,
) -> Artifact:
    """Archive cache_dir's inductor/triton trees as the artifact for this fingerprint.

    With locked=True the caller already holds store.lock(key)."""
    key = fingerprint_key(fingerprint)
    if not any((cache_dir / r).is_dir() for r in CACHE_ROOTS):
        raise ArtifactError(
            f"{cache_dir} has no {' or '.join(CACHE_ROOTS)} directory: nothing was compiled "
            "there; check that the warm run compiled anything (attention.compile = true?)"
        )
    with store.staging() as stage:
        art_dir = stage / "artifact"
        art_dir.mkdir(mode=0o700)
        files, archive = write_archive(cache_dir, CACHE_ROOTS, art_dir / ARCHIVE_NAME)
        if not files:
            raise ArtifactError(f"{cache_dir} holds no cache files: nothing to snapshot")
        manifest = Manifest(
            key=key,
            fingerprint=fingerprint,
            files=files,
            archive=ArchiveInfo(sha256=archive.sha256, size=archive.size),
            created_at=now_iso(),
            tool_version=f"dflashctl {__version__}",
            config_name=config_name,
            warm=warm,
        )
        if ring is not None and ring.can_sign:
            manifest.signature = sign(manifest, ring)
        manifest.write(art_dir / MANIFEST_NAME)
        final = store.install_locked(art_dir, key) if locked else store.install(art_dir, key)
    return Artifact.load(final)
