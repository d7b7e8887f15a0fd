"""push / pull artifacts to a remote store `USER@HOST:DIR` over ssh (runner.exec.remote).

The remote side needs only a POSIX shell, mkdir, mv, rm, ls and sha256sum: no dflashctl there.
Uploads land in a temp dir inside DIR and are renamed into place, so remote readers never see
half an artifact. Pulled artifacts get an origin.json: they are restored only when signed with a
key you trust (or with --trust).
"""

from __future__ import annotations

import json
import re
import secrets
import shlex

from runner.cache.archive import verify_archive_hash
from runner.cache.errors import ArtifactError, ArtifactExistsError, IntegrityError, StoreInputError
from runner.cache.manifest import ARCHIVE_NAME, MANIFEST_NAME, ORIGIN_NAME, Manifest
from runner.cache.store import Artifact, Store, now_iso
from runner.canonical import fingerprint_key
from runner.errors import BadInput
from runner.exec import remote


def parse_remote(spec: str) -> tuple[str, str]:
    """USER@HOST:DIR -> (USER@HOST, DIR), the host checked as every host is (remote.parse_host)."""
    m = re.fullmatch(r"([^:/\s]+):(.+)", spec.strip())
    hint = "must look like USER@HOST:DIR (e.g. root@gpu1:/data/dflash-cache)"
    if not m:
        raise StoreInputError(f"--remote {spec!r} {hint}")
    host, rdir = m.group(1), m.group(2)
    try:
        remote.parse_host(host)
    except BadInput as e:
        raise StoreInputError(f"--remote {spec!r} {hint}: {e}") from None
    if rdir.startswith("-"):
        raise StoreInputError(
            f"--remote {spec!r}: DIR {rdir!r} starts with '-'; give a path such as /data/dflash-cache"
        )
    return host, rdir


def _sh(host: str, script: str) -> str:
    return remote.run(host, ["sh", "-c", script]).stdout.decode()


def push(store: Store, key_or_prefix: str, spec: str) -> str:
    """Copy an artifact to the remote store; returns the remote artifact path."""
    host, rdir = parse_remote(spec)
    with store.reading(key_or_prefix) as art:
        return _push(store, art, host, rdir)


def _push(store: Store, art: Artifact, host: str, rdir: str) -> str:
    q = shlex.quote
    final = f"{rdir.rstrip('/')}/{art.key}"
    tmp = f"{rdir.rstrip('/')}/.push-{art.key[:16]}-{secrets.token_hex(4)}"
    _sh(host, f"umask 077 && mkdir -p {q(rdir)} && mkdir {q(tmp)}")
    try:
        for name in (MANIFEST_NAME, ARCHIVE_NAME):
            remote.copy_to(host, str(art.path / name), f"{tmp}/{name}")
        got = _sh(host, f"sha256sum {q(tmp + '/' + ARCHIVE_NAME)}").split()[0]
        if got != art.manifest.archive.sha256:
            raise IntegrityError(
                f"the archive arrived on {host} with sha256 {got[:16]}..., expected "
                f"{art.manifest.archive.sha256[:16]}...; the copy was corrupted, push again"
            )
        old = f"{rdir.rstrip('/')}/.old-{art.key[:16]}-{secrets.token_hex(4)}"
        _sh(
            host,
            f"if [ -e {q(final)} ]; then mv {q(final)} {q(old)}; fi; mv {q(tmp)} {q(final)}; rm -rf {q(old)}",
        )
    except BaseException:
        remote.run(host, ["rm", "-rf", tmp], check=False)
        raise
    return f"{host}:{final}"


def remote_keys(host: str, rdir: str) -> list[str]:
    out = _sh(host, f"ls -1 {shlex.quote(rdir)} 2>/dev/null || true")
    return sorted(k for k in out.split() if re.fullmatch(r"[0-9a-f]{64}", k))


def pull(store: Store, key_or_prefix: str, spec: str, *, force: bool = False) -> Artifact:
    """Copy an artifact from the remote store into the local one, marked remote-origin. An artifact
    of the same key already here (made here and trusted, or pulled before) is replaced only with
    force: a remote copy must never silently take the place of a local one."""
    host, rdir = parse_remote(spec)
    prefix = key_or_prefix.strip().lower()
    if not prefix or not re.fullmatch(r"[0-9a-f]+", prefix):
        raise StoreInputError(f"{key_or_prefix!r} is not an artifact key (hex)")
    hits = [k for k in remote_keys(host, rdir) if k.startswith(prefix)]
    if not hits:
        raise ArtifactError(f"no artifact {key_or_prefix!r} in {spec}")
    if len(hits) > 1:
        raise StoreInputError(f"{key_or_prefix!r} is ambiguous in {spec}: {', '.join(h[:16] for h in hits)}")
    key = hits[0]
    if not force and key in store.artifact_keys():
        raise ArtifactExistsError(key, store.root / key)  # before any copying; install checks again
    with store.staging() as stage:
        art_dir = stage / "artifact"
        art_dir.mkdir(mode=0o700)
        for name in (MANIFEST_NAME, ARCHIVE_NAME):
            remote.copy_from(host, f"{rdir.rstrip('/')}/{key}/{name}", str(art_dir / name))
        manifest = Manifest.read(art_dir / MANIFEST_NAME)
        if manifest.key != key or fingerprint_key(manifest.fingerprint) != key:
            raise IntegrityError(
                f"{spec}/{key[:16]}: the manifest's key does not match its directory; refused"
            )
        verify_archive_hash(art_dir / ARCHIVE_NAME, manifest.archive)
        (art_dir / ORIGIN_NAME).write_text(
            json.dumps(
                {"origin": "remote", "remote": f"{spec.rstrip('/')}/{key}", "pulled_at": now_iso()}, indent=1
            )
            + "\n"
        )
        final = store.install(art_dir, key, replace=force)
    return Artifact.load(final)
