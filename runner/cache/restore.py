"""Restore an artifact into a live cache directory: trust, hashes, fingerprint, safe extract, swap.

Order matters: nothing is extracted before the signature policy, the archive hash and the
fingerprint all pass; extraction goes to a private temp dir beside dest; the live cache is
replaced by an atomic swap and the old one is kept at `<dest>.prev-<timestamp>`. Of those, the
newest `[cache] keep_previous` (default 2) stay and older ones are deleted; temp dirs that killed
restores left beside dest are deleted too. Both happen under dest's lock, which every restore into
dest holds from its first write to its last, so no restore in progress is touched.

Because the old dest is moved aside and later deleted, dest must be a cache: refused before
anything is read or written are the filesystem root, the current directory or a parent of it, and
an existing non-empty directory that is not a compile cache. A compile cache is a directory holding
the `artifact.json` a restore writes (a JSON object with the artifact's key), or only the
`inductor/` and `triton/` trees a job writes into DFLASH_CACHE_DIR. Only `<dest>.prev-<timestamp>`
copies that are such caches are ever deleted.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.cache.archive import Limits, extract, verify_archive_hash
from runner.cache.errors import FingerprintMismatchError, StoreInputError, UntrustedArtifactError
from runner.cache.leftovers import dest_lock_path, sweep_restore_temps_locked
from runner.cache.paths import NAME_MAX, long_name, unusable_reason
from runner.cache.settings import keep_previous as configured_keep_previous
from runner.cache.signing import Keyring, check_signature
from runner.cache.snapshot import CACHE_ROOTS
from runner.cache.store import Artifact, now_iso
from runner.canonical import HEX64, flatten
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
    """Where the previous cache went (None: there was none, or keep_previous is 0)."""
    signature: str
    differences: list[tuple[str, Any, Any]]
    """Fingerprint fields that differ (non-empty only under --force)."""
    swept: list[Path]
    """Temp dirs of killed restores and previous caches beyond keep_previous, deleted."""


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
    keep_previous: int | None = None,
) -> RestoreResult:
    """keep_previous: previous caches kept beside dest (None: `[cache] keep_previous`, default 2)."""
    keep = configured_keep_previous() if keep_previous is None else keep_previous
    if keep < 0:
        raise StoreInputError(f"keep_previous {keep}: must be >= 0")
    dest = check_dest(dest)
    art.check_directory()
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
    with contextlib.ExitStack() as held:
        try:  # check_dest probed the parent; this catches what changed since (or a racing chmod)
            dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            held.enter_context(file_lock(dest_lock_path(dest)))
        except OSError as e:
            raise StoreInputError(
                f"--dest {dest} cannot be used: {unusable_reason(dest.parent, e)}; pass another --dest"
            ) from None
        swept = sweep_restore_temps_locked(dest)
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
                        # The peak device memory warm-cache measured per planned shape: the job
                        # checks its placement and device against it before any worker starts.
                        "memory": art.manifest.warm.get("memory"),
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
        old_copies = [p for p in previous_copies(dest)[keep:] if is_cache_dir(p)]
        for old in old_copies:
            shutil.rmtree(old, ignore_errors=True)
        swept += old_copies
        if moved in old_copies:
            moved = None
    check_private_dir(dest)
    return RestoreResult(
        dest=dest,
        key=art.key,
        files=len(art.manifest.files),
        bytes=art.manifest.files_size,
        moved_aside=moved,
        signature=sig_status,
        differences=diffs,
        swept=swept,
    )


def previous_copies(dest: Path) -> list[Path]:
    """dest's previous caches, newest first (the timestamp in the name sorts as the time does)."""
    pattern = re.compile(rf"^{re.escape(dest.name)}\.prev-\d{{8}}-\d{{6}}-\d{{6}}$")
    found = [p for p in dest.parent.iterdir() if pattern.match(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: p.name, reverse=True)


PREV_ROOM = len(".prev-20250101-000000-000000")
"""Bytes a restore adds to dest's name for the copy it moves aside: dest's name must leave room."""


def is_cache_dir(path: Path) -> bool:
    """Whether directory `path` is a compile cache (a restore's or a job's) or empty: the only
    directories a restore may move aside and, later, delete."""
    try:
        names = {entry.name for entry in path.iterdir()}
    except OSError:
        return False
    if names <= set(CACHE_ROOTS):
        return True
    if RESTORED_NAME not in names:
        return False
    try:
        record = json.loads((path / RESTORED_NAME).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(record, dict) and isinstance(record.get("key"), str) and bool(HEX64.match(record["key"]))
    )


def check_dest(dest: Path) -> Path:
    """dest as an absolute, normalized path, or StoreInputError when a restore there could harm
    anything but a cache, or could not write there; nothing is created or changed."""
    given = str(dest)
    path = Path(os.path.normpath(dest.expanduser().absolute()))

    def refused(
        why: str, fix: str = "pass the cache directory itself, e.g. ~/.cache/dflash/compile"
    ) -> StoreInputError:
        shown = repr(given) if given == str(path) else f"{given!r} ({path})"
        return StoreInputError(f"--dest {shown} {why}; {fix}")

    # Names first: stat() on a name over NAME_MAX fails (ENAMETOOLONG) instead of saying "absent".
    problem = next((q for q in map(long_name, path.parent.parts) if q is not None), None)
    if problem is not None:
        raise refused(f"cannot be used: {problem}", "pass a shorter path")
    problem = long_name(path.name, NAME_MAX - PREV_ROOM)
    if problem is not None:
        why = f"cannot be used: {problem} (a restore keeps the old cache as <dest>.prev-<time>)"
        raise refused(why, "pass a shorter name")
    if path == Path(path.anchor):
        raise refused("is the filesystem root: a restore moves dest aside and deletes old copies")
    with contextlib.suppress(OSError):  # a cwd that was deleted is no parent of anything
        cwd, real = Path.cwd().resolve(), path.resolve()
        if real == cwd or real in cwd.parents:
            where = (
                "is the current directory" if real == cwd else f"is a parent of the current directory {cwd}"
            )
            raise refused(f"{where}: a restore would move it aside")
    if os.path.lexists(path) and not path.is_dir():
        raise refused("exists and is not a directory", "pass a directory (or a new path)")
    if path.is_dir() and not is_cache_dir(path):
        raise refused(
            f"is a non-empty directory that is not a compile cache (no {RESTORED_NAME} from a restore, "
            f"and entries other than {' and '.join(CACHE_ROOTS)}): a restore would move it aside and "
            "later delete it",
            "pass a new or empty directory, or one a restore made",
        )
    problem = unusable_reason(path.parent)
    if problem is not None:
        raise refused(f"cannot be used: {problem}", "pass another --dest")
    return path
