"""Whether this process can create a directory (or write in it), said in words before anything is made.

The runner's twin of dflash.rundir.unusable_reason (runner never imports dflash): `cache restore
--dest` and `dflashctl run`'s runs root use it. Mode bits cannot answer: access() says yes to root
everywhere, also under /sys and /proc, where mkdir fails all the same; so the nearest existing
ancestor is probed with a real temp dir, removed at once.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

NAME_MAX = 255
"""Bytes in one path component (file or directory name) on Linux filesystems."""


def long_name(name: str, limit: int = NAME_MAX) -> str | None:
    """The problem with a path component over `limit` bytes, in words; None when it fits."""
    size = len(os.fsencode(name))
    if size <= limit:
        return None
    shown = name if len(name) <= 24 else f"{name[:24]}..."
    return f"the name {shown!r} is {size} bytes, longer than the {limit} a name may have here"


def unusable_reason(path: str | Path, error: OSError | None = None) -> str | None:
    """Why this process cannot create directory `path` (or write in it); None when it can.

    error: what creating it raised, which then gives the reason; without one the nearest existing
    ancestor is probed with a temp dir removed at once."""
    p = Path(path).absolute()
    problem = next((q for q in map(long_name, p.parts) if q is not None), None)
    if problem is not None:
        return problem
    if error is not None and error.errno == errno.ENAMETOOLONG:
        return f"the path is too long for this filesystem ({len(os.fsencode(str(p)))} bytes)"
    for a in [*reversed(p.parents), p]:
        if not os.path.lexists(a):
            break
        if not os.path.isdir(a):
            return f"{a} is a file, not a directory"
    if error is not None:
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return f"{error.filename or p} is not writable by this user ({error.strerror})"
        where = f": {error.filename}" if error.filename else ""
        return f"{error.strerror or error}{where}"
    existing = next(a for a in (p, *p.parents) if os.path.lexists(a))
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".dflashctl-probe-"))
    except OSError as e:
        return f"{existing} is not writable by this user ({e.strerror})"
    return None
