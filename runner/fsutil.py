"""Filesystem primitives: private directories, file locks, atomic directory swaps."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from runner.errors import RunnerError

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def atomic_write_text(path: Path, text: str) -> None:
    """Temp file beside `path` (a unique name) + rename: readers see old or new content, never part,
    and a failed write leaves nothing behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def make_private_dir(path: Path) -> Path:
    """Create path (and parents) with mode 0700; an existing path must be ours and not writable by others."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private_dir(path)
    return path


def check_private_dir(path: Path) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise RunnerError(f"{path} is not a directory (or is a symbolic link); pass another directory")
    if st.st_uid != os.getuid():
        raise RunnerError(
            f"{path} is owned by uid {st.st_uid}, not by you; a cache holds code, so "
            "use a directory you own (e.g. the default under ~/.cache)"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RunnerError(
            f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"a cache holds code: run `chmod 700 {path}` or pick another directory"
        )
    # Anyone who can rename entries in an ancestor can swap our directory: require the sticky bit
    # on world-writable ancestors (as /tmp has), where only the owner may rename.
    for parent in path.resolve().parents:
        pst = os.stat(parent)
        if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
            raise RunnerError(
                f"{parent} (above {path}) is world-writable without the sticky bit; "
                "others could replace the cache: pick a directory under your home"
            )


@contextlib.contextmanager
def file_lock(path: Path, *, shared: bool = False) -> Iterator[None]:
    """flock on path (created 0600); released on exit, also when the process dies."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@functools.cache
def _renameat2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    # Looked up once: find_library runs `ldconfig -p`; libc is loaded in the process already anyway.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE). False where unsupported."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def replace_dir(new: Path, live: Path, aside: Path) -> Path | None:
    """Make `new` the directory at `live`; a non-empty old `live` ends up at `aside` (returned).

    With RENAME_EXCHANGE there is no moment without a usable `live`. Without it, there is a short
    window where `live` is missing but the old tree is already complete at `aside`.
    """
    if not os.path.lexists(live):
        os.rename(new, live)
        return None
    if live.is_dir() and not live.is_symlink() and not any(live.iterdir()):
        live.rmdir()
        os.rename(new, live)
        return None
    if exchange(new, live):
        os.rename(new, aside)
    else:
        os.rename(live, aside)
        os.rename(new, live)
    return aside
