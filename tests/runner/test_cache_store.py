"""The artifact store without torch: snapshot, list/show/verify/prune, locking, restore and its swap."""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest
from cache_helpers import fingerprint, make_artifact, make_cache_tree, tree_listing
from typer.testing import CliRunner

from runner.cache.errors import ArtifactError, FingerprintMismatchError
from runner.cache.restore import restore
from runner.cache.signing import Keyring
from runner.cache.store import Store, parse_age
from runner.canonical import fingerprint_key
from runner.cli import app


@pytest.fixture()
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store").ensure()


def test_snapshot_manifest_lists_every_file(store: Store, tmp_path: Path) -> None:
    art = make_artifact(store, tmp_path)
    m = art.manifest
    assert art.path == store.root / m.key
    assert m.key == fingerprint_key(m.fingerprint)
    tree = tmp_path / "tree-a"
    on_disk = {p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()}
    assert {f.path for f in m.files} == on_disk
    so = next(f for f in m.files if f.path.endswith(".so"))
    assert so.mode & 0o100, "executable bit of compiled kernels is kept"
    assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o700


def test_store_refuses_dir_writable_by_others(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(Exception, match="writable by other users"):
        Store(root).ensure()


def test_resolve_prefix_and_ambiguity(store: Store, tmp_path: Path) -> None:
    keys = [make_artifact(store, tmp_path, tag=t).key for t in ("a", "b", "c", "d", "e", "f", "g", "h")]
    assert store.resolve(keys[0][:12]) == keys[0]
    firsts = [k[0] for k in keys]
    dup = next((c for c in firsts if firsts.count(c) > 1), None)
    if dup is not None:  # 8 keys over 16 hex digits: a shared first digit is likely, not certain
        with pytest.raises(ArtifactError, match="ambiguous"):
            store.resolve(dup)
    with pytest.raises(ArtifactError, match="no artifact"):
        store.resolve("f" * 64 if "f" * 64 not in keys else "e" * 64)
    with pytest.raises(ArtifactError, match="not an artifact key"):
        store.resolve("../etc")


def test_cli_list_show_verify_prune(store: Store, tmp_path: Path) -> None:
    runner = CliRunner()
    a = make_artifact(store, tmp_path, tag="a")
    b = make_artifact(store, tmp_path, tag="b")
    res = runner.invoke(app, ["cache", "list", "--store", str(store.root), "--json"])
    assert res.exit_code == 0, res.output
    listed = json.loads(res.output)
    assert [r["key"] for r in listed["artifacts"]] == sorted([a.key, b.key], key=lambda k: k != b.key)
    assert {r["config_name"] for r in listed["artifacts"]} == {"cfg-a", "cfg-b"}
    assert listed["artifacts"][0]["torch"] == "2.13.0+cpu"
    res = runner.invoke(app, ["cache", "list", "--store", str(store.root)])
    assert a.key[:16] in res.output and "cfg-b" in res.output
    res = runner.invoke(app, ["cache", "show", a.key[:10], "--store", str(store.root)])
    assert res.exit_code == 0, res.output
    shown = json.loads(res.output)
    assert shown["key"] == a.key and shown["fingerprint"]["job"]["tag"] == "a"
    res = runner.invoke(app, ["cache", "verify", a.key, "--store", str(store.root)])
    assert res.exit_code == 0 and "ok" in res.output, res.output
    # Corrupt one byte of the archive: verify must fail naming the hash.
    raw = bytearray(a.archive.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    a.archive.write_bytes(bytes(raw))
    res = runner.invoke(app, ["cache", "verify", a.key, "--store", str(store.root)])
    assert res.exit_code == 2 and "does not match" in res.output, res.output  # a broken entry: bad input
    res = runner.invoke(app, ["cache", "prune", "--keep", "1", "--store", str(store.root)])
    assert res.exit_code == 0, res.output
    assert store.artifact_keys() == [b.key], "the newest artifact is kept"


def test_prune_older_than(store: Store, tmp_path: Path) -> None:
    a = make_artifact(store, tmp_path, tag="a")
    now = a.created + dt.timedelta(days=8)
    assert [x.key for x in store.prune(older_than=parse_age("7d"), now=now, dry_run=True).removed] == [a.key]
    assert store.prune(older_than=parse_age("9d"), now=now).removed == []
    assert store.prune(keep=1, older_than=parse_age("7d"), now=now).removed == [], (
        "--keep protects the newest"
    )
    assert store.prune(now=now).removed == [], "without --keep or --older-than no artifact goes"
    store.prune(older_than=parse_age("1h"), now=now)
    assert store.artifact_keys() == []
    with pytest.raises(ArtifactError, match="not understood"):
        parse_age("7 days")


def _install_same_key(root: str, tmp: str, n: int) -> None:
    store = Store(Path(root))
    for i in range(n):
        tree = make_cache_tree(Path(tmp) / f"t{os.getpid()}-{i}", seed=f"{os.getpid()}-{i}")
        from runner.cache.snapshot import snapshot

        snapshot(store, tree, fingerprint=fingerprint("same"), config_name="c", warm={})


def test_concurrent_writers_never_leave_half_an_artifact(store: Store, tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_install_same_key, args=(str(store.root), str(tmp_path), 4)) for _ in range(3)
    ]
    for p in procs:
        p.start()
    key = fingerprint_key(fingerprint("same"))
    reads = 0
    deadline = time.monotonic() + 300
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if key in store.artifact_keys():
            from runner.cache.archive import verify_archive_hash

            with store.reading(key) as art:  # shared lock: manifest and archive belong together
                verify_archive_hash(art.archive, art.manifest.archive)
            reads += 1
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, "a writer failed or did not finish in time"
    assert store.artifact_keys() == [key]
    assert not [p for p in store.root.iterdir() if p.name.startswith((".tmp-", ".old-"))], "no leftovers"


def test_restore_swaps_and_keeps_previous(store: Store, tmp_path: Path) -> None:
    a = make_artifact(store, tmp_path, tag="a")
    dest = tmp_path / "live" / "cache"
    res = restore(a, dest, dest_fingerprint=fingerprint("a"), ring=Keyring())
    assert res.moved_aside is None
    assert tree_listing(dest) >= {f.path for f in a.manifest.files}
    assert json.loads((dest / "artifact.json").read_text())["key"] == a.key
    assert (dest / "inductor/g4/cg4f.main.so").read_bytes() == (
        tmp_path / "tree-a/inductor/g4/cg4f.main.so"
    ).read_bytes()
    (dest / "inductor" / "user-note").write_text("old")
    res2 = restore(a, dest, dest_fingerprint=None, ring=Keyring())
    assert res2.moved_aside is not None and (res2.moved_aside / "inductor" / "user-note").read_text() == "old"
    assert not (dest / "inductor" / "user-note").exists()
    leftovers = [p.name for p in dest.parent.iterdir() if ".restore-" in p.name]
    assert leftovers == []


def test_restore_refuses_other_fingerprint_and_force_overrides(store: Store, tmp_path: Path) -> None:
    a = make_artifact(store, tmp_path, tag="a")
    dest = tmp_path / "live"
    other = fingerprint("a")
    other["env"]["torch"] = "2.11.0+cu130"
    other["sources"]["model.py"] = "1" * 64
    with pytest.raises(FingerprintMismatchError) as e:
        restore(a, dest, dest_fingerprint=other, ring=Keyring())
    assert {d[0] for d in e.value.differences} == {"env.torch", "sources.model.py"}
    assert "env.torch" in str(e.value) and "--force" in str(e.value)
    assert not dest.exists()
    # The job part is compared only when the destination reports it (restore without --config).
    partial = {k: v for k, v in fingerprint("zzz").items() if k != "job"}
    restore(a, dest, dest_fingerprint=partial, ring=Keyring())
    res = restore(a, dest, dest_fingerprint=other, ring=Keyring(), force=True)
    assert {d[0] for d in res.differences} == {"env.torch", "sources.model.py"}


def test_unreadable_signing_key_is_a_clear_error(store: Store, tmp_path: Path, monkeypatch) -> None:
    """A key path in the user's config that does not exist names the setting and the file; the
    message's "[cache]" survives the terminal's markup."""
    cfg_home = tmp_path / "cfg"
    (cfg_home / "dflashctl").mkdir(parents=True)
    missing = tmp_path / "nowhere" / "signing.pem"
    (cfg_home / "dflashctl" / "config.toml").write_text(f'[cache]\ned25519_private_key = "{missing}"\n')
    monkeypatch.setenv("XDG_CONFIG_HOME", str(cfg_home))
    result = CliRunner().invoke(app, ["cache", "list", "--store", str(store.root)])
    # Rich wraps to the terminal width, even inside a path: compare with whitespace removed.
    text = "".join((result.output + (result.stderr if result.stderr_bytes is not None else "")).split())
    assert result.exit_code == 2, text  # a config value that names no file: bad input
    for want in ("[cache]ed25519_private_key", str(missing), "fixthepath"):
        assert want in text, (want, text)
