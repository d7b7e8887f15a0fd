"""The local artifact store: `<root>/<key>/{manifest.json, cache.tar.zst[, origin.json]}`.

Writers build an artifact in `<root>/.tmp-*` and rename it into place under an exclusive flock on
`<root>/.locks/<key>.lock`; readers hold the same lock shared, so nobody sees half an artifact.
A directory named like a key must hold that key's manifest: one that holds another's is broken
(it would restore an artifact under a key it does not have). Listing and pruning report broken
entries and go on; temp dirs of killed processes are swept by prune (runner/cache/leftovers.py).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.cache.errors import ArtifactError, ArtifactExistsError, BrokenArtifactError, StoreInputError
from runner.cache.leftovers import held_tempdir, sweep_restore_temps, sweep_store
from runner.cache.manifest import ARCHIVE_NAME, MANIFEST_NAME, ORIGIN_NAME, Manifest
from runner.fsutil import file_lock, make_private_dir, replace_dir

STORE_ENV = "DFLASH_CACHE_STORE"
_KEY_DIR = re.compile(r"^[0-9a-f]{64}$")
_ORIGIN_MAX_BYTES = 1 << 20


def default_store_root() -> Path:
    if os.environ.get(STORE_ENV):
        return Path(os.environ[STORE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflashctl" / "artifacts"


def parse_created(text: str) -> dt.datetime:
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return dt.datetime.fromtimestamp(0, dt.timezone.utc)
    return when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)


@dataclass(kw_only=True, slots=True)
class Artifact:
    path: Path
    manifest: Manifest
    origin: dict[str, Any] | None
    """None for artifacts made here; {"origin": "remote", ...} for pulled or foreign ones."""

    @property
    def key(self) -> str:
        return self.manifest.key

    @property
    def archive(self) -> Path:
        return self.path / ARCHIVE_NAME

    @property
    def created(self) -> dt.datetime:
        return parse_created(self.manifest.created_at)

    @classmethod
    def load(cls, path: Path, *, foreign: bool = False) -> Artifact:
        manifest = Manifest.read(path / MANIFEST_NAME)
        origin: dict[str, Any] | None = None
        origin_path = path / ORIGIN_NAME
        if os.path.lexists(origin_path):  # any origin.json, even a broken one, lowers trust
            try:
                if not origin_path.is_file() or origin_path.stat().st_size > _ORIGIN_MAX_BYTES:
                    raise ValueError("not a small regular file")
                origin = json.loads(origin_path.read_text())
            except (OSError, ValueError, RecursionError):
                origin = {"origin": "remote", "note": "origin.json unreadable"}
            if not isinstance(origin, dict):
                origin = {"origin": "remote"}
        elif foreign:
            origin = {"origin": "path", "path": str(path)}
        art = cls(path=path, manifest=manifest, origin=origin)
        art.check_directory()
        return art

    def check_directory(self) -> None:
        """A directory named like a key must hold that key's manifest (restore and verify rely on it)."""
        if _KEY_DIR.match(self.path.name) and self.path.name != self.key:
            raise BrokenArtifactError(
                f"{self.path} holds the manifest of artifact {self.key[:16]}, not of "
                f"{self.path.name[:16]}: the store entry is broken or was tampered with; delete it "
                f"(rm -rf {self.path}) or pull {self.path.name[:16]} again (cache pull --force)"
            )


class Store:
    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or default_store_root()).expanduser()

    def ensure(self) -> Store:
        self._check_root()
        make_private_dir(self.root)
        return self

    def _check_root(self) -> None:
        if os.path.lexists(self.root) and not self.root.is_dir():
            raise StoreInputError(
                f"the cache store {self.root} is not a directory; pass --store DIR (a directory)"
            )

    def _lock_path(self, key: str) -> Path:
        return self.root / ".locks" / f"{key}.lock"

    @contextlib.contextmanager
    def lock(self, key: str, *, shared: bool = False) -> Iterator[None]:
        self.ensure()
        with file_lock(self._lock_path(key), shared=shared):
            yield

    def artifact_keys(self) -> list[str]:
        """Names of the key directories (artifacts or broken entries: load() tells them apart)."""
        self._check_root()
        if not self.root.is_dir():
            return []
        try:
            return sorted(p.name for p in self.root.iterdir() if _KEY_DIR.match(p.name) and p.is_dir())
        except OSError as e:
            raise ArtifactError(
                f"cannot list the cache store {self.root}: {e.strerror}; check its permissions"
            ) from None

    def resolve(self, key_or_prefix: str) -> str:
        prefix = key_or_prefix.strip().lower()
        if not prefix or not re.fullmatch(r"[0-9a-f]+", prefix):
            raise StoreInputError(
                f"{key_or_prefix!r} is not an artifact key (hex); see `dflashctl cache list`"
            )
        hits = [k for k in self.artifact_keys() if k.startswith(prefix)]
        if not hits:
            raise ArtifactError(f"no artifact {key_or_prefix!r} in {self.root}; see `dflashctl cache list`")
        if len(hits) > 1:
            raise StoreInputError(
                f"{key_or_prefix!r} is ambiguous: it matches {', '.join(h[:16] for h in hits)}; "
                "give more characters"
            )
        return hits[0]

    def get(self, key_or_prefix: str) -> Artifact:
        key = self.resolve(key_or_prefix)
        with self.lock(key, shared=True):
            return Artifact.load(self.root / key)

    @contextlib.contextmanager
    def reading(self, key_or_prefix: str) -> Iterator[Artifact]:
        """The artifact, held under a shared lock: no writer can swap it while the caller reads."""
        key = self.resolve(key_or_prefix)
        with self.lock(key, shared=True):
            yield Artifact.load(self.root / key)

    def artifacts(self) -> tuple[list[Artifact], list[tuple[str, str]]]:
        """(artifacts newest first, [(key, problem)] for directories that are not valid artifacts)."""
        good, broken = [], []
        for key in self.artifact_keys():
            try:
                good.append(Artifact.load(self.root / key))
            except ArtifactError as e:
                broken.append((key, str(e)))
        good.sort(key=lambda a: a.created, reverse=True)
        return good, broken

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A private temp dir inside the store (same filesystem, so the final rename is atomic)."""
        self.ensure()
        with held_tempdir(self.root, ".tmp-") as tmp:
            yield tmp

    def install(self, staged: Path, key: str, *, replace: bool = True) -> Path:
        """Move a complete staged artifact to <root>/<key>, replacing any previous one atomically
        (without replace, an entry already there is refused)."""
        with self.lock(key):
            if not replace and os.path.lexists(self.root / key):
                raise ArtifactExistsError(key, self.root / key)
            return self.install_locked(staged, key)

    def install_locked(self, staged: Path, key: str) -> Path:
        """install() for a caller that already holds lock(key) (flock is per open file: never nest)."""
        final = self.root / key
        old = replace_dir(staged, final, self.root / f".old-{key}-{os.getpid()}")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def remove(self, key: str) -> None:
        with self.lock(key):
            path = self.root / key
            if not path.exists():
                return
            trash = self.root / f".trash-{key}-{os.getpid()}"
            os.rename(path, trash)  # gone from readers' view at once; the slow delete comes after
        shutil.rmtree(trash, ignore_errors=True)

    def prune(
        self,
        *,
        keep: int | None = None,
        older_than: dt.timedelta | None = None,
        now: dt.datetime | None = None,
        dry_run: bool = False,
        restore_dirs: tuple[Path, ...] = (),
    ) -> Pruned:
        """Remove artifacts beyond the newest `keep`, or created more than `older_than` ago; with both,
        the newest `keep` always stay and only older-than ones among the rest go; with neither, none.
        Always: sweep temp dirs of killed processes from the store and from restore_dirs (where
        restores put their destinations), and report broken entries (left in place)."""
        if keep is not None and keep < 0:
            raise StoreInputError(f"--keep {keep}: must be >= 0")
        arts, broken = self.artifacts()
        now = now or dt.datetime.now(dt.timezone.utc)
        doomed = []
        if keep is not None or older_than is not None:
            for i, art in enumerate(arts):
                beyond_keep = keep is None or i >= keep
                too_old = older_than is None or now - art.created > older_than
                if beyond_keep and too_old:
                    doomed.append(art)
        if not dry_run:
            for art in doomed:
                self.remove(art.key)
        leftovers = sweep_store(self.root, dry_run=dry_run)
        for d in restore_dirs:
            leftovers += sweep_restore_temps(d, dry_run=dry_run)
        return Pruned(removed=doomed, broken=broken, leftovers=leftovers)


@dataclass(kw_only=True, slots=True)
class Pruned:
    removed: list[Artifact]
    broken: list[tuple[str, str]] = field(default_factory=list)
    """(key, problem) of entries that are not valid artifacts: reported, never removed by prune."""
    leftovers: list[Path] = field(default_factory=list)
    """Temp dirs of killed processes, swept."""


def parse_age(text: str) -> dt.timedelta:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not m:
        raise StoreInputError(
            f"age {text!r} not understood; use a number and a unit s|m|h|d|w, e.g. 7d or 12h"
        )
    n, unit = float(m.group(1)), m.group(2)
    return dt.timedelta(seconds=n * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[unit])


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
