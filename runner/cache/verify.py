"""`cache verify`: re-check an artifact end to end by extracting it into a scratch dir."""

from __future__ import annotations

from runner.cache.archive import Limits, extract, verify_archive_hash
from runner.cache.leftovers import held_tempdir
from runner.cache.signing import Keyring, check_signature
from runner.cache.store import Artifact


def verify_artifact(art: Artifact, ring: Keyring, *, limits: Limits = Limits()) -> tuple[int, int, str]:
    """Raises on any mismatch; returns (files, bytes, signature status line)."""
    art.check_directory()
    verify_archive_hash(art.archive, art.manifest.archive)
    with held_tempdir(art.path.parent, ".verify-") as scratch:
        extract(art.archive, scratch, art.manifest.files, limits)
    status, detail = check_signature(art.manifest, ring)
    return len(art.manifest.files), art.manifest.files_size, f"{status} ({detail})"
