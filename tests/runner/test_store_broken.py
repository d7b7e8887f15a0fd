"""Broken store entries and the leftovers of killed processes: each is reported or refused in one
message, the rest of the store keeps working, and cleanup never touches what is in use."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cache_helpers import fingerprint, make_artifact
from typer.testing import CliRunner

from runner.cache.errors import ArtifactError, ArtifactExistsError, BrokenArtifactError, StoreInputError
from runner.cache.leftovers import GRACE_S, sweep_restore_temps, sweep_store
from runner.cache.manifest import MANIFEST_NAME
from runner.cache.restore import previous_copies, restore
from runner.cache.signing import Keyring
from runner.cache.store import Artifact, Store
from runner.cache.verify import verify_artifact
from runner.canonical import fingerprint_key
from runner.cli import app
from runner.errors import BadInput

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store").ensure()


def _cli(*args: str) -> tuple[int, str]:
    """Exit code and output, with rich's line wrapping undone (it wraps at 80 columns here)."""
    res = CliRunner().invoke(app, list(args))
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, res.output.replace("\n", " ").replace("  ", " ")


def _entry(store: Store, tag: str) -> Path:
    """An empty directory under the key of fingerprint(tag), as a broken entry would sit."""
    path = store.root / fingerprint_key(fingerprint(tag))
    path.mkdir()
    return path


def _broken_entries(store: Store, tmp_path: Path) -> dict[str, str]:
    """One store entry per way a manifest can be unreadable: key -> what its problem must say."""
    made: dict[str, str] = {}
    made[_entry(store, "dir").name] = "is a directory"
    (store.root / next(iter(made)) / MANIFEST_NAME).mkdir()
    nested = _entry(store, "nested")
    (nested / MANIFEST_NAME).write_text("[" * 200_000 + "]" * 200_000)
    made[nested.name] = "nests too deeply"
    fp: dict = {"x": 1}
    for _ in range(100):  # a consistent manifest, but nested far past any real fingerprint (4 levels)
        fp = {"x": fp}
    manifest = make_artifact(Store(tmp_path / "scratch"), tmp_path, tag="deep").manifest.to_dict()
    manifest.update(fingerprint=fp, key=fingerprint_key(fp))
    deep = store.root / manifest["key"]
    deep.mkdir()
    (deep / MANIFEST_NAME).write_text(json.dumps(manifest))
    made[deep.name] = "fingerprint nests more than 64 levels deep"
    nan = _entry(store, "nan")
    (nan / MANIFEST_NAME).write_text('{"format": 1, "x": NaN}')
    made[nan.name] = "not valid JSON"
    fifo = _entry(store, "fifo")
    os.mkfifo(fifo / MANIFEST_NAME)  # reading it would block `cache list` forever
    made[fifo.name] = "not a regular file"
    binary = _entry(store, "binary")
    (binary / MANIFEST_NAME).write_bytes(b"\xff\xfe\x00garbage")
    made[binary.name] = "UTF-8"
    made[_entry(store, "empty").name] = "not found"
    loop = _entry(store, "unreadable")
    os.symlink(MANIFEST_NAME, loop / MANIFEST_NAME)  # unreadable even for root, unlike chmod 000
    made[loop.name] = "cannot be read"
    return made


def test_list_show_prune_survive_every_broken_entry(store: Store, tmp_path: Path) -> None:
    good = make_artifact(store, tmp_path, tag="good")
    broken = _broken_entries(store, tmp_path)
    code, out = _cli("cache", "list", "--store", str(store.root), "--json")
    assert code == 0, out
    listed = json.loads(out[out.index("{") :])
    assert [a["key"] for a in listed["artifacts"]] == [good.key]
    problems = {b["key"]: b["problem"] for b in listed["broken"]}
    assert set(problems) == set(broken)
    for key, want in broken.items():
        assert want in problems[key], (want, problems[key])
    code, out = _cli("cache", "list", "--store", str(store.root))
    assert code == 0 and good.key[:16] in out and out.count("broken artifact") == len(broken), out
    code, out = _cli("cache", "show", good.key[:12], "--store", str(store.root))
    assert code == 0 and json.loads(out)["key"] == good.key
    for key in broken:
        code, out = _cli("cache", "show", key, "--store", str(store.root))
        assert code == 2 and "error:" in out and "Traceback" not in out, out
    code, out = _cli("cache", "prune", "--keep", "0", "--store", str(store.root))
    assert code == 0 and "removed 1 artifact(s)" in out and out.count("broken artifact") == len(broken), out
    assert set(store.artifact_keys()) == set(broken), "prune reports broken entries and leaves them"


def test_restore_and_verify_refuse_a_manifest_of_another_key(store: Store, tmp_path: Path) -> None:
    a = make_artifact(store, tmp_path, tag="a")
    b = make_artifact(store, tmp_path, tag="b")
    # b's directory now holds a's (self-consistent, even signed) manifest and archive.
    for name in (MANIFEST_NAME, "cache.tar.zst"):
        shutil.copy(a.path / name, b.path / name)
    with pytest.raises(BrokenArtifactError, match="holds the manifest of artifact"):
        store.get(b.key)
    impostor = Artifact(path=b.path, manifest=a.manifest, origin=None)  # as a caller might build one
    with pytest.raises(BrokenArtifactError, match="holds the manifest"):
        restore(impostor, tmp_path / "dest", dest_fingerprint=None, ring=Keyring())
    with pytest.raises(BrokenArtifactError, match="holds the manifest"):
        verify_artifact(impostor, Keyring())
    assert not (tmp_path / "dest").exists()
    code, out = _cli("cache", "verify", b.key, "--store", str(store.root))
    assert code == 2 and "holds the manifest of artifact" in out, out
    code, out = _cli(
        "cache", "restore", b.key[:12], "--dest", str(tmp_path / "dest"), "--force",
        "--python", "/nonexistent/python", "--store", str(store.root),
    )  # fmt: skip
    assert code == 2 and "holds the manifest of artifact" in out, out
    assert not (tmp_path / "dest").exists()
    # A copy elsewhere named like another key is refused too; under any other name it is a
    # foreign artifact (signature policy applies).
    elsewhere = tmp_path / "copies" / b.key
    shutil.copytree(b.path, elsewhere)
    with pytest.raises(BrokenArtifactError):
        Artifact.load(elsewhere, foreign=True)
    assert Artifact.load(elsewhere.rename(elsewhere.with_name("mine")), foreign=True).key == a.key
    code, out = _cli("cache", "verify", a.key, "--store", str(store.root))
    assert code == 0, out


def test_origin_json_that_is_no_file_still_lowers_trust(store: Store, tmp_path: Path) -> None:
    art = make_artifact(store, tmp_path, tag="o")
    (art.path / "origin.json").mkdir()
    loaded = store.get(art.key)
    assert loaded.origin is not None and loaded.origin["origin"] == "remote"


def _restores(store: Store, tmp_path: Path, dest: Path, n: int, **kw: object) -> list:
    art = make_artifact(store, tmp_path, tag="r")
    out = []
    for i in range(n):
        if dest.exists():
            (dest / "marker").write_text(str(i))  # tells the previous copies apart
        out.append(restore(art, dest, dest_fingerprint=None, ring=Keyring(), **kw))  # type: ignore[arg-type]
    return out


def test_previous_copies_are_bounded(store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "no-config"))
    dest = tmp_path / "live" / "cache"
    results = _restores(store, tmp_path, dest, 5)
    prev = previous_copies(dest)
    assert len(prev) == 2, "the default keeps 2"
    assert [(p / "marker").read_text() for p in prev] == ["4", "3"], "the newest stay"
    assert results[-1].moved_aside == prev[0]
    assert len(results[-1].swept) == 1, "each restore deletes the one copy past the bound"
    cfg = tmp_path / "cfg" / "dflashctl"
    cfg.mkdir(parents=True)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    (cfg / "config.toml").write_text("[cache]\nkeep_previous = 0\n")
    last = _restores(store, tmp_path, dest, 1)[0]
    assert previous_copies(dest) == [] and last.moved_aside is None
    assert (dest / "artifact.json").is_file(), "the live cache itself is never touched"
    _restores(store, tmp_path, dest, 2, keep_previous=1)
    assert len(previous_copies(dest)) == 1, "the caller's value beats the file"
    for bad in ("-1", "true", '"two"'):
        (cfg / "config.toml").write_text(f"[cache]\nkeep_previous = {bad}\n")
        with pytest.raises(BadInput, match=r"\[cache\] keep_previous"):
            _restores(store, tmp_path, dest, 1)
    (cfg / "config.toml").write_text("cache = 3\n")
    code, out = _cli("cache", "list", "--store", str(store.root))
    assert code == 2 and "must be a table" in out, out


_HOLD_LOCK = """
import sys, time
from pathlib import Path
from runner.fsutil import file_lock
dest = Path(sys.argv[1])
with file_lock(dest.parent / f".{dest.name}.lock"):
    tmp = dest.parent / f".{dest.name}.restore-abcd1234"
    (tmp / "inductor").mkdir(parents=True)
    print("held", flush=True)
    time.sleep(600)
"""

_HOLD_STAGE = """
import sys, time
from pathlib import Path
from runner.cache.store import Store
with Store(Path(sys.argv[1])).staging() as tmp:
    (tmp / "artifact").mkdir()
    print(tmp, flush=True)
    time.sleep(600)
"""


def _start(script: str, arg: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(arg)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _kill9(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)


def test_restore_temps_of_killed_restores_are_swept_never_live_ones(store: Store, tmp_path: Path) -> None:
    dest = tmp_path / "live" / "cache"
    dest.parent.mkdir()
    proc, _ = _start(_HOLD_LOCK, dest)  # a restore in progress: its dest lock held, its temp dir there
    try:
        temp = dest.parent / ".cache.restore-abcd1234"
        assert temp.is_dir()
        assert sweep_restore_temps(dest.parent) == [], "a restore in progress is left alone"
        assert temp.is_dir()
    finally:
        _kill9(proc)  # kill -9 mid-restore: the temp dir stays behind, the lock goes
    other = dest.parent / ".cache-2.restore-zzzz0000"  # another destination's, also dead
    other.mkdir()
    unrelated = dest.parent / ".cache.restore-notmkdtemp"
    unrelated.mkdir()
    assert sorted(sweep_restore_temps(dest.parent, dry_run=True)) == sorted([temp, other])
    assert temp.is_dir()
    assert sorted(sweep_restore_temps(dest.parent)) == sorted([temp, other])
    assert not temp.exists() and not other.exists() and unrelated.is_dir()
    # The next restore into dest sweeps its own on the way (here: one left by a killed restore).
    proc, _ = _start(_HOLD_LOCK, dest)
    _kill9(proc)
    art = make_artifact(store, tmp_path, tag="s")
    res = restore(art, dest, dest_fingerprint=None, ring=Keyring())
    assert res.swept == [temp] and not temp.exists()
    assert [p.name for p in dest.parent.iterdir() if ".restore-" in p.name] == [unrelated.name]


def _backdate(path: Path) -> None:
    old = time.time() - GRACE_S - 5
    os.utime(path, (old, old))


def test_store_temps_of_killed_processes_are_swept_by_prune(store: Store, tmp_path: Path) -> None:
    proc, held = _start(_HOLD_STAGE, store.root)  # a pull or warm in progress, staging in the store
    fresh = store.root / ".tmp-fresh0000"
    fresh.mkdir()  # unlocked but younger than the grace: maybe its creator is about to lock it
    try:
        _backdate(Path(held))
        assert sweep_store(store.root) == []
        assert Path(held).is_dir() and fresh.is_dir()
    finally:
        _kill9(proc)
    trash = store.root / f".trash-{'0' * 64}-12345"
    trash.mkdir()
    _backdate(trash)
    code, out = _cli("cache", "prune", "--dry-run", "--store", str(store.root))
    assert code == 0 and "would remove 0 artifact(s) and 2 leftover temp dir(s)" in out, out
    assert Path(held).is_dir()
    code, out = _cli("cache", "prune", "--store", str(store.root))
    assert code == 0 and "removed 0 artifact(s) and 2 leftover temp dir(s)" in out, out
    assert not Path(held).exists() and not trash.exists() and fresh.is_dir()


def test_store_arguments_refused_in_one_message(store: Store, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    for args, want in [
        (["cache", "list", "--store", str(not_a_dir)], "is not a directory"),
        (["cache", "show", "../etc", "--store", str(store.root)], "not an artifact key"),
        (["cache", "prune", "--older-than", "7 days", "--store", str(store.root)], "not understood"),
        (["cache", "prune", "--keep", "-1", "--store", str(store.root)], "must be >= 0"),
        (["cache", "restore", "abc", "--dest", str(not_a_dir), "--store", str(store.root)], "no artifact"),
    ]:
        code, out = _cli(*args)
        assert code == (1 if want == "no artifact" else 2) and want in out, (args, code, out)
    art = make_artifact(store, tmp_path, tag="d")
    code, out = _cli(
        "cache", "restore", art.key, "--dest", str(not_a_dir), "--force",
        "--python", "/nonexistent/python", "--store", str(store.root),
    )  # fmt: skip
    assert code == 2 and "is not a directory" in out, out
    with pytest.raises(StoreInputError):
        store.resolve("")


def test_install_without_replace_keeps_the_local_artifact(store: Store, tmp_path: Path) -> None:
    art = make_artifact(store, tmp_path, tag="k")
    before = (art.path / MANIFEST_NAME).read_bytes()
    with store.staging() as stage:
        (stage / "x").mkdir()
        with pytest.raises(ArtifactExistsError, match="--force"):
            store.install(stage / "x", art.key, replace=False)
    assert (art.path / MANIFEST_NAME).read_bytes() == before


@pytest.mark.parametrize("fmt", [True, 1.0, "1"], ids=["bool", "float", "string"])
def test_manifest_format_must_be_the_integer(store: Store, tmp_path: Path, fmt: object) -> None:
    """`True == 1 == 1.0` in Python: a format that only compares equal to 1 is not format 1."""
    art = make_artifact(store, tmp_path, tag="f")
    data = json.loads((art.path / MANIFEST_NAME).read_text())
    data["format"] = fmt
    (art.path / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="artifact format"):
        store.get(art.key)
    code, out = _cli("cache", "show", art.key, "--store", str(store.root))
    assert code != 0 and "artifact format" in out and "Traceback" not in out, out
