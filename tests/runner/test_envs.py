"""Variant pins and locks: committed locks are URL-free and hash-pinned; uv really generates them."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from runner.envs import LOCK_FILES, list_variants, load_variant
from runner.errors import RunnerError
from runner.lock import check_lock, compile_lock, expected_packages, parse_lock, read_lock

HASH_LINE = re.compile(r"^    --hash=sha256:[0-9a-f]{64}( \\)?$")


def test_variants_pin_torch_cuda_and_base_by_digest(repo: Path) -> None:
    assert list_variants(repo) == ["cu128", "cu130"]
    cu128, cu130 = load_variant("cu128", repo), load_variant("cu130", repo)
    assert (cu128.torch, cu128.cuda, cu128.min_driver) == ("2.10.0", "12.8", 570)
    assert (cu130.torch, cu130.cuda, cu130.min_driver) == ("2.11.0", "13.0", 580)
    for v in (cu128, cu130):
        assert re.fullmatch(r"nvidia/cuda:[\w.-]+@sha256:[0-9a-f]{64}", v.base_image), v.base_image
        assert v.dockerfile.is_file()
        assert f"ARG BASE_IMAGE={v.base_image}" in v.dockerfile.read_text()


def test_unknown_variant_names_the_known_ones(repo: Path) -> None:
    with pytest.raises(RunnerError, match="known variants: cu128, cu130"):
        load_variant("cu999", repo)


def test_variant_file_rejects_tag_without_digest(tmp_path: Path) -> None:
    (tmp_path / "envs" / "x").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "envs" / "x" / "variant.toml").write_text(
        'description = "d"\nbase_image = "nvidia/cuda:13.0.1-runtime-ubuntu24.04"\npython = "3.12"\n'
        'torch = "2.11.0"\ncuda = "13.0"\nmin_driver = 580\n'
    )
    with pytest.raises(RunnerError, match="pinned by digest"):
        load_variant("x", tmp_path)


@pytest.mark.parametrize("variant", ["cu128", "cu130"])
@pytest.mark.parametrize("kind", list(LOCK_FILES))
def test_committed_lock_is_url_free_hash_pinned_and_current(repo: Path, variant: str, kind: str) -> None:
    v = load_variant(variant, repo)
    lock = check_lock(v, kind, root=repo)
    text = lock.path.read_text()
    assert "://" not in text and "pypi" not in text.lower() and "pythonhosted" not in text
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith((" ", "#")):
            # Every requirement is name==version and is followed by its hash lines.
            assert re.match(r"^[a-z0-9][a-z0-9._-]*==\S+( ; .+)? \\$", line), line
            assert HASH_LINE.match(lines[i + 1]), (line, lines[i + 1])
    names = {e.name: e.version for e in lock.entries}
    assert "typer" in names and "setuptools" in names
    if kind == "full":
        assert names["torch"] == v.torch
        assert any(n.startswith("nvidia-") for n in names), "the CUDA wheels torch pulls must be locked"
    else:
        assert "torch" not in names


def test_markers_select_entries_for_the_checked_environment(repo: Path) -> None:
    lock = read_lock(load_variant("cu130", repo).lock_path("full"))
    linux = {
        "sys_platform": "linux",
        "platform_machine": "x86_64",
        "platform_system": "Linux",
        "python_full_version": "3.12.3",
        "python_version": "3.12",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
    }
    on_linux = expected_packages(lock, linux)
    on_mac = expected_packages(lock, {**linux, "sys_platform": "darwin", "platform_system": "Darwin"})
    assert "nvidia-cublas" in on_linux and "nvidia-cublas" not in on_mac
    assert "colorama" not in on_linux
    assert on_linux["torch"] == on_mac["torch"] == "2.11.0"


@pytest.mark.parametrize(
    "bad, problem",
    [
        (
            "six==1.17.0 \\\n    --hash=sha256:" + "a" * 64 + "\n--index-url https://mirror.example/simple\n",
            "names a location",
        ),
        ("six==1.17.0\n", "no sha256 hashes"),
        ("six>=1.0 \\\n    --hash=sha256:" + "a" * 64 + "\n", "not a pinned requirement"),
        ("six @ file:///tmp/six.whl \\\n    --hash=sha256:" + "a" * 64 + "\n", "names a location"),
        ("# only a comment\n", "no requirements"),
    ],
)
def test_parse_lock_rejects_unsafe_locks(bad: str, problem: str) -> None:
    with pytest.raises(RunnerError, match=problem):
        parse_lock(bad, "test.lock")


def test_uv_generates_the_runner_lock(repo: Path, tmp_path: Path) -> None:
    if not shutil.which("uv") and not (Path(__import__("sys").executable).parent / "uv").is_file():
        pytest.fail("uv is needed (pip install uv; it is in the test extra)")
    v = load_variant("cu130", repo)
    out = compile_lock(v, "runner", root=repo, out=tmp_path / "runner.lock")
    fresh = check_lock(v, "runner", root=repo, path=out)
    committed = check_lock(v, "runner", root=repo)
    # Versions may move as the registry publishes; the set of distributions and the inputs may not.
    assert {e.name for e in fresh.entries} == {e.name for e in committed.entries}
    assert fresh.inputs_sha256 == committed.inputs_sha256
    assert not list(tmp_path.glob(".runner.lock.*")), "the atomic write must leave no temp file"
