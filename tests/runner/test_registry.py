"""runner/launch/registry.py: finding a run by id, id prefix, name or backend name; run names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runner.errors import BadInput, RunnerError
from runner.launch.registry import HostRecord, Registry, RunRecord, backend_name, check_name


def _save(reg: Registry, run_id: str, name: str, created_at: float) -> RunRecord:
    rec = RunRecord(
        run_id=run_id,
        name=name,
        backend="tmux",
        created_at=created_at,
        config="c.toml",
        hosts=[HostRecord(node_rank=0, host=None, run_dir=f"/tmp/runs/{run_id}")],
    )
    reg.save(rec)
    return rec


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    r = Registry(tmp_path)
    _save(r, "demo-20261201-aaaa", "demo", 1.0)
    _save(r, "demo-20261201-bbbb", "demo", 2.0)
    _save(r, "exp-20261201-cccc", "demo-2026", 3.0)
    return r


def test_exact_id_and_unique_prefix(reg: Registry) -> None:
    assert reg.find("demo-20261201-aaaa").run_id == "demo-20261201-aaaa"
    assert reg.find("demo-20261201-b").run_id == "demo-20261201-bbbb"
    assert reg.find("exp").run_id == "exp-20261201-cccc"


def test_a_name_is_the_newest_run_of_that_name(reg: Registry) -> None:
    assert reg.find("demo").run_id == "demo-20261201-bbbb"


def test_an_exact_name_wins_over_an_id_prefix(reg: Registry) -> None:
    """A name is an exact match; an id prefix is a guess at one."""
    assert reg.find("demo-2026").run_id == "exp-20261201-cccc", "prefix of two ids, name of one run"
    _save(reg, "other-20261201-dddd", "exp-2026", 4.0)
    assert reg.find("exp-2026").run_id == "other-20261201-dddd", "prefix of one id, name of another run"


def test_an_ambiguous_prefix_names_the_candidates(reg: Registry) -> None:
    with pytest.raises(RunnerError) as e:
        reg.find("demo-20261201")
    msg = str(e.value)
    assert "matches 2 runs" in msg and "demo-20261201-aaaa" in msg and "demo-20261201-bbbb" in msg


def test_an_unknown_run_says_where_it_looked(reg: Registry, tmp_path: Path) -> None:
    with pytest.raises(RunnerError, match=r"no run 'nope' in .*ps --all"):
        reg.find("nope")
    assert str(tmp_path) in str(pytest.raises(RunnerError, reg.find, "nope").value)


def test_a_damaged_entry_hides_no_other_run(reg: Registry) -> None:
    (reg.root / "broken.json").write_text("{not json")
    assert len(reg.all()) == 3


def test_run_names_are_checked() -> None:
    assert check_name("a_b-1") == "a_b-1"
    for bad in ("", "-x", ".x", "a:b", "a b", "x" * 49, "$(touch x)"):
        with pytest.raises(BadInput):
            check_name(bad)


def test_a_dotted_name_is_found_by_name_id_prefix_and_backend_names(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    run_id = "qwen3.6-27b-5t3d-20261204-101500-1a2b"
    session = backend_name(run_id)
    rec = RunRecord(
        run_id=run_id,
        name="qwen3.6-27b-5t3d",
        backend="tmux",
        created_at=1.0,
        config="c.toml",
        hosts=[
            HostRecord(
                node_rank=0, host=None, run_dir=f"/r/{run_id}", tmux_session=session, tmux_window="node0"
            )
        ],
    )
    reg.save(rec)
    _save(reg, "qwen3_6-27b-5t3d-20261204-101500-ffff", "qwen3_6-27b-5t3d", 2.0)
    for ref in ("qwen3.6-27b-5t3d", run_id, "qwen3.6", session):
        assert reg.find(ref).run_id == run_id, ref
    assert reg.find("qwen3_6-27b-5t3d").name == "qwen3_6-27b-5t3d", "names are not folded together"
    docker = RunRecord(**{**rec.to_dict(), "run_id": "d.1-2-3", "backend": "docker", "hosts": []})
    docker.hosts = [
        HostRecord(node_rank=0, host=None, run_dir="/r/d.1-2-3", container="dflash-d_1-2-3-node0")
    ]
    reg.save(docker)
    assert reg.find("dflash-d_1-2-3-node0").run_id == "d.1-2-3"


def test_backend_names_are_stable_and_safe_for_tmux_and_docker() -> None:
    assert (
        backend_name("qwen3.6-27b-5t3d-20261204-101500-1a2b")
        == "dflash-qwen3_6-27b-5t3d-20261204-101500-1a2b"
    )
    assert backend_name("demo-cpu-1-2-abcd") == "dflash-demo-cpu-1-2-abcd", (
        "names without a dot are as before"
    )
    name = backend_name("a.b.c_d-" + "x" * 40)
    assert name == backend_name("a.b.c_d-" + "x" * 40) and re.fullmatch(r"[A-Za-z0-9_-]+", name)


@pytest.mark.parametrize("name", ["qwen3.6-27b-5t3d", "qwen3-8b", "demo-cpu", "A", "a" * 48, "v1.2_rc-3"])
def test_names_kept_as_given(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "-x",
        ".x",
        "_x",
        "a:b",
        "a b",
        "a/b",
        "a\\b",
        "a;b",
        "a$b",
        "a'b",
        "a\nb",
        "ab\n",
        "x" * 49,
        "qwen\u00e9",
        "$(touch x)",
    ],
)
def test_unsafe_names_are_refused_naming_their_origin(name: str) -> None:
    with pytest.raises(BadInput, match=r"\(--name\) is not allowed") as e:
        check_name(name)
    assert "pass --name" not in str(e.value), "a refused --name needs no advice to pass --name"
    with pytest.raises(BadInput, match=r"\(run\.name of c\.toml\).*pass --name NAME"):
        check_name(name, origin="run.name of c.toml")
