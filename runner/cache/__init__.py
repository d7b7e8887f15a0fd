"""Compile caches as versioned artifacts: store, snapshot, verify, restore, push/pull, warm.

Never imports torch: everything that needs torch runs as `python -m dflash.<entry>` in the
environment that uses the cache (see runner/cache/target.py). Layout and trust model:
docs/compile-cache.md.
"""

from runner.cache.archive import Limits
from runner.cache.errors import (
    ArtifactError,
    FingerprintMismatchError,
    IntegrityError,
    UnsafeArchiveError,
    UntrustedArtifactError,
)
from runner.cache.manifest import Manifest
from runner.cache.restore import RestoreResult, restore
from runner.cache.store import Artifact, Store, default_store_root
from runner.cache.verify import verify_artifact

__all__ = [
    "Artifact",
    "ArtifactError",
    "FingerprintMismatchError",
    "IntegrityError",
    "Limits",
    "Manifest",
    "RestoreResult",
    "Store",
    "UnsafeArchiveError",
    "UntrustedArtifactError",
    "default_store_root",
    "restore",
    "verify_artifact",
]
