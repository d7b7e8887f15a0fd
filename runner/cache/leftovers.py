"""Temp directories that killed processes leave behind, and how to tell them from ones in use.

Every temp dir this package makes is held while in use: a store temp dir (`.tmp-*`, `.verify-*`)
by a shared flock on the directory itself, a restore temp dir (`.<dest>.restore-*`) by the
exclusive flock on `.<dest>.lock` that its restore holds throughout. The kernel drops a flock when
its process dies, so a sweeper that can take the lock knows the creator is gone: no pid files, no
guessing from ages. Age only decides where the filesystem cannot lock a directory (some network
filesystems): such a dir must be older than UNLOCKABLE_AGE_S.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

GRACE_S = 60.0
"""A store temp dir is made a moment before it is locked: younger ones are never swept."""
UNLOCKABLE_AGE_S = 24 * 3600.0
STORE_TEMP = re.compile(r"^\.(?:tmp|verify)-")
STORE_TRASH = re.compile(r"^\.(?:old|trash)-[0-9a-f]{64}-[0-9]+$")
"""Dirs on their way out (replaced or removed artifacts): their creator deletes them at once."""
_MKDTEMP_SUFFIX = r"[a-z0-9_]{8}"


@contextlib.contextmanager
def held_tempdir(parent: Path, prefix: str) -> Iterator[Path]:
    """A private temp dir in parent, locked until the block ends and then deleted."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with contextlib.suppress(OSError):  # unlockable here: sweepers fall back to its age
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)


def _age_s(path: Path) -> float:
    try:
        return time.time() - os.lstat(path).st_mtime
    except OSError:
        return 0.0


def _dir_in_use(path: Path) -> bool | None:
    """True if a live process holds path's lock, False if none does, None if it cannot be told."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # closing drops the lock we may have taken
    return False


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def sweep_store(root: Path, *, dry_run: bool = False) -> list[Path]:
    """Remove the store's temp dirs whose creators are gone; returns what was (or would be) removed."""
    if not root.is_dir():
        return []
    gone = []
    for entry in sorted(root.iterdir()):
        if STORE_TRASH.match(entry.name):
            stale = _age_s(entry) > GRACE_S
        elif STORE_TEMP.match(entry.name):
            age = _age_s(entry)
            in_use = _dir_in_use(entry) if age > GRACE_S else True
            stale = in_use is False or (in_use is None and age > UNLOCKABLE_AGE_S)
        else:
            continue
        if stale:
            gone.append(entry)
            if not dry_run:
                _remove(entry)
    return gone


def restore_temp_pattern(dest_name: str) -> re.Pattern[str]:
    """Names of restore temp dirs for one destination (exactly mkdtemp's 8 characters, so the temp
    dirs of a destination named `cache.restore-x` never match those of `cache`)."""
    return re.compile(rf"^\.{re.escape(dest_name)}\.restore-{_MKDTEMP_SUFFIX}$")


def dest_lock_path(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.lock"


def sweep_restore_temps_locked(dest: Path) -> list[Path]:
    """For a caller holding dest's lock: every restore temp dir of dest is a killed restore's."""
    pattern = restore_temp_pattern(dest.name)
    gone = [p for p in sorted(dest.parent.iterdir()) if pattern.match(p.name)]
    for p in gone:
        _remove(p)
    return gone


_ANY_RESTORE_TEMP = re.compile(rf"^\.(?P<dest>.+)\.restore-{_MKDTEMP_SUFFIX}$")


def sweep_restore_temps(directory: Path, *, dry_run: bool = False) -> list[Path]:
    """Restore temp dirs in directory whose restore is gone (its destination's lock is free)."""
    if not directory.is_dir():
        return []
    gone = []
    for entry in sorted(directory.iterdir()):
        m = _ANY_RESTORE_TEMP.match(entry.name)
        if not m:
            continue
        with try_lock(dest_lock_path(directory / m.group("dest"))) as free:
            if free:
                gone.append(entry)
                if not dry_run:
                    _remove(entry)
    return gone


@contextlib.contextmanager
def try_lock(path: Path) -> Iterator[bool]:
    """The exclusive flock on path if nobody holds it (yields True, held until the block ends)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
