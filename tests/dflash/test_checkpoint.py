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
        and cfg["torch_dtype"] == "float32"  # what the file holds
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


def test_trainer_state_loads_on_cpu_whatever_the_weights_device(tmp_path):
    """RNG states must come back as CPU ByteTensors (set_rng_state refuses anything else), also when
    the weights are loaded straight onto a GPU; 'meta' stands in for the device here."""
    from dflash.checkpoint import rng_state, set_rng_state

    gen = torch.Generator().manual_seed(3)
    save_checkpoint(
        tmp_path,
        1,
        weights={"w": torch.ones(2)},
        hf_config={},
        trainer_state={"rng": rng_state(), "anchor_gen": gen.get_state()},
        keep_last=1,
    )
    weights, _, state = load_checkpoint(tmp_path / "step-1", map_location="meta")
    assert weights["w"].device.type == "meta"
    assert state["anchor_gen"].device.type == "cpu"
    torch.Generator().set_state(state["anchor_gen"])
    set_rng_state(state["rng"])


def test_export_makes_a_servable_bf16_drafter(tmp_path):
    import pytest
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    from dflash.config import DrafterConfig
    from dflash.errors import DFlashError
    from dflash.export import main as export_main
    from dflash.step.model import DFlashDrafter, DrafterSpec, resolve_spec

    target = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    spec = resolve_spec(DrafterConfig(num_layers=2, num_target_layers=2), target, mask_token_id=60)
    embed, head = torch.randn(64, 32), torch.randn(64, 32)
    weights = DFlashDrafter(spec, embed, head, backend="sdpa").trainable_state_dict()
    run = tmp_path / "run"
    for step in (2, 4):
        save_checkpoint(
            run / "checkpoints",
            step,
            weights=weights,
            hf_config=spec.to_hf_config(),
            trainer_state={"step": step},
            keep_last=2,
        )
    out = tmp_path / "served"
    assert export_main([str(run), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    got = load_file(str(out / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    assert torch.equal(got["fc.weight"], weights["fc.weight"].bfloat16())
    served = DFlashDrafter(
        DrafterSpec.from_hf_config(json.loads((out / "config.json").read_text())), embed, head, backend="sdpa"
    )
    missing, unexpected = served.load_state_dict({k: v.float() for k, v in got.items()}, strict=False)
    assert not unexpected and all(k.startswith("rotary_emb.") for k in missing), (missing, unexpected)
    assert set(got) == set(served.trainable_state_dict()), "every drafter weight, named as the model names it"
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and DrafterSpec.from_hf_config(config) == spec

    assert export_main([str(run), str(out)]) == 2, "an existing output is not overwritten silently"
    assert export_main([str(run / "checkpoints" / "step-2"), str(out), "--force", "--dtype", "float32"]) == 0
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.float32
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".served")], "no temp dirs left"
    with pytest.raises(DFlashError, match="neither a checkpoint"):
        from dflash.export import export

        export(tmp_path / "nothing", tmp_path / "x")
