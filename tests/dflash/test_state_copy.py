"""The drafter state copy (dflash.pipeline.state_copy) with the real trainer on the CPU: a copy
restored into a fresh trainer equals the trainer at that step and trains on identically; a slot torn
by a death mid-copy is never used; the host-memory refusal names the setting; stale copy
directories of a dead supervisor are swept and a live one's kept."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from qwen3_sizes import QWEN3_8B
from test_trainer_step import CPU_SETS, _batches, _trainer

from dflash.errors import ConfigError
from dflash.pipeline import state_copy as sc
from dflash.rundir import supervisor_token


def _same_state(a, b) -> None:
    wa, wb = a.weights(), b.weights()
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k].cpu(), wb[k].cpu()), k
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["state"].keys() == sb["state"].keys() and len(sa["state"]) > 0
    for i in sa["state"]:
        for key, v in sa["state"][i].items():
            assert torch.equal(v.cpu(), sb["state"][i][key].cpu()), (i, key)
    assert a.step == b.step
    assert a.scheduler.state_dict() == b.scheduler.state_dict()
    assert torch.equal(a.anchor_gen.get_state(), b.anchor_gen.get_state())


def test_a_restored_copy_is_the_trainer_at_its_step_and_trains_on_alike(repo, tmp_path):
    cpu = torch.device("cpu")
    trainer, spec = _trainer(repo, cpu, torch.float32, *CPU_SETS)
    batches = _batches(spec, 6, torch.float32, S=128)
    copier = sc.StateCopier(trainer, tmp_path, rank=0, writes_tensors=True, every=2)
    trainer.state_copy = copier
    at4 = None
    for i, b in enumerate(batches[:5]):
        trainer.train_step(*b)
        if i == 3:
            torch.manual_seed(1234)  # the global RNG as the copy of step 4 must restore it
            at4 = torch.get_rng_state()
            trainer.state_copy.after_update(4)  # the copy of step 4 again, after the seed
    copier.close()
    assert trainer.step == 5 and copier.committed() == 4
    assert sc.complete_steps(tmp_path, 0) == {2, 4}
    # The file is what dflash.check and the launcher's host-memory check size it as.
    assert (tmp_path / "tensors").stat().st_size == sc.copies_nbytes(spec)
    assert sc.torn_slots(tmp_path) == []

    # The reference: a trainer that took the same four steps.
    ref, _ = _trainer(repo, cpu, torch.float32, *CPU_SETS)
    for b in batches[:4]:
        ref.train_step(*b)
    fresh, _ = _trainer(repo, cpu, torch.float32, *CPU_SETS)
    torch.manual_seed(99)
    assert sc.load_copy(fresh, tmp_path, 0, 4)
    assert torch.equal(torch.get_rng_state(), at4)
    _same_state(fresh, ref)
    # Trains on as the uninterrupted trainer did: the same step 5 and 6.
    for b in batches[4:]:
        want, got = ref.train_step(*b), fresh.train_step(*b)
        assert got.loss == want.loss and got.grad_norm == want.grad_norm
    _same_state(fresh, ref)


@pytest.mark.gpu
def test_on_the_gpu_a_copy_is_the_trainer_at_its_step(repo, tmp_path):
    """The GPU path: the copy on the copy stream into page-locked shared memory restores into a
    fresh trainer as the live trainer at the copy's step."""
    dev = torch.device("cuda")
    trainer, spec = _trainer(repo, dev, torch.bfloat16)
    root = tmp_path / "copies"
    root.mkdir()
    copier = sc.StateCopier(trainer, root, rank=0, writes_tensors=True, every=1)
    trainer.state_copy = copier
    batches = _batches(spec, 4, torch.bfloat16)
    trainer.train_step(*batches[0])  # makes the file; page-locking runs in the background
    assert copier.wait_ready(timeout=120) and copier.pinned
    for b in batches[1:]:
        trainer.train_step(*b)
    torch.cuda.synchronize()
    copier.close()
    assert copier.committed() == 4 and sc.torn_slots(root) == []
    fresh, _ = _trainer(repo, dev, torch.bfloat16)
    assert sc.load_copy(fresh, root, 0, 4)
    _same_state(fresh, trainer)


def test_a_torn_copy_is_never_used(repo, tmp_path):
    cpu = torch.device("cpu")
    trainer, spec = _trainer(repo, cpu, torch.float32, *CPU_SETS)
    copier = sc.StateCopier(trainer, tmp_path, rank=0, writes_tensors=True, every=1)
    trainer.state_copy = copier
    for b in _batches(spec, 2, torch.float32, S=128):
        trainer.train_step(*b)
    copier.close()
    assert sc.complete_steps(tmp_path, 0) == {1, 2}
    # A death mid-copy of step 3 into step 1's slot: begin written, end not.
    f = sc.TensorFile.open(tmp_path / "tensors")
    assert f is not None
    slot = f.complete_steps()[1]
    f.set_begin(slot, 3)
    views = f.views(slot)
    next(iter(views.values())).fill_(float("nan"))  # half-written bytes
    f.close()
    assert sc.torn_slots(tmp_path) == [(3, -2)]
    assert sc.complete_steps(tmp_path, 0) == {2}
    fresh, _ = _trainer(repo, cpu, torch.float32, *CPU_SETS)
    assert not sc.load_copy(fresh, tmp_path, 0, 1) and not sc.load_copy(fresh, tmp_path, 0, 3)
    assert fresh.step == 0
    assert sc.load_copy(fresh, tmp_path, 0, 2) and fresh.step == 2
    # A header that is not ours (a file truncated or of another version) is no copy at all.
    (tmp_path / "tensors").write_bytes(b"garbage" * 100)
    assert sc.complete_steps(tmp_path, 0) == set() and not sc.load_copy(fresh, tmp_path, 0, 2)


def test_host_memory_refusal_names_the_setting(repo):
    from dflash.config import load_config
    from dflash.step.model import resolve_spec

    gib = 1 << 30
    assert sc.host_memory_problem(gib, 10 * gib, 10 * gib, 1, 1) is None
    # Two copies do not fit beside the queue: /dev/shm is the bound.
    problem = sc.host_memory_problem(gib, 3 * gib, 10 * gib, 1, 1, queue_bytes=2 * gib)
    assert isinstance(problem, ConfigError)
    line = str(problem)
    assert "pipeline.state_copy_every" in line and "2.0 GiB" in line and "/dev/shm" in line
    assert "--shm-size" in line and "state_copy_every = 0" in line
    problem = sc.host_memory_problem(gib, 10 * gib, gib, 3, 2)
    assert problem is not None and "MemAvailable" in str(problem) and "3 drafter(s)" in str(problem)
    # The shipped 8B drafter's copy: 12 bytes per trainable parameter (float32 weights, two moments).
    from transformers import Qwen3Config

    cfg = load_config(repo / "configs" / "qwen3-8b.toml", [])
    target = Qwen3Config(**QWEN3_8B)
    spec = resolve_spec(cfg.drafter, target, 151669)
    n = sc.copy_nbytes(spec)
    assert 12 * 0.9e9 < n < 12 * 1.3e9, n  # about 1B trainable parameters (issue 43: 1.09B)


def test_the_launch_refuses_before_any_worker_when_the_copies_do_not_fit(repo, tmp_path, monkeypatch):
    """dflash.pipeline.supervisor.state_copies, which the launcher calls before the queue and the workers exist."""
    from dflash.config import load_config
    from dflash.pipeline import supervisor as launch
    from dflash.rundir import RunDir

    cfg = load_config(repo / "configs" / "demo-cpu.toml", [])
    spec = _trainer(repo, torch.device("cpu"), torch.float32, *CPU_SETS)[1]
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    monkeypatch.setattr(sc, "host_room", lambda: (1 << 20, 1 << 20))
    name = f"test-refusal-{os.getpid()}"
    with pytest.raises(ConfigError, match=r"pipeline\.state_copy_every"):
        launch.state_copies(cfg, spec, run, name, 0)
    assert not sc.copy_dir(name).exists()
    monkeypatch.undo()
    launch.state_copies(cfg, spec, run, name, 0)
    try:
        owner = (sc.copy_dir(name) / sc.OWNER).read_text().split()
        assert owner[-1] == supervisor_token()
    finally:
        sc.remove_copies(name)
    assert not sc.copy_dir(name).exists()


def test_stale_copies_of_a_dead_supervisor_are_swept_and_a_live_ones_kept(tmp_path):
    dead = subprocess.Popen(
        [sys.executable, "-c", "from dflash.rundir import supervisor_token as t; print(t())"],
        stdout=subprocess.PIPE,
        text=True,
    )
    dead_token = dead.communicate()[0].strip()
    live, gone, foreign, fresh, garbled = (
        tmp_path / f"dflash-hs-{n}-n0-state" for n in ("live", "gone", "foreign", "fresh", "garbled")
    )
    for d in (live, gone, foreign, fresh, garbled):
        d.mkdir()
        (d / "tensors").write_bytes(b"x" * 10)
    (live / sc.OWNER).write_text(sc.owner_line(supervisor_token()))
    (gone / sc.OWNER).write_text(sc.owner_line(dead_token))
    boot, _, _ = sc.owner_line("x").split()
    (foreign / sc.OWNER).write_text(f"{boot} 1 {dead_token}")  # another pid namespace: cannot judge
    (garbled / sc.OWNER).write_text("what")
    old = time.time() - 3600
    os.utime(garbled, (old, old))
    other = tmp_path / "dflash-hs-old-n0-state"
    other.mkdir()
    (other / sc.OWNER).write_text(f"another-boot 1 {supervisor_token()}")  # before a reboot
    assert sorted(sc.remove_stale_copies(tmp_path)) == sorted([gone, garbled, other])
    assert live.exists() and foreign.exists() and fresh.exists()
    os.utime(fresh, (old, old))  # no owner written for long: a start that died before it
    assert sc.remove_stale_copies(tmp_path) == [fresh]
