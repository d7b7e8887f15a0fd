"""Every launch backend through the one interface (runner/launch/backend.py): tmux and Docker for
real (a supervisor stand-in that sleeps), foreground by what it refuses. The verbs ps, stop, logs,
attach and relaunch call nothing else of a backend."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from runner.errors import BadInput, RunnerError
from runner.launch import backend, control
from runner.launch.plan import HostFacts, HostPlan
from runner.launch.registry import HostRecord, Registry, RunRecord


def _plan(tmp_path: Path, argv: list[str]) -> HostPlan:
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "logs").mkdir()
    return HostPlan(
        node_rank=0,
        host=None,
        run_dir=str(run_dir),
        runs_root=str(tmp_path / "runs"),
        cwd=str(tmp_path),
        config_path=str(run_dir / "config.toml"),
        argv=argv,
        env={},
        cache_dir=str(tmp_path / "cache"),
        cache_key=None,
        cache_action="none",
        shm_bytes=None,
        gpus=False,
        uid=os.getuid(),
        gid=os.getgid(),
    )


def _until(what, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.2)
    return False


class _Plan:
    """What start reads of a run's plan."""

    def __init__(self, image: str | None = None) -> None:
        self.image = image


def test_every_name_is_one_module_with_its_backend() -> None:
    for name in backend.NAMES:
        b = backend.get(name)
        assert isinstance(b, backend.Backend) and b.name == name
    with pytest.raises(BadInput, match="use one of tmux, docker, foreground"):
        backend.get("slurm")
    # a run directory watched by its path is recorded with backend "unknown": no handle, no relaunch
    unknown = backend.of("unknown")
    assert unknown.alive(None) is None and not unknown.relaunchable and not unknown.in_container


def test_tmux_through_the_interface(tmp_path: Path) -> None:
    tmux = backend.get("tmux")
    hp = _plan(tmp_path, ["sleep", "600"])
    run_id = f"bk-{os.getpid()}-{int(time.time())}"
    tmux.name_host(
        hp,
        run_id=run_id,
        facts=HostFacts(host=None, home=str(tmp_path), uid=os.getuid(), gid=os.getgid()),
        config={},
    )
    assert hp.tmux_session and hp.tmux_window == "node0" and not hp.container
    tmux.require(None, None, None)
    assert tmux.alive(hp) is False  # not started yet
    try:
        tmux.start(hp, _Plan())
        assert tmux.alive(hp) is True
        assert tmux.launcher_pids(hp), "the pane's shell is what a stop reaches before any record"
        assert tmux.signal(hp, "TERM") is False, "tmux holds no signal: the recorded pids get it"
        assert tmux.logs_argv(hp, lines=5, follow=False) is None  # the supervisor log file
        assert "attach-session" in tmux.attach_argv(run_id, hp)
        assert ("tmux", f"{hp.tmux_session}:node0") in tmux.describe(hp)
        tmux.kill(hp)
        assert _until(lambda: tmux.alive(hp) is False)
        tmux.relaunch(run_id, hp)
        assert tmux.alive(hp) is True
        tmux.remove(hp)
        assert _until(lambda: tmux.alive(hp) is False)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", f"={hp.tmux_session}"], capture_output=True)


def test_foreground_holds_no_handle(tmp_path: Path) -> None:
    fg = backend.get("foreground")
    hp = _plan(tmp_path, ["true"])
    fg.name_host(
        hp,
        run_id="r",
        facts=HostFacts(host=None, home=str(tmp_path), uid=os.getuid(), gid=os.getgid()),
        config={},
    )
    assert fg.runs_here and not fg.relaunchable and not fg.in_container
    assert hp.tmux_session is None and hp.container is None
    assert fg.alive(hp) is None and fg.signal(hp, "TERM") is False and fg.launcher_pids(hp) == []
    with pytest.raises(RunnerError, match="starts in the launching terminal"):
        fg.start(hp, _Plan())
    with pytest.raises(RunnerError, match="nothing to attach to"):
        fg.attach_argv("r", hp)
    with pytest.raises(RunnerError, match="relaunch it there"):
        fg.relaunch("r", hp)


@pytest.mark.docker
def test_docker_through_the_interface(tmp_path: Path, base_image: str) -> None:
    dk = backend.get("docker")
    hp = _plan(tmp_path, ["sleep", "600"])
    run_id = f"bk-{os.getpid()}-{int(time.time())}"
    facts = HostFacts(host=None, home=str(tmp_path), uid=os.getuid(), gid=os.getgid())
    dk.require(None, type("Req", (), {"image": base_image})(), facts)
    assert facts.image_id, "require records the image's id for the plan"
    dk.name_host(hp, run_id=run_id, facts=facts, config={"target": {"path": "/models/t"}})
    assert hp.container and hp.labels["io.dflash.run"] == run_id
    assert {m.target for m in hp.mounts} >= {hp.runs_root, hp.cache_dir, "/models/t"}
    hp.mounts = [m for m in hp.mounts if m.target != "/models/t"]  # not on this machine
    Path(hp.cache_dir).mkdir()
    try:
        dk.start(hp, _Plan(base_image))
        assert dk.alive(hp) is True
        assert dk.logs_argv(hp, lines=5, follow=False)[-1] == hp.container
        assert "attach" in dk.attach_argv(run_id, hp)
        assert dk.signal(hp, "KILL") is True
        assert _until(lambda: dk.alive(hp) is False)
        dk.relaunch(run_id, hp)
        assert dk.alive(hp) is True
        dk.kill(hp)
        assert _until(lambda: dk.alive(hp) is False)
        dk.remove(hp)
        assert dk.alive(hp) is None or dk.alive(hp) is False
        gone = subprocess.run(["docker", "inspect", hp.container], capture_output=True)
        assert gone.returncode != 0, "remove leaves no container"
    finally:
        subprocess.run(["docker", "rm", "-f", hp.container], capture_output=True)


@pytest.mark.docker
def test_docker_finds_containers_by_their_labels(
    tmp_path: Path, base_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container renamed by hand is still the run's (ps's state and stop reach it through
    control.located), and one whose registry entry is gone is a line of ps (control.strays); another
    registry's containers are neither."""
    monkeypatch.setenv("DFLASH_STATE_DIR", str(tmp_path / "state"))
    dk = backend.get("docker")
    hp = _plan(tmp_path, ["sleep", "600"])
    run_id = f"lb-{os.getpid()}-{int(time.time())}"
    facts = HostFacts(host=None, home=str(tmp_path), uid=os.getuid(), gid=os.getgid())
    dk.require(None, type("Req", (), {"image": base_image})(), facts)
    dk.name_host(hp, run_id=run_id, facts=facts, config={})
    Path(hp.cache_dir).mkdir()
    assert hp.container
    renamed = hp.container + "-renamed"
    rec = RunRecord(
        run_id=run_id, name="lb", backend="docker", created_at=time.time(), config="",
        hosts=[HostRecord(node_rank=0, host=None, run_dir=hp.run_dir, container=hp.container)],
    )  # fmt: skip
    try:
        dk.start(hp, _Plan(base_image))
        assert control.located(rec).hosts[0].container == hp.container, "the recorded name while it exists"
        subprocess.run(["docker", "rename", hp.container, renamed], check=True, capture_output=True)
        assert dk.alive(rec.hosts[0]) is None or dk.alive(rec.hosts[0]) is False, "the recorded name is gone"
        found = control.located(rec).hosts[0]
        assert found.container == renamed and dk.alive(found) is True
        ident = Registry().ident
        assert (renamed, run_id) in dk.found(None, ident)
        assert control.strays([rec], ident) == [], "a registered run's container is no stray"
        lines = control.strays([], ident)
        assert len(lines) == 1 and renamed in lines[0] and run_id in lines[0] and "docker rm -f" in lines[0]
        assert control.strays([], "0" * 12) == [], "another registry's containers are not this one's"
        dk.kill(found)
        assert _until(lambda: dk.alive(found) is False)
    finally:
        subprocess.run(["docker", "rm", "-f", hp.container, renamed], capture_output=True)
