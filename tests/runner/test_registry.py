"""runner/launch/registry.py: finding a run by id, id prefix or name."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.errors import BadInput, RunnerError
from runner.launch.registry import HostRecord, Registry, RunRecord, check_name


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
    for bad in ("", "-x", "a.b", "a:b", "a b", "x" * 49, "$(touch x)"):
        with pytest.raises(BadInput):
            check_name(bad)
