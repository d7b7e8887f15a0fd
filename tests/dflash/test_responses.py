"""The target's own responses as training data (dflash.data.responses), on the CPU with the demo's tiny
target loaded through transformers: generated once into content-addressed shards, resumed where it
stopped, another setting another dataset, a damaged shard refused in one line, and the job
training on them with data.responses = true."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from jobs import PIPELINE_SETS, start_job
from shared_inputs import seed_runs_root
from transformers import AutoModelForCausalLM

from dflash.config import load_config
from dflash.data.demo import demo_records
from dflash.data.inputs import open_target
from dflash.data.responses import SHARDS, dataset_dir, ensure
from dflash.data.tokenizer import record_prompt
from dflash.errors import DFlashError
from dflash.specdec import Target, greedy

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def setup(tmp_path):
    root = seed_runs_root(tmp_path / "runs")
    data = tmp_path / "prompts.jsonl"
    records = demo_records(70, seed=5)
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    sets = [f"run.runs_root={root}", f"data.path={data}", "data.response_max_new=6"]
    cfg = load_config(str(REPO / "configs" / "demo-cpu.toml"), sets)
    target, tok, _ = open_target(cfg)
    return cfg, data, target, tok, sets


def test_responses_are_generated_once_into_shards_and_resume(setup) -> None:
    cfg, data, target, tok, _ = setup
    out = ensure(cfg, str(data), target, tok, batch=8, log=lambda m: None)
    lines = out.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 70
    src = [json.loads(line) for line in data.read_text().splitlines()]
    prompts = [record_prompt(r, tok, cfg.data.response_prompt_tokens) for r in src]
    for have, prompt in zip(records, prompts, strict=True):
        assert prompt and have["input_ids"][: len(prompt)] == prompt  # the eval's prompt rule
        n = len(have["input_ids"]) - len(prompt)
        assert have["loss_mask"] == [0] * len(prompt) + [1] * n and 1 <= n <= 6
        assert have["response"] == tok.decode(have["input_ids"][len(prompt) :])
    # The ids are the target's greedy continuation, as its plain cached loop (dflash.specdec) says it.
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, local_files_only=True)
    plain = Target(model, [0])
    for have, prompt in list(zip(records, prompts, strict=True))[:6]:
        said = greedy(plain, prompt, max_new=6, eos=tok.eos_token_id).tokens
        assert have["input_ids"][len(prompt) :] == said
    directory = out.parent
    done = json.loads((directory / SHARDS).read_text())
    assert sorted(done) == ["shard-00000.jsonl", "shard-00001.jsonl"]
    # Interrupted after the first shard: only the second is generated again, to the same bytes.
    first = directory / "shard-00000.jsonl"
    stamp = first.stat().st_mtime_ns
    (directory / "shard-00001.jsonl").unlink()
    del done["shard-00001.jsonl"]
    (directory / SHARDS).write_text(json.dumps(done))
    os.utime(directory / SHARDS)
    again = ensure(cfg, str(data), target, tok, batch=8, log=lambda m: None)
    assert again.read_text().splitlines() == lines and first.stat().st_mtime_ns == stamp


def test_a_record_without_a_usable_prompt_is_skipped_and_logged(setup, tmp_path) -> None:
    cfg, _, target, tok, _ = setup
    data = tmp_path / "odd.jsonl"
    bad = {"messages": ["not an object", {"role": "assistant", "content": "x"}]}
    data.write_text("".join(json.dumps(r) + "\n" for r in [*demo_records(4, seed=6), bad]))
    logs: list[str] = []
    out = ensure(cfg, str(data), target, tok, batch=8, log=logs.append)
    assert len(out.read_text().splitlines()) == 4
    assert any("record 5: no prompt: messages[0] is not an object" in m for m in logs), logs


def test_another_setting_is_another_dataset_and_a_damaged_shard_is_refused(setup) -> None:
    cfg, data, target, tok, sets = setup
    out = ensure(cfg, str(data), target, tok, batch=16, log=lambda m: None)
    other = load_config(str(REPO / "configs" / "demo-cpu.toml"), [*sets, "data.response_temperature=0.7"])
    assert dataset_dir(other, str(data), target)[0] != out.parent
    shard = out.parent / "shard-00000.jsonl"
    shard.write_text(shard.read_text().replace('"response": "', '"response": "x', 1))
    with pytest.raises(DFlashError) as e:
        ensure(cfg, str(data), target, tok, log=lambda m: None)
    assert "shard-00000.jsonl is damaged" in str(e.value) and "\n" not in str(e.value)


def test_the_job_trains_on_its_targets_responses(repo, tmp_path) -> None:
    """The demo config trains on responses (data.responses = true); here with settings of its own,
    so the job generates them at its start (the seeded runs root holds the default ones)."""
    run_dir = tmp_path / "run"
    sets = [*PIPELINE_SETS, "--set", "train.total_steps=3", "--set", "data.response_max_new=24"]
    proc = start_job("dflash.train", repo, tmp_path, run_dir, *sets)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    cfg = load_config(
        str(REPO / "configs" / "demo-cpu.toml"), [f"run.runs_root={tmp_path}", "data.response_max_new=24"]
    )
    corpus, target = tmp_path / ".demo" / "corpus.jsonl", tmp_path / ".tiny-target-l8-h64-s0"
    directory = dataset_dir(cfg, str(corpus), str(target))[0]
    records = [json.loads(line) for line in (directory / "responses.jsonl").read_text().splitlines()]
    assert len(records) == 2000  # the demo corpus's prompts, each answered
    assert all(1 <= sum(r["loss_mask"]) <= 24 for r in records)
    data_log = (run_dir / "logs" / "data.log").read_text()
    assert (
        "[responses] 2000/2000 prompts" in data_log
        and f"tokenizing {directory / 'responses.jsonl'}" in data_log
    )
