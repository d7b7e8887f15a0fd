"""Every numeric field of every config section, fed NaN, infinities, zero, a negative and a 65-bit value
through `--set` on the demo config: a ConfigError naming exactly that key, or a value whose meaning
is documented (ALLOWED below). The fields are found by introspection, so a new field is swept too."""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path

import pytest

from dflash.config import (
    JobConfig,
    apply_overrides,
    collect_config,
    config_warnings,
    load_config,
    numeric_fields,
    read_config_file,
)
from dflash.errors import ConfigError

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo-cpu.toml"

ALLOWED: dict[str, set[float]] = {
    "run.seed": {0},  # a seed like any other
    "run.memory_headroom_gb": {0},  # no headroom: the measured peak may fill the device
    "drafter.mask_token_id": {0, -1},  # a token id; -1 = the tokenizer's mask token
    "drafter.target_layer_ids": {0},  # layer 0 of the target
    "drafter.hidden_size": {0},  # 0 = the target's (and the four sizes below)
    "drafter.intermediate_size": {0},
    "drafter.num_attention_heads": {0},
    "drafter.num_key_value_heads": {0},
    "drafter.head_dim": {0},
    "drafter.noise_std": {0},  # no noise
    "data.max_bad_fraction": {0},  # any bad record stops the job
    "train.warmup_steps": {0},  # no warmup
    "train.min_lr_ratio": {0},  # cosine down to zero
    "train.weight_decay": {0},  # off
    "train.block_token_budget": {0},  # derived: the longest bucket's block tokens
    "train.betas": {0},  # no momentum / no second-moment averaging
    "train.tau_budget": {0},  # the first and the final checkpoint measured
    "pipeline.max_restarts": {0},  # no drafter-group restarts
    "pipeline.slot_mb": {0},  # derived from the batch shape
    "pipeline.state_copy_every": {0},  # no state copies: a death rolls back to the checkpoint
    "data.response_temperature": {0},  # greedy responses
}
"""Values accepted for their documented meaning (each field's docstring in dflash/config.py)."""

VALUES: list[tuple[str, float]] = [
    ("nan", math.nan),
    ("inf", math.inf),
    ("-inf", -math.inf),
    ("0", 0),
    ("-1", -1),
]
INT_VALUES: list[tuple[str, float]] = [("0.5", 0.5), (str(2**64), 2**64)]
"""Also for integer fields: not an integer, and past 64 bits."""


def _fields() -> list[tuple[str, type, bool, typing.Any]]:
    """(dotted key, int or float, is a list, default) of every numeric field of every section."""
    hints = typing.get_type_hints(JobConfig)
    out = []
    for section in dataclasses.fields(JobConfig):
        cls = hints[section.name]
        defaults = {f.name: f for f in dataclasses.fields(cls)}
        for name, (kind, _rng, is_list) in numeric_fields(cls).items():
            f = defaults[name]
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            out.append((f"{section.name}.{name}", kind, is_list, default))
    return out


FIELDS = _fields()


def _literal(text: str, is_list: bool, default: typing.Any) -> str:
    return f"[{', '.join([text] * max(1, len(default)))}]" if is_list else text


def test_the_walk_finds_every_section_and_every_field_declares_a_range():
    keys = {key for key, *_ in FIELDS}
    assert {k.split(".")[0] for k in keys} == {
        "run",
        "target",
        "drafter",
        "attention",
        "data",
        "train",
        "pipeline",
    }
    assert {"train.lr", "train.loss_chunk_tokens", "train.betas", "data.min_seq_len", "run.seed"} <= keys
    hints = typing.get_type_hints(JobConfig)
    for section in dataclasses.fields(JobConfig):
        for name, (_kind, rng, _is_list) in numeric_fields(hints[section.name]).items():
            assert rng is not None, f"{section.name}.{name} declares no Range"
    assert set(ALLOWED) <= keys, "the allowlist names only real fields"
    assert all(math.isfinite(v) for values in ALLOWED.values() for v in values), "never NaN or inf"


@pytest.mark.parametrize(("key", "kind", "is_list", "default"), FIELDS, ids=[f[0] for f in FIELDS])
def test_sweep(key, kind, is_list, default):
    base = read_config_file(DEMO)
    for text, value in VALUES + (INT_VALUES if kind is int else []):
        override = f"{key}={_literal(text, is_list, default)}"
        allowed = value in ALLOWED.get(key, set()) and (kind is float or float(value).is_integer())
        # The job's path (load_config) and dflash.check's (collect_config) must agree.
        _, errors = collect_config(apply_overrides(read_config_file(DEMO), [override]))
        if allowed:
            cfg = load_config(DEMO, [override])
            section, name = key.split(".")
            got = getattr(getattr(cfg, section), name)
            assert (got[0] if is_list else got) == value, override
            assert errors == [], (override, errors)
            continue
        with pytest.raises(ConfigError) as e:
            load_config(DEMO, [override])
        assert e.value.key == key, f"{override}: {e.value}"
        assert "must be" in e.value.problem and "got" in e.value.problem, f"{override}: {e.value}"
        # Resetting the key to its default can break a rule within its section (drafter.num_layers
        # against the demo's two layer_types): the first error is the key itself.
        assert errors and errors[0].key == key, (override, [str(err) for err in errors])
    assert read_config_file(DEMO) == base


def test_messages_name_the_allowed_range():
    cases = {
        "train.lr=nan": "train.lr: must be a positive number (finite), got nan",
        "train.loss_chunk_tokens=-1": "train.loss_chunk_tokens: must be an integer >= 1, got -1",
        "train.loss_chunk_tokens=0": "train.loss_chunk_tokens: must be an integer >= 1, got 0",
        "train.min_lr_ratio=-5": "train.min_lr_ratio: must be a number in [0, 1] (finite), got -5.0",
        "train.gamma=nan": "train.gamma: must be a positive number (finite), got nan",
        "train.grad_clip=nan": "train.grad_clip: must be a positive number (finite), got nan",
        "run.seed=-1": "run.seed: must be an integer in [0, 4294967295], got -1",
        "train.weight_decay=-1": "train.weight_decay: must be a number >= 0 (finite), got -1.0",
        "data.min_seq_len=-3": "data.min_seq_len: must be an integer >= 1, got -3",
        "run.status_interval_s=nan": "run.status_interval_s: must be a positive number (finite), got nan",
        "drafter.noise_std=nan": "drafter.noise_std: must be a number >= 0 (finite), got nan",
        "train.betas=[0.9, inf]": "train.betas: entry 1 must be a number in [0, 1) (finite), got inf",
        "train.token_budget='big'": "train.token_budget: must be an integer >= 1, got 'big'",
        "target.tiny_hidden=40": "target.tiny_hidden: must be a multiple of 16, got 40",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config(DEMO, [override])
        assert str(e.value) == f"config: {message}", override


def test_an_integer_past_the_digit_limit_is_named():
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, ["train.total_steps=" + "9" * 5000])
    assert e.value.key == "train.total_steps" and len(str(e.value)) < 200


def test_cross_field_rules():
    cases = {
        ("data.min_seq_len=300",): "data.min_seq_len",  # above data.max_seq_len (256)
        ("train.token_budget=200",): "train.token_budget",  # the longest padded sequence is 256
        ("data.max_seq_len=300",): "train.token_budget",  # 512 once padded; the budget is 2048: fine
        ("train.token_budget=500", "data.max_seq_len=300"): "train.token_budget",
        ("train.weight_decay=1000",): "train.weight_decay",  # lr 3e-3 x 1000 >= 1
        ("pipeline.drafters=3", "pipeline.queue_depth=5"): "pipeline.queue_depth",  # 2 per drafter
        ("pipeline.drafters=3", "pipeline.queue_depth=6"): None,
        # a state copy every 4 steps: each drafter holds up to 5 batches until a copy covers them
        (
            "pipeline.drafters=2",
            "pipeline.state_copy_every=4",
            "pipeline.queue_depth=9",
        ): "pipeline.queue_depth",
        ("pipeline.drafters=2", "pipeline.state_copy_every=4", "pipeline.queue_depth=10"): None,
        ("pipeline.drafters=2", "pipeline.state_copy_every=0", "pipeline.queue_depth=4"): None,
    }
    for overrides, key in cases.items():
        if key is None or overrides == ("data.max_seq_len=300",):
            load_config(DEMO, list(overrides))
            continue
        with pytest.raises(ConfigError) as e:
            load_config(DEMO, list(overrides))
        assert e.value.key == key, (overrides, e.value)
    # dflash.check gets all of them at once, with the config still built (for its host checks).
    data = apply_overrides(read_config_file(DEMO), ["data.min_seq_len=300", "train.token_budget=100"])
    cfg, errors = collect_config(data)
    assert cfg is not None and sorted(e.key for e in errors) == ["data.min_seq_len", "train.token_budget"]


def test_warmup_longer_than_the_run_is_a_warning_not_an_error():
    """Short smoke runs of the demo (total_steps 4, warmup 30) are common and harmless: warned."""
    cfg = load_config(DEMO, ["train.total_steps=4"])
    assert [w.key for w in config_warnings(cfg)] == ["train.warmup_steps"]
    assert config_warnings(load_config(DEMO)) == []


def test_sections_built_directly_are_checked_too():
    from dflash.config import DataConfig, TrainConfig

    with pytest.raises(ConfigError, match=r"train\.gamma"):
        TrainConfig(gamma=math.nan)
    ok = DataConfig(path="demo")
    with pytest.raises(ConfigError, match=r"data\.max_bad_fraction"):
        dataclasses.replace(ok, max_bad_fraction=1.5)


def test_dflash_check_reports_every_new_error_and_the_warning(tmp_path, capsys):
    import json

    from dflash import check

    sets = ["train.gamma=nan", "data.min_seq_len=999", "train.total_steps=4", f"run.runs_root={tmp_path}"]
    rc = check.main([str(DEMO), *[a for s in sets for a in ("--set", s)], "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 2 and sorted(e["key"] for e in report["errors"]) == ["data.min_seq_len", "train.gamma"]
    assert [w["key"] for w in report["warnings"]] == ["train.warmup_steps"]
