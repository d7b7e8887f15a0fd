import json
import os
import shutil

import torch

from dflash.checkpoint import find_latest, load_checkpoint, save_checkpoint


def _save(root, step, keep=2):
    return save_checkpoint(
        root,
        step,
        weights={"w": torch.full((2, 2), float(step))},
        hf_config={"block_size": 16},
        trainer_state={"step": step},
        keep_last=keep,
    )


def test_save_load_keep_last(tmp_path):
    for s in (10, 20, 30):
        _save(tmp_path, s)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-20", "step-30"]
    found = find_latest(tmp_path)
    w, cfg, st = load_checkpoint(found.path)
    assert (
        found.path.name == "step-30"
        and st["step"] == 30
        and float(w["w"][0, 0]) == 30
        and cfg["block_size"] == 16
    )


def test_torn_checkpoints_are_ignored(tmp_path):
    _save(tmp_path, 10)
    good = _save(tmp_path, 20)
    # a crash mid-save leaves a temp dir; a damaged step dir has a truncated file
    (tmp_path / ".tmp-step-30-abc").mkdir()
    torn = tmp_path / "step-40"
    shutil.copytree(good, torn)
    meta = json.loads((torn / "meta.json").read_text())
    meta["step"] = 40
    (torn / "meta.json").write_text(json.dumps(meta))
    with open(torn / "model.safetensors", "r+b") as f:
        f.truncate(10)
    found = find_latest(tmp_path)
    assert found.path == good
    assert {p.name for p in found.torn} == {".tmp-step-30-abc", "step-40"}
    os.remove(torn / "meta.json")
    assert find_latest(tmp_path).path == good
