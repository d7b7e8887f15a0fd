"""push / pull over a real sshd on loopback (its own host key, config and authorized key)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cache_helpers import make_artifact
from typer.testing import CliRunner

from runner.cache.store import Store
from runner.cli import app

pytestmark = pytest.mark.ssh


def test_push_then_pull_marks_remote_origin(sshd: str, tmp_path: Path) -> None:
    runner = CliRunner()
    local = Store(tmp_path / "local").ensure()
    art = make_artifact(local, tmp_path, tag="p")
    remote_dir = tmp_path / "remote store"  # a space: quoting must hold over ssh
    res = runner.invoke(
        app, ["cache", "push", art.key[:12], "--remote", f"{sshd}:{remote_dir}", "--store", str(local.root)]
    )
    assert res.exit_code == 0, res.output
    assert (remote_dir / art.key / "cache.tar.zst").read_bytes() == art.archive.read_bytes()
    assert [p.name for p in remote_dir.iterdir()] == [art.key], "no temp dirs left on the remote"
    # Push again (replace in place) still leaves exactly one artifact.
    assert (
        runner.invoke(
            app, ["cache", "push", art.key, "--remote", f"{sshd}:{remote_dir}", "--store", str(local.root)]
        ).exit_code
        == 0
    )
    other = Store(tmp_path / "other")
    res = runner.invoke(
        app, ["cache", "pull", art.key[:8], "--remote", f"{sshd}:{remote_dir}", "--store", str(other.root)]
    )
    assert res.exit_code == 0, res.output
    assert "--trust" in res.output, "an unsigned pulled artifact announces that restore needs --trust"
    pulled = other.root / art.key
    assert json.loads((pulled / "origin.json").read_text())["origin"] == "remote"
    res = runner.invoke(app, ["cache", "list", "--json", "--store", str(other.root)])
    assert json.loads(res.output)["artifacts"][0]["origin"] == "remote"
    # Restore of the unsigned remote artifact is refused without --trust (before any probe result matters).
    res = runner.invoke(
        app,
        [
            "cache",
            "restore",
            art.key,
            "--dest",
            str(tmp_path / "dest"),
            "--force",
            "--python",
            "/nonexistent/python",
            "--store",
            str(other.root),
        ],
    )
    assert res.exit_code == 2 and "--trust" in res.output, res.output  # untrusted: bad input
    assert not (tmp_path / "dest").exists()
    res = runner.invoke(
        app,
        [
            "cache",
            "restore",
            art.key,
            "--dest",
            str(tmp_path / "dest"),
            "--force",
            "--trust",
            "--python",
            "/nonexistent/python",
            "--store",
            str(other.root),
        ],
    )
    assert res.exit_code == 0, res.output
    assert (tmp_path / "dest" / "inductor" / "g4" / "cg4f.main.so").is_file()


def test_pull_detects_corruption_in_transit(sshd: str, tmp_path: Path) -> None:
    local = Store(tmp_path / "local").ensure()
    art = make_artifact(local, tmp_path, tag="c")
    remote_dir = tmp_path / "remote"
    runner = CliRunner()
    assert (
        runner.invoke(
            app, ["cache", "push", art.key, "--remote", f"{sshd}:{remote_dir}", "--store", str(local.root)]
        ).exit_code
        == 0
    )
    archive = remote_dir / art.key / "cache.tar.zst"
    raw = bytearray(archive.read_bytes())
    raw[5] ^= 0xFF
    archive.write_bytes(bytes(raw))
    res = runner.invoke(
        app,
        ["cache", "pull", art.key, "--remote", f"{sshd}:{remote_dir}", "--store", str(tmp_path / "other")],
    )
    assert res.exit_code == 2 and "does not match" in res.output, res.output  # corrupt: bad input
    assert not (tmp_path / "other" / art.key).exists()


def test_pull_never_replaces_a_local_artifact_without_force(sshd: str, tmp_path: Path) -> None:
    runner = CliRunner()
    local = Store(tmp_path / "local").ensure()
    art = make_artifact(local, tmp_path, tag="mine")
    remote_dir = tmp_path / "remote"
    push = ["cache", "push", art.key, "--remote", f"{sshd}:{remote_dir}", "--store", str(local.root)]
    assert runner.invoke(app, push).exit_code == 0
    manifest = (art.path / "manifest.json").read_bytes()
    pull = ["cache", "pull", art.key[:10], "--remote", f"{sshd}:{remote_dir}", "--store", str(local.root)]
    res = runner.invoke(app, pull)
    assert res.exit_code == 2 and "already in the local store" in res.output and "--force" in res.output
    assert (art.path / "manifest.json").read_bytes() == manifest
    assert not (art.path / "origin.json").exists(), "the local artifact keeps its local (trusted) origin"
    assert [p.name for p in local.root.iterdir() if p.name.startswith(".tmp-")] == [], (
        "refused before copying"
    )
    res = runner.invoke(app, [*pull, "--force"])
    assert res.exit_code == 0, res.output
    assert json.loads((art.path / "origin.json").read_text())["origin"] == "remote"
