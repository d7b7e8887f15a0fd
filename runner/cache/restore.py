"""Restore an artifact into a live cache directory: trust, hashes, fingerprint, safe extract, swap.

Order matters: nothing is extracted before the signature policy, the archive hash and the
fingerprint all pass; extraction goes to a private temp dir beside dest; the live cache is
replaced by an atomic swap and the old one is kept at `<dest>.prev-<timestamp>`, never deleted.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.cache.archive import Limits, extract, verify_archive_hash
from runner.cache.errors import FingerprintMismatchError, UntrustedArtifactError
from runner.cache.signing import Keyring, check_signature
from runner.cache.store import Artifact, now_iso
from runner.canonical import flatten
from runner.fsutil import check_private_dir, file_lock, replace_dir

RESTORED_NAME = "artifact.json"
"""Written into a restored cache dir: which artifact it came from (the job records it in run.json)."""


@dataclass(kw_only=True, slots=True)
class RestoreResult:
    dest: Path
    key: str
    files: int
    bytes: int
    moved_aside: Path | None
    signature: str
    differences: list[tuple[str, Any, Any]]
    """Fingerprint fields that differ (non-empty only under --force)."""


def trust_check(art: Artifact, ring: Keyring, *, trust: bool) -> str:
    """Apply the signature policy; returns the signature status line. Raises unless trusted."""
    status, detail = check_signature(art.manifest, ring)
    if trust:
        return f"{status} ({detail}); accepted by --trust"
    if status == "invalid":
        raise UntrustedArtifactError(
            f"artifact {art.key[:16]}: {detail}. A cache is code: refusing it. "
            "Pull it again from a store you trust, or pass --trust if you know why"
        )
    if art.origin is not None and status != "valid":
        where = art.origin.get("remote") or art.origin.get("path") or "elsewhere"
        raise UntrustedArtifactError(
            f"artifact {art.key[:16]} came from {where} and is {status} ({detail}). A cache is code "
            "(pickled graphs, kernels): configure the signing key it was signed with "
            "(DFLASH_CACHE_SIGNING_KEY or [cache] signing_key), or pass --trust to accept it anyway"
        )
    return f"{status} ({detail})"


def fingerprint_differences(want: dict[str, Any], have: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Fields whose values differ, over the fields both sides report (a side may omit the job part)."""
    a, b = flatten(want), flatten(have)
    top_have = {k.split(".", 1)[0] for k in b}
    out = []
    for k in sorted(set(a) | set(b)):
        if k.split(".", 1)[0] not in top_have:
            continue  # the destination did not report this section (e.g. no config given)
        if a.get(k, "<absent>") != b.get(k, "<absent>"):
            out.append((k, a.get(k, "<absent>"), b.get(k, "<absent>")))
    return out


def format_differences(diffs: list[tuple[str, Any, Any]]) -> str:
    return "\n".join(f"  {k}: artifact {json.dumps(a)} != destination {json.dumps(b)}" for k, a, b in diffs)


def restore(
    art: Artifact,
    dest: Path,
    *,
    dest_fingerprint: dict[str, Any] | None,
    ring: Keyring,
    force: bool = False,
    trust: bool = False,
    limits: Limits = Limits(),
) -> RestoreResult:
    sig_status = trust_check(art, ring, trust=trust)
    verify_archive_hash(art.archive, art.manifest.archive)
    diffs: list[tuple[str, Any, Any]] = []
    if dest_fingerprint is not None:
        diffs = fingerprint_differences(art.manifest.fingerprint, dest_fingerprint)
        if diffs and not force:
            raise FingerprintMismatchError(
                f"artifact {art.key[:16]} was compiled for a different environment/config; "
                f"{len(diffs)} field(s) differ:\n{format_differences(diffs)}\n"
                "Warm a cache for this environment (`dflashctl warm-cache`), or pass --force to restore anyway",
                diffs,
            )
    dest = dest.expanduser().absolute()
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with file_lock(dest.parent / f".{dest.name}.lock"):
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.restore-", dir=dest.parent))
        try:
            extract(art.archive, tmp, art.manifest.files, limits)
            # The manifest might have changed between the hash check and now only if the store was
            # modified under us: re-check the archive we actually extracted from.
            verify_archive_hash(art.archive, art.manifest.archive)
            (tmp / RESTORED_NAME).write_text(
                json.dumps(
                    {
                        "key": art.key,
                        "config_name": art.manifest.config_name,
                        "restored_at": now_iso(),
                        "from": str(art.path),
                        "signature": sig_status,
                        "forced_differences": [d[0] for d in diffs],
                    },
                    indent=1,
                )
                + "\n"
            )
            stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
            moved = replace_dir(tmp, dest, dest.with_name(f"{dest.name}.prev-{stamp}"))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    check_private_dir(dest)
    return RestoreResult(
        dest=dest,
        key=art.key,
        files=len(art.manifest.files),
        bytes=art.manifest.files_size,
        moved_aside=moved,
        signature=sig_status,
        differences=diffs,
    )
