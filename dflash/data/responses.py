"""The target's own responses as training data: prompts from the data file, each answered by the
target (greedy or sampled, the chat template applied as a served model sees it), stored as a
versioned, content-addressed dataset that the job trains on with `data.responses = true`.

    python -m dflash.responses CONFIG [--set k=v ...] [--batch 16]

A drafter learns to predict what its target says; trained on corpus text it learns something
else (the demo's drafter trained on corpus records reached tau 1.0: no draft token accepted).

The dataset lives in `<data.cache_dir or run.runs_root/.responses>/<key>/`: `manifest.json` (what
the key is made of) and shards `shard-<n>.jsonl` of `SHARD_RECORDS` records each, every one
recorded with its sha256 in `shards.json` once complete (written by temp file + rename). The key
hashes the data file's bytes, the target's files (config.json, weights, tokenizer), the prompt
rule and the sampling settings: a changed target, template or setting is another dataset. An
interrupted generation resumes at the first shard not recorded; a recorded shard whose bytes no
longer match is refused with one line (delete it to make it again), never used.

Prompts (dflash.data.tokenizer.record_prompt, the eval's rule too): a `messages` record's turns before
its last assistant turn with the assistant's turn opened, or a `text` record's first
`data.response_prompt_tokens` tokens. Each becomes an `input_ids` record: the prompt's ids and the
response's (with the eos token where the target said it), loss on the response only, and both as
text for reading.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from dflash.config import JobConfig, add_config_args, load_config
from dflash.data.dataset import source_records
from dflash.data.tokenizer import RecordError, record_prompt
from dflash.errors import DFlashError
from dflash.exiting import without_final_gc
from dflash.rundir import atomic_write_bytes, atomic_write_json, unusable_reason

FORMAT = 2  # 2: token id records, the eos kept
SHARD_RECORDS = 64
SHARDS = "shards.json"
MANIFEST = "manifest.json"
COMBINED = "responses.jsonl"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def target_identity(target_path: str) -> str:
    """The target's files (config, weights, tokenizer and chat template) by content."""
    root = Path(target_path)
    names = sorted(
        p.name
        for p in root.iterdir()
        if p.is_file() and (p.suffix in (".json", ".safetensors", ".jinja", ".txt"))
    )
    h = hashlib.sha256()
    for name in names:
        h.update(f"{name}\0{_sha256(root / name)}\n".encode())
    return h.hexdigest()


def settings(cfg: JobConfig) -> dict[str, Any]:
    d = cfg.data
    return {
        "max_new_tokens": d.response_max_new,
        "temperature": d.response_temperature,
        "seed": cfg.run.seed,
        "prompt_tokens": d.response_prompt_tokens,
    }


def dataset_dir(cfg: JobConfig, data_path: str, target_path: str) -> tuple[Path, dict[str, Any]]:
    manifest = {
        "format": FORMAT,
        "data_sha256": _sha256(Path(data_path)),
        "target": target_identity(target_path),
        "tokenizer": cfg.data.tokenizer,
        "settings": settings(cfg),
    }
    key = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:32]
    root = (Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.run.runs_root)) / ".responses"
    return root / key, manifest


def check_shards(directory: Path) -> dict[str, str]:
    """{shard name: sha256} of the complete shards; a recorded shard whose bytes differ is refused."""
    try:
        done = json.loads((directory / SHARDS).read_text())
    except FileNotFoundError:
        return {}
    except ValueError:
        raise DFlashError(
            f"{directory / SHARDS} is damaged (not JSON); delete {directory} to generate the responses again"
        ) from None
    for name, digest in done.items():
        path = directory / name
        if not path.is_file() or _sha256(path) != digest:
            raise DFlashError(
                f"response shard {path} is damaged or missing (its sha256 does not match {SHARDS}); delete it "
                f"and its entry in {SHARDS}, or the directory, to generate it again"
            )
    return dict(done)


class _Generator:
    def __init__(self, target_path: str, tok: Any, cfg: JobConfig, device: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.tok, self.cfg = torch, tok, cfg
        self.model = AutoModelForCausalLM.from_pretrained(
            target_path, dtype=torch.float32, local_files_only=True
        )
        self.model = self.model.to(device).eval()
        self.device = device
        self.pad = tok.pad_token_id

    def respond(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """One batch, left-padded, through transformers' generate: the new token ids of each."""
        torch, d = self.torch, self.cfg.data
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        torch.manual_seed(seed)
        sample = d.response_temperature > 0
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=d.response_max_new,
                do_sample=sample,
                temperature=d.response_temperature if sample else None,
                top_p=None,
                top_k=None,
                pad_token_id=self.pad,
                eos_token_id=self.tok.eos_token_id,
            )
        new = out[:, width:].tolist()
        eos = self.tok.eos_token_id
        # Up to and with the eos the target said (it is part of what a drafter must predict); a row
        # that stopped early is padded after it.
        return [row[: row.index(eos) + 1] if eos in row else row for row in new]


def _record(prompt: list[int], response: list[int], tok: Any) -> dict[str, Any]:
    """The exact ids (a decode and re-encode would not give back every byte-level token), the loss
    on the response only, and both as text for people reading the shard."""
    return {
        "input_ids": [*prompt, *response],
        "loss_mask": [0] * len(prompt) + [1] * len(response),
        "prompt": tok.decode(prompt),
        "response": tok.decode(response),
    }


def ensure(cfg: JobConfig, data_path: str, target_path: str, tok: Any, *, batch: int = 16,
           device: str = "cpu", log: Any = print) -> Path:  # fmt: skip
    """The combined JSONL of the target's responses to data_path's prompts, generating the shards
    not made yet (resumable); returns its path."""
    directory, manifest = dataset_dir(cfg, data_path, target_path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not (directory / MANIFEST).is_file():
            atomic_write_json(directory / MANIFEST, manifest)
    except OSError as e:
        raise _write_error(directory, e) from None
    combined = directory / COMBINED
    done = check_shards(directory)
    prompts = []
    for n, rec in enumerate(source_records(Path(data_path), cfg.data, log), 1):
        try:
            p = record_prompt(rec, tok, cfg.data.response_prompt_tokens)
        except RecordError as e:  # turns the reader parses but the template refuses
            log(f"data: skipped {data_path}: record {n}: no prompt: {e}")
            continue
        if p:
            prompts.append(p)
    if not prompts:
        raise DFlashError(
            f"data.path {data_path}: no record gives a prompt (text, or messages with an assistant turn)"
        )
    n_shards = (len(prompts) + SHARD_RECORDS - 1) // SHARD_RECORDS
    names = [f"shard-{i:05d}.jsonl" for i in range(n_shards)]
    todo = [i for i, name in enumerate(names) if name not in done]
    if todo:
        gen = _Generator(target_path, tok, cfg, device)
        t0, made = time.time(), 0
        for i in todo:
            chunk = prompts[i * SHARD_RECORDS : (i + 1) * SHARD_RECORDS]
            lines = []
            for j in range(0, len(chunk), batch):
                part = chunk[j : j + batch]
                responses = gen.respond(part, seed=cfg.run.seed * 100_003 + i * SHARD_RECORDS + j)
                lines += [json.dumps(_record(p, r, tok)) + "\n" for p, r in zip(part, responses, strict=True)]
                made += len(part)
                rate = made / max(time.time() - t0, 1e-9)
                left = sum(len(prompts[x * SHARD_RECORDS : (x + 1) * SHARD_RECORDS]) for x in todo) - made
                log(
                    f"[responses] {len(prompts) - left}/{len(prompts)} prompts, {rate:.1f}/s, ETA {left / rate:.0f} s"
                )
            data = "".join(lines).encode()
            try:
                atomic_write_bytes(directory / names[i], data)
                done[names[i]] = hashlib.sha256(data).hexdigest()
                atomic_write_json(directory / SHARDS, done)
            except OSError as e:
                raise _write_error(directory, e) from None
    if not combined.is_file() or combined.stat().st_mtime < (directory / SHARDS).stat().st_mtime:
        try:
            atomic_write_bytes(combined, b"".join((directory / n).read_bytes() for n in names))
        except OSError as e:
            raise _write_error(directory, e) from None
    return combined


def _write_error(directory: Path, e: OSError) -> DFlashError:
    return DFlashError(
        f"responses dataset {directory}: cannot write there: {unusable_reason(directory, e)}; set "
        "data.cache_dir (default: <run.runs_root>; the responses go in its .responses) to a directory this "
        "user can write"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash.responses", description=__doc__.splitlines()[0])
    add_config_args(p, run_dir=None)
    p.add_argument("--batch", type=int, default=16, help="prompts per generate call")
    p.add_argument("--device", default=None, help="cuda, cpu (default: cuda when there is one)")
    args = p.parse_args(argv)
    try:
        import torch

        from dflash.data.holdout import job_source
        from dflash.data.inputs import locate_data, open_target

        cfg = load_config(args.config, args.overrides)
        target_path, tok, _ = open_target(cfg)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        prompts = job_source(cfg, locate_data(cfg)).data_path  # the job's: less the tau's held-out prompts
        out = ensure(cfg, prompts, target_path, tok, batch=args.batch, device=device,
                     log=lambda m: print(m, file=sys.stderr, flush=True))  # fmt: skip
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    with without_final_gc():
        raise SystemExit(main())
