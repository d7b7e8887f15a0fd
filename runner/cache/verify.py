"""`cache verify`: re-check an artifact end to end by extracting it into a scratch dir."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from runner.cache.archive import Limits, extract, verify_archive_hash
from runner.cache.signing import Keyring, check_signature
from runner.cache.store import Artifact


def verify_artifact(art: Artifact, ring: Keyring, *, limits: Limits = Limits()) -> tuple[int, int, str]:
    """Raises on any mismatch; returns (files, bytes, signature status line)."""
    verify_archive_hash(art.archive, art.manifest.archive)
    scratch = Path(tempfile.mkdtemp(prefix=".verify-", dir=art.path.parent))
    try:
        extract(art.archive, scratch, art.manifest.files, limits)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    status, detail = check_signature(art.manifest, ring)
    return len(art.manifest.files), art.manifest.files_size, f"{status} ({detail})"
