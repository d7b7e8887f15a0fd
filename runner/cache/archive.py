"""The artifact archive: a cache tree as tar + zstd, written deterministically and read defensively.

Reading never trusts the archive: every member must be a regular file (or a directory) with a
normalized relative name that the manifest lists, within size and count caps, and its bytes must
hash to the manifest's sha256. Links of any kind, device files and FIFOs are refused outright:
an inductor/triton cache holds none, so refusing them costs nothing and removes every link trick.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import zstandard

from runner.cache.errors import ArtifactError, IntegrityError, UnsafeArchiveError
from runner.cache.manifest import ArchiveInfo, FileEntry, check_member_path
from runner.canonical import sha256_file

_CHUNK = 1 << 20
GiB = 1 << 30


@dataclass(kw_only=True, slots=True, frozen=True)
class Limits:
    """Caps on what one extraction may write (a zstd archive can expand enormously)."""

    max_total_bytes: int = 64 * GiB
    max_file_bytes: int = 16 * GiB
    max_members: int = 1_000_000


class _HashingReader:
    """Feeds tarfile while hashing, so a file is read once to both archive and hash it."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.sha = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.sha.update(data)
        return data


def _walk_files(src: Path, roots: list[str]) -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    for root in roots:
        top = src / root
        if not top.exists():
            continue
        for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                full = Path(dirpath) / name
                st = os.lstat(full)
                rel = full.relative_to(src).as_posix()
                if stat.S_ISDIR(st.st_mode):
                    continue
                if not stat.S_ISREG(st.st_mode):
                    raise ArtifactError(
                        f"{full} is not a regular file (a link or device): a compile "
                        "cache should hold none; remove it and warm again"
                    )
                out.append((rel, full))
    return out


def write_archive(
    src: Path,
    roots: list[str],
    archive: Path,
) -> tuple[list[FileEntry], ArchiveInfo]:
    """Archive the regular files under src/<root> for each root; returns the manifest entries."""
    entries: list[FileEntry] = []
    cctx = zstandard.ZstdCompressor(level=10)
    with (
        open(archive, "wb") as raw,
        cctx.stream_writer(raw, closefd=False) as zw,
        tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar,
    ):
        for rel, full in _walk_files(src, roots):
            st = os.stat(full)
            info = tarfile.TarInfo(rel)
            info.size = st.st_size
            info.mode = stat.S_IMODE(st.st_mode) & 0o755
            info.mtime = 0  # the same tree gives the same archive
            with open(full, "rb") as f:
                reader = _HashingReader(f)
                tar.addfile(info, reader)  # type: ignore[arg-type]
            entries.append(
                FileEntry(path=rel, sha256=reader.sha.hexdigest(), size=st.st_size, mode=info.mode)
            )
    sha, size = sha256_file(archive)
    return entries, ArchiveInfo(sha256=sha, size=size)


def verify_archive_hash(archive: Path, expected: ArchiveInfo) -> None:
    if not archive.is_file():
        raise IntegrityError(f"{archive} is missing: the artifact is incomplete; pull or warm it again")
    sha, size = sha256_file(archive)
    if size != expected.size or sha != expected.sha256:
        raise IntegrityError(
            f"{archive.name}: sha256 {sha[:16]}... ({size} bytes) does not match the "
            f"manifest's {expected.sha256[:16]}... ({expected.size} bytes): tampered, "
            "truncated or corrupt; delete the artifact and pull or warm it again"
        )


_KIND = {
    tarfile.SYMTYPE: "a symbolic link",
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a FIFO",
}


def _safe_parent(dest: Path, rel: str) -> Path:
    """Create the directories of rel under dest one by one, refusing anything that is not a plain dir."""
    cur = dest
    for part in rel.split("/")[:-1]:
        cur = cur / part
        try:
            os.mkdir(cur, 0o700)
        except FileExistsError:
            st = os.lstat(cur)
            if not stat.S_ISDIR(st.st_mode):
                raise UnsafeArchiveError(f"{rel}: {part} is not a directory in the extracted tree") from None
    return cur


def extract(archive: Path, dest: Path, files: list[FileEntry], limits: Limits = Limits()) -> None:
    """Extract into the existing empty directory dest, checking each member against `files`."""
    expected = {f.path: f for f in files}
    seen: set[str] = set()
    total = 0
    count = 0
    try:
        with (
            open(archive, "rb") as raw,
            zstandard.ZstdDecompressor().stream_reader(raw) as zr,
            tarfile.open(fileobj=zr, mode="r|") as tar,
        ):
            for member in tar:
                count += 1
                if count > limits.max_members:
                    raise UnsafeArchiveError(f"more than {limits.max_members} members: refused")
                name = check_member_path(member.name.removesuffix("/") if member.isdir() else member.name)
                if member.isdir():
                    _safe_parent(dest, name + "/x")
                    continue
                if not member.isreg():
                    kind = _KIND.get(member.type, f"a special member (type {member.type!r})")
                    target = f" -> {member.linkname}" if member.issym() or member.islnk() else ""
                    raise UnsafeArchiveError(
                        f"{name} is {kind}{target}: archives may hold only regular files; refused"
                    )
                entry = expected.get(name)
                if entry is None:
                    raise UnsafeArchiveError(f"{name} is in the archive but not in the manifest: refused")
                if name in seen:
                    raise UnsafeArchiveError(f"{name} appears twice in the archive: refused")
                seen.add(name)
                if member.size > limits.max_file_bytes:
                    raise UnsafeArchiveError(
                        f"{name} is {member.size} bytes, over the per-file cap of "
                        f"{limits.max_file_bytes}: refused"
                    )
                total += member.size
                if total > limits.max_total_bytes:
                    raise UnsafeArchiveError(
                        f"the archive expands past the total cap of {limits.max_total_bytes} bytes: refused"
                    )
                if member.size != entry.size:
                    raise IntegrityError(
                        f"{name}: {member.size} bytes in the archive, {entry.size} in the "
                        "manifest: tampered or corrupt"
                    )
                parent = _safe_parent(dest, name)
                src = tar.extractfile(member)
                assert src is not None  # a regular member always has data
                h = hashlib.sha256()
                fd = os.open(
                    parent / name.rsplit("/", 1)[-1],
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                    0o600,
                )
                with os.fdopen(fd, "wb") as out:
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                if h.hexdigest() != entry.sha256:
                    raise IntegrityError(
                        f"{name}: content sha256 does not match the manifest: tampered or "
                        "corrupt; the artifact is refused"
                    )
                os.chmod(parent / name.rsplit("/", 1)[-1], (entry.mode & 0o755) | 0o600)
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as e:
        raise IntegrityError(
            f"{archive.name} is truncated or corrupt ({e}); delete the artifact and pull or warm it again"
        ) from None
    except OSError as e:
        # After every name check: what is left is the destination's filesystem (full, read-only,
        # a path past its limits).
        raise ArtifactError(
            f"cannot extract {archive} into {dest}: {e.strerror or e}"
            f"{f' ({e.filename})' if e.filename else ''}; check the free space and permissions there"
        ) from None
    missing = sorted(set(expected) - seen)
    if missing:
        raise IntegrityError(
            f"the archive lacks {len(missing)} file(s) the manifest lists (first: {missing[0]}): "
            "truncated or tampered"
        )
