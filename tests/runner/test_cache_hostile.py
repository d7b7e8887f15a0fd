"""Hostile artifacts: each is refused with a clear error and nothing is written outside dest."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import pytest
from cache_helpers import fingerprint, make_artifact, tree_listing, write_hostile

from runner.cache.archive import Limits
from runner.cache.errors import (
    ArtifactError,
    FingerprintMismatchError,
    IntegrityError,
    UnsafeArchiveError,
    UntrustedArtifactError,
)
from runner.cache.manifest import ARCHIVE_NAME, MANIFEST_NAME, FileEntry
from runner.cache.restore import restore
from runner.cache.signing import Keyring
from runner.cache.store import Artifact, Store

RING = Keyring(hmac_secret=b"team secret of at least 16 bytes")


def reg(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


def _restore_refused(tmp_path: Path, art_dir: Path, error: type[Exception], match: str, **kw: object) -> None:
    """Restore (trusted, so only the structural checks decide) and check nothing leaked."""
    outside = tmp_path / "victim"
    outside.mkdir(exist_ok=True)
    before = tree_listing(tmp_path)
    dest = tmp_path / "work" / "dest"
    art = Artifact.load(art_dir, foreign=True)
    with pytest.raises(error, match=match):
        restore(art, dest, dest_fingerprint=None, ring=RING, trust=True, **kw)  # type: ignore[arg-type]
    after = tree_listing(tmp_path)
    # Only the dest's lock file may appear; no temp dir, no dest, nothing in victim/.
    assert after - before <= {"work", "work/.dest.lock"}, sorted(after - before)
    assert not dest.exists()
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ([reg("inductor/../../victim/pwned", b"x")], "climbs out"),
        ([reg("/tmp/abs-pwned", b"x")], "absolute path"),
        ([reg("inductor/./x", b"x")], "not normalized"),
        ([reg("inductor/" + "n" * 300, b"x")], "too long"),
        ([reg("/".join(["d" * 200] * 20), b"x")], "too long"),
    ],
    ids=["traversal", "absolute", "dot-segment", "long-name", "long-path"],
)
def test_bad_member_names(tmp_path: Path, members: list, match: str) -> None:
    # The manifest must list the same name, which manifest validation already refuses.
    with pytest.raises(UnsafeArchiveError, match=match):
        _restore_refused(tmp_path, write_hostile(tmp_path / "art", members), UnsafeArchiveError, match)


def test_traversal_hidden_from_manifest(tmp_path: Path) -> None:
    """The manifest is clean; only the archive carries the traversal member."""
    data = b"payload"
    files = [
        FileEntry(path="inductor/ok", sha256=hashlib.sha256(data).hexdigest(), size=len(data), mode=0o644)
    ]
    art = write_hostile(
        tmp_path / "art", [reg("inductor/ok", data), reg("../victim/pwned", data)], manifest_files=files
    )
    _restore_refused(tmp_path, art, UnsafeArchiveError, "climbs out")


@pytest.mark.parametrize(
    ("member", "match"),
    [
        (special("inductor/link", tarfile.SYMTYPE, "../../victim"), "symbolic link"),
        (special("inductor/hard", tarfile.LNKTYPE, "/etc/passwd"), "hard link"),
        (special("inductor/dev", tarfile.CHRTYPE), "character device"),
        (special("inductor/fifo", tarfile.FIFOTYPE), "FIFO"),
    ],
    ids=["symlink-escape", "hardlink", "device", "fifo"],
)
def test_links_and_special_files(tmp_path: Path, member: tuple, match: str) -> None:
    # Link first, then a file "through" it: the classic two-step escape.
    data = b"through the link"
    members = [member, reg("inductor/link/pwned", data)]
    files = [
        FileEntry(
            path="inductor/link/pwned", sha256=hashlib.sha256(data).hexdigest(), size=len(data), mode=0o644
        )
    ]
    art = write_hostile(tmp_path / "art", members, manifest_files=files)
    _restore_refused(tmp_path, art, UnsafeArchiveError, match)


def test_long_name_hidden_from_manifest(tmp_path: Path) -> None:
    """A name no filesystem can create (ENAMETOOLONG at open) is refused by name, before any write."""
    art = write_hostile(tmp_path / "art", [reg("inductor/" + "n" * 300, b"x")], manifest_files=[])
    _restore_refused(tmp_path, art, UnsafeArchiveError, "too long")


def test_member_not_in_manifest(tmp_path: Path) -> None:
    art = write_hostile(
        tmp_path / "art",
        [reg("inductor/a", b"a"), reg("inductor/extra", b"e")],
        manifest_files=[
            FileEntry(path="inductor/a", sha256=hashlib.sha256(b"a").hexdigest(), size=1, mode=0o644)
        ],
    )
    _restore_refused(tmp_path, art, UnsafeArchiveError, "not in the manifest")


def test_size_and_count_caps(tmp_path: Path) -> None:
    art = write_hostile(tmp_path / "art", [reg(f"inductor/f{i}", b"z" * 1000) for i in range(5)])
    _restore_refused(tmp_path, art, UnsafeArchiveError, "per-file cap", limits=Limits(max_file_bytes=999))
    _restore_refused(tmp_path, art, UnsafeArchiveError, "total cap", limits=Limits(max_total_bytes=4500))
    _restore_refused(tmp_path, art, UnsafeArchiveError, "more than 3 members", limits=Limits(max_members=3))


def test_tampered_file(tmp_path: Path) -> None:
    """Archive bytes replaced and the archive hash updated, but the file hash still pinned: refused."""
    good = b"real kernel"
    evil = b"evil kernel"
    files = [
        FileEntry(path="inductor/k.so", sha256=hashlib.sha256(good).hexdigest(), size=len(good), mode=0o755)
    ]
    art = write_hostile(tmp_path / "art", [reg("inductor/k.so", evil)], manifest_files=files)
    _restore_refused(tmp_path, art, IntegrityError, "does not match the manifest")


@pytest.fixture()
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store").ensure()


def test_tampered_archive_and_manifest(store: Store, tmp_path: Path) -> None:
    art = make_artifact(store, tmp_path)
    dest = tmp_path / "dest"
    raw = bytearray(art.archive.read_bytes())
    raw[-10] ^= 0x01
    art.archive.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="does not match"):
        restore(Artifact.load(art.path), dest, dest_fingerprint=None, ring=Keyring())
    assert not dest.exists()
    art2 = make_artifact(store, tmp_path, tag="b")
    data = json.loads((art2.path / MANIFEST_NAME).read_text())
    data["fingerprint"]["env"]["torch"] = "9.9.9"  # make it match another environment
    (art2.path / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="key is not the sha256 of the fingerprint"):
        Artifact.load(art2.path)
    data = json.loads((art2.path / MANIFEST_NAME).read_text())
    data["fingerprint"]["env"]["torch"] = "2.13.0+cpu"
    data["files"][0]["sha256"] = "0" * 64
    (art2.path / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(IntegrityError, match="does not match the manifest"):
        restore(Artifact.load(art2.path), dest, dest_fingerprint=None, ring=Keyring())
    assert not dest.exists()


def test_truncated_archive(store: Store, tmp_path: Path) -> None:
    art = make_artifact(store, tmp_path)
    # Truncate and re-pin the archive hash (what a careless copy plus a re-hash would produce).
    data = art.archive.read_bytes()[:-200]
    art.archive.write_bytes(data)
    m = json.loads((art.path / MANIFEST_NAME).read_text())
    m["archive"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (art.path / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(IntegrityError, match="truncated or corrupt|lacks"):
        restore(Artifact.load(art.path), tmp_path / "dest", dest_fingerprint=None, ring=Keyring())
    assert not (tmp_path / "dest").exists()
    assert [p for p in tmp_path.iterdir() if "restore-" in p.name] == []


def test_wrong_fingerprint(store: Store, tmp_path: Path) -> None:
    art = make_artifact(store, tmp_path)
    here = fingerprint("a")
    here["env"]["gpus"] = [{"name": "NVIDIA H200", "capability": "9.0"}]
    here["env"]["device_type"] = "cuda"
    with pytest.raises(FingerprintMismatchError, match="env.device_type") as e:
        restore(art, tmp_path / "dest", dest_fingerprint=here, ring=Keyring())
    assert "env.gpus" in str(e.value)
    assert not (tmp_path / "dest").exists()


def test_signatures_and_remote_origin(store: Store, tmp_path: Path) -> None:
    signed = make_artifact(store, tmp_path, tag="s", ring=RING)
    assert signed.manifest.signature is not None
    # Remote origin + valid signature: accepted.
    (signed.path / "origin.json").write_text(json.dumps({"origin": "remote", "remote": "h:/x"}))
    restore(Artifact.load(signed.path), tmp_path / "d1", dest_fingerprint=None, ring=RING)
    # Wrong key: refused even for a local artifact, accepted with --trust.
    other = Keyring(hmac_secret=b"another secret, 16+ bytes")
    with pytest.raises(UntrustedArtifactError, match="does not verify"):
        restore(Artifact.load(signed.path), tmp_path / "d2", dest_fingerprint=None, ring=other)
    assert not (tmp_path / "d2").exists()
    restore(Artifact.load(signed.path), tmp_path / "d2", dest_fingerprint=None, ring=other, trust=True)
    # Manifest changed after signing (config name): the signature no longer verifies.
    m = json.loads((signed.path / MANIFEST_NAME).read_text())
    m["config_name"] = "innocent"
    (signed.path / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(UntrustedArtifactError, match="changed after signing"):
        restore(Artifact.load(signed.path), tmp_path / "d3", dest_fingerprint=None, ring=RING)
    # Unsigned + remote origin: refused without --trust; local unsigned is fine.
    unsigned = make_artifact(store, tmp_path, tag="u")
    restore(Artifact.load(unsigned.path), tmp_path / "d4", dest_fingerprint=None, ring=RING)
    (unsigned.path / "origin.json").write_text(json.dumps({"origin": "remote", "remote": "h:/x"}))
    with pytest.raises(UntrustedArtifactError, match="unsigned.*--trust"):
        restore(Artifact.load(unsigned.path), tmp_path / "d5", dest_fingerprint=None, ring=RING)
    assert not (tmp_path / "d5").exists()
    # An artifact directory outside the store is foreign, like a pulled one.
    with pytest.raises(UntrustedArtifactError, match="came from"):
        restore(
            Artifact.load(tmp_path / "store" / unsigned.key, foreign=True),
            tmp_path / "d6",
            dest_fingerprint=None,
            ring=RING,
        )
    assert (signed.path / ARCHIVE_NAME).exists()
