"""The launch plan as data: whole plans compared without touching tmux, ssh or Docker."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from runner.errors import RunnerError
from runner.exec.remote import parse_host, remote_argv
from runner.launch.docker import run_argv
from runner.launch.plan import HostFacts, HostPlan, Mount, Request, build_plan, shell_line
from runner.launch.registry import Registry, check_name
from runner.launch.tmux import start_argv

KEY = "ab" * 32


def _facts(host: str | None = None, **kw) -> HostFacts:
    base = dict(
        host=host,
        home="/home/u",
        python="/venv/bin/python",
        uid=1000,
        gid=1000,
        cwd="/work" if host is None else None,
        check={"ok": True, "config": {"run": {"runs_root": "runs"}, "data": {"path": "/data/c.jsonl"}},
               "shm_bytes": 100 << 20},
        cache_key=KEY,
        cache_action="restore",
    )  # fmt: skip
    base.update(kw)
    return HostFacts(**base)  # type: ignore[arg-type]


def test_tmux_plan_single_host() -> None:
    req = Request(config="configs/demo-cpu.toml", backend="tmux", name="demo", sets=["train.lr=1e-3"])
    plan = build_plan(req, [_facts()], run_id="demo-20261201-000000-abcd", config_name="demo-cpu")
    run_dir = "/work/runs/demo-20261201-000000-abcd"
    cache = f"/home/u/.cache/dflashctl/compile/{KEY}"
    assert plan.hosts == [
        HostPlan(
            node_rank=0,
            host=None,
            run_dir=run_dir,
            runs_root="/work/runs",
            cwd="/work",
            config_path=f"{run_dir}/config.toml",
            argv=["/venv/bin/python", "-m", "dflash.launch", f"{run_dir}/config.toml",
                  "--set", "train.lr=1e-3", "--set", "run.name=demo", "--set", "run.runs_root=/work/runs",
                  "--run-dir", run_dir],
            env={"DFLASH_CACHE_DIR": cache, "PYTHONUNBUFFERED": "1", "DFLASH_RUN_BACKEND": "tmux",
                 "DFLASH_CACHE_ARTIFACT": KEY, "DFLASH_EXPECT_WARM_CACHE": "1"},
            cache_dir=cache,
            cache_key=KEY,
            cache_action="restore",
            shm_bytes=(100 << 20) + (256 << 20),
            gpus=False,
            tmux_session="dflash-demo-20261201-000000-abcd",
            tmux_window="node0",
            uid=1000,
            gid=1000,
        )
    ]  # fmt: skip
    assert plan.nnodes == 1 and plan.rdzv_endpoint is None
    assert start_argv(plan.hosts[0], new_session=True)[:8] == [
        "tmux", "new-session", "-d", "-s", "dflash-demo-20261201-000000-abcd", "-n", "node0", "sh",
    ]  # fmt: skip


def test_docker_plan_labels_mounts_shm_user() -> None:
    req = Request(config="c.toml", backend="docker", image="dflash:cu130", name="big")
    facts = _facts(has_gpus=True, image_id="sha256:" + "1" * 64, lock_sha256="2" * 64, cache_action="none")
    plan = build_plan(req, [facts], run_id="big-1-2-ffff", config_name="c")
    hp = plan.hosts[0]
    assert hp.container == "dflash-big-1-2-ffff-node0"
    assert hp.labels == {
        "io.dflash.run": "big-1-2-ffff",
        "io.dflash.role": "supervisor",
        "io.dflash.host": "local",
        "io.dflash.node": "0",
        "io.dflash.registry": Registry().ident,
    }
    assert hp.mounts == [
        Mount(source="/work/runs", target="/work/runs"),
        Mount(source=hp.cache_dir, target=hp.cache_dir),
        Mount(source="/data/c.jsonl", target="/data/c.jsonl", read_only=True),
    ]
    assert "DFLASH_EXPECT_WARM_CACHE" not in hp.env  # nothing restored: a cold compile is expected
    assert hp.env["DFLASH_IMAGE_DIGEST"] == "sha256:" + "1" * 64
    argv = run_argv(hp, "dflash:cu130")
    assert argv[:4] == ["docker", "run", "-d", "--init"]
    assert argv[argv.index("--user") : argv.index("--user") + 2] == ["--user", "1000:1000"]
    assert argv[argv.index("--shm-size") + 1] == str(hp.shm_bytes)
    assert "--gpus" in argv and "--restart" not in argv
    assert argv[argv.index("dflash:cu130") + 1 :] == hp.argv


def test_two_hosts_use_the_jobs_plan() -> None:
    req = Request(
        config="c.toml", backend="tmux", hosts=["a@gpu0", "a@gpu1:2222"], name="mh", rdzv_port=29555
    )
    per_node = [
        ["dflash.launch", "CFG", "--set", "run.name=mh", "--run-dir", f"/dflash-plan/x-node{i}",
         "--nnodes", "2", "--node-rank", str(i), "--rdzv-endpoint", "gpu0:29555"]
        for i in range(2)
    ]  # fmt: skip
    facts = [
        _facts("a@gpu0", rdzv_host="gpu0", plan_args=per_node[0]),
        _facts("a@gpu1:2222", plan_args=per_node[1]),
    ]
    plan = build_plan(req, facts, run_id="mh-1-2-0000", config_name="c")
    assert plan.rdzv_endpoint == "gpu0:29555"
    for i, hp in enumerate(plan.hosts):
        assert hp.run_dir == f"/home/u/runs/mh-1-2-0000-node{i}"
        assert hp.argv[hp.argv.index("--node-rank") + 1] == str(i)
        assert hp.argv[3] == f"{hp.run_dir}/config.toml"
        assert hp.argv[hp.argv.index("--run-dir") + 1] == hp.run_dir
        assert "run.runs_root=/home/u/runs" in hp.argv
        assert hp.tmux_session == "dflash-mh-1-2-0000" and hp.tmux_window == f"node{i}"


def test_shell_line_quotes_every_value_once(tmp_path) -> None:
    marker = tmp_path / "pwned"
    hp = build_plan(
        Request(
            config="c.toml", name="q", sets=[f"data.path=x; touch {marker}", f"run.seed=$(touch {marker})"]
        ),
        [_facts(cwd=str(tmp_path), python="echo")],
        run_id="q-1-2-0000",
        config_name="c",
    ).hosts[0]
    line = shell_line(hp, log=False)
    out = subprocess.run(["sh", "-c", line], capture_output=True, text=True, check=True).stdout
    assert f"data.path=x; touch {marker}" in out and f"run.seed=$(touch {marker})" in out
    assert not marker.exists()
    # Over ssh the same line is quoted once more, for the remote login shell.
    argv = remote_argv("u@h", ["sh", "-c", line])
    assert shlex.split(argv[-1]) == ["sh", "-c", line]


@pytest.mark.parametrize(
    "spec", ["-oProxyCommand=touch /tmp/x", "a b", "u@h;id", "u@h:99999", "u@-h", "", "u@h:", "$(id)"]
)
def test_hosts_that_are_not_hosts_are_refused(spec: str) -> None:
    with pytest.raises(RunnerError, match="USER@HOST"):
        parse_host(spec)


def test_host_forms() -> None:
    assert parse_host("root@10.0.0.5").destination == "root@10.0.0.5"
    h = parse_host("gpu1:2222")
    assert (h.user, h.hostname, h.port) == (None, "gpu1", 2222)
    assert parse_host("u@[::1]:22").hostname == "::1"
    argv = remote_argv("u@h:2200", ["true"])
    assert (
        argv[argv.index("--") - 2 : argv.index("--")] == ["-p", "2200"]
        and argv[argv.index("--") + 1] == "u@h"
    )


@pytest.mark.parametrize("name", ["x:y", "-lead", ".lead", "sp ace", "a" * 49, "ünï", "a/b"])
def test_bad_run_names(name: str) -> None:
    with pytest.raises(RunnerError, match="run name"):
        check_name(name)


def test_a_dotted_name_keeps_its_name_and_gets_safe_backend_names() -> None:
    """The config's run.name as given in the run id, run dir, argv and labels; tmux and Docker get
    the derived backend name (runner/launch/registry.py backend_name)."""
    run_id = "qwen3.6-27b-5t3d-20261204-101500-1a2b"
    tm = build_plan(
        Request(config="c.toml", name="qwen3.6-27b-5t3d"), [_facts()], run_id=run_id, config_name="c"
    )
    dk = build_plan(
        Request(config="c.toml", backend="docker", image="dflash:cu130", name="qwen3.6-27b-5t3d"),
        [_facts()],
        run_id=run_id,
        config_name="c",
    )
    for plan in (tm, dk):
        hp = plan.hosts[0]
        assert plan.name == "qwen3.6-27b-5t3d" and hp.run_dir == f"/work/runs/{run_id}"
        assert "run.name=qwen3.6-27b-5t3d" in hp.argv
    assert (tm.hosts[0].tmux_session, tm.hosts[0].tmux_window) == (
        "dflash-qwen3_6-27b-5t3d-20261204-101500-1a2b",
        "node0",
    )
    assert dk.hosts[0].container == "dflash-qwen3_6-27b-5t3d-20261204-101500-1a2b-node0"
    assert dk.hosts[0].labels["io.dflash.run"] == run_id, "labels carry the run id as it is"
    argv = run_argv(dk.hosts[0], "dflash:cu130")
    assert argv[argv.index("--name") + 1] == dk.hosts[0].container


def test_request_checks() -> None:
    with pytest.raises(RunnerError, match="--backend"):
        Request(config="c", backend="k8s")
    with pytest.raises(RunnerError, match="needs --image"):
        Request(config="c", backend="docker")
    with pytest.raises(RunnerError, match="key=value"):
        Request(config="c", sets=["train.lr"])
