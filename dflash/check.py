"""Check a job config before anything starts: every error at once, each naming its config key.

    python -m dflash.check CONFIG.toml [--set key=value ...] [--nnodes N] [--node-rank I]
        [--rdzv-endpoint HOST:PORT] [--run-dir DIR] [--json]

Run in the job's own environment (the host, container or venv that will run it), since devices,
paths and /dev/shm are this machine's. Loads no weights and no data: config.json and file names
only. Exit code 0 when the config is fine, 2 when anything is wrong (a failure of the check itself
too). With --json the last stdout line is one object, for dflashctl to parse:
    {"ok": bool, "errors": [{"key": str, "message": str}], "warnings": [{"key", "message"}],
     "config": the resolved config, or null when the config has errors,
     "shm_bytes": bytes of /dev/shm the host's hidden-state queue and its two drafter state copies
                  (pipeline.state_copy_every) map, or null when unknown,
     "plan": the job plan on this machine (dflash.plan.builder: device, attention, loss and precision
             choices, target compile, drafter sizes, shape plan, recompile limit, placement), or null,
     "entry": "dflash.launch"}
`key` is the dotted config key ("train.lr"); "" for what is no key (the file, the arguments,
--run-dir). Config errors are the job's own validation (dflash.config: each field's Range and the
rules between fields), all of them instead of the first; warnings are legal but likely unintended.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from dflash.config import (
    JobConfig,
    add_config_args,
    apply_overrides,
    collect_config,
    config_warnings,
    read_config_file,
)
from dflash.errors import ConfigError, DFlashError
from dflash.exiting import without_final_gc
from dflash.rundir import unusable_reason

if TYPE_CHECKING:
    import torch

ENTRY = "dflash.launch"
"""The entry point the checked config is for: shm_bytes is that launcher's hidden-state queue."""


@dataclass
class Report:
    errors: list[dict[str, str]] = field(default_factory=list)
    warnings: list[dict[str, str]] = field(default_factory=list)
    config: dict[str, Any] | None = None
    """The resolved config; None when the config itself has errors (it would show defaults there)."""
    shm_bytes: int | None = None
    plan: dict[str, Any] | None = None
    """The job plan (dflash.plan.builder.JobPlan.to_dict) on this machine; None when the config has errors."""
    spare: dict[str, Any] | None = None
    """The spare drafters (pipeline.spare_drafters) as the launcher resolves them here: mode, why,
    host_bytes and gpu_bytes each, per_host of them."""

    def error(self, key: str, message: str) -> None:
        self.errors.append({"key": key, "message": message})

    def warn(self, key: str, message: str) -> None:
        self.warnings.append({"key": key, "message": message})

    def config_error(self, e: ConfigError) -> None:
        self.error(e.key, e.problem)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": not self.errors,
            "errors": self.errors,
            "warnings": self.warnings,
            "config": self.config,
            "shm_bytes": self.shm_bytes,
            "spare": self.spare,
            "plan": self.plan,
            "entry": ENTRY,
        }


def check(
    config: str,
    overrides: list[str],
    *,
    nnodes: int | None = None,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    run_dir: str | None = None,
) -> Report:
    from dflash.plan.hosts import host_problems

    report = Report()
    if run_dir is not None:
        reason = unusable_reason(run_dir)
        if reason is not None:
            report.error("", f"--run-dir {run_dir} cannot be used: {reason}; pass another --run-dir")
    try:
        data = read_config_file(config)
    except ConfigError as e:
        report.error("", f"{e.key}: {e.problem}")  # about the file, not a key in it
        return report
    for item in overrides:  # one at a time, so one bad --set does not hide the others
        try:
            apply_overrides(data, [item])
        except ConfigError as e:
            report.config_error(e)
    cfg, errors = collect_config(data)
    for e in errors:
        report.config_error(e)
    if cfg is None:
        return report
    if not report.errors:
        report.config = cfg.to_dict()
    for w in config_warnings(cfg):
        report.warn(w.key, w.problem)
    for key, message in host_problems(cfg, nnodes, node_rank, rdzv_endpoint)[2]:
        report.error(key, message)
    _check_devices(cfg, report)
    _check_writable("run.runs_root", cfg.run.runs_root, report)
    if cfg.data.cache_dir:
        _check_writable("data.cache_dir", cfg.data.cache_dir, report)
    _check_data(cfg, report)
    sizes = _target_sizes(cfg, report)
    device = _check_choices(cfg, sizes, report)
    job = _plan(cfg, device, sizes, report) if device is not None and not report.errors else None
    if sizes is not None:
        spec = None if job is None else job.spec
        queue = _shm_bytes(cfg, sizes.layers, sizes.hidden, report)
        copies = _state_copy_bytes(cfg, spec, report)
        report.shm_bytes = None if queue is None else queue + copies
        report.spare = _spare(cfg, spec, report)
    if job is not None and not report.errors:
        report.plan = job.to_dict()
        if report.plan["spec"] is not None and cfg.drafter.mask_token_id < 0:
            report.plan["spec"]["mask_token_id"] = None  # the tokenizer's, read when the job starts
    return report


def _check_choices(cfg: JobConfig, sizes: TargetSizes | None, report: Report) -> torch.device | None:
    """The job's device (None where run.device is refused) and every choice the plan makes on it
    that this machine cannot run, reported by key (dflash.plan.builder.plan_problems). The fused q/k kernel
    is judged with the drafter's head dim where the target's config.json gives it."""
    from dflash.plan.builder import plan_problems
    from dflash.plan.spec import drafter_head_dim

    head_dim = (
        None if sizes is None else drafter_head_dim(cfg.drafter, sizes.hidden, sizes.heads, sizes.head_dim)
    )
    device, problems = plan_problems(cfg, head_dim=head_dim)
    for e in problems:
        report.config_error(e)
    return device


def _plan(cfg: JobConfig, device: torch.device, sizes: TargetSizes | None, report: Report) -> Any:
    """The job plan (dflash.plan.builder) as the job will build it here, the drafter's sizes from the
    target's config.json (None, with a warning, where they cannot be resolved). The mask token does
    not change the trainable sizes; the check reads no tokenizer, so it plans with the config's or 0."""
    from dflash.plan.builder import build_plan

    path = None if cfg.target.path == "tiny" else cfg.target.path
    try:
        target = None if sizes is None else _target_config(sizes)
        mask = max(cfg.drafter.mask_token_id, 0)
        return build_plan(cfg, device=device, target_config=target, mask_token_id=mask, target_path=path)
    except (ConfigError, DFlashError, ValueError, TypeError) as e:
        # What stops the drafter's sizes is reported by the checks it belongs to; alone, a warning.
        report.warn("", f"the job plan cannot be built here: the drafter cannot be sized ({e})")
        return None


def _target_config(sizes: TargetSizes) -> Any:
    """The target's config as an object the drafter's sizes resolve from, from config.json alone."""
    if sizes.config is None:  # the tiny demo target
        from dflash.data.demo import tiny_config

        return tiny_config(sizes.layers, sizes.hidden)
    from transformers import Qwen3Config

    text = {k: v for k, v in sizes.config.items() if k != "model_type"}
    if "num_attention_heads" in text:  # as transformers reads a config.json without it
        text.setdefault("num_key_value_heads", text["num_attention_heads"])
    return Qwen3Config(**text)


def _check_devices(cfg: JobConfig, report: Report) -> None:
    """The device lists and the placement on them, reported."""
    import torch

    from dflash.plan.placement import cuda_index, missing_devices, placement_problems
    from dflash.plan.resolve import worker_devices

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    p = cfg.pipeline
    before = len(report.errors)
    for key, listed, count, role in (
        ("pipeline.target_devices", p.target_devices, p.targets, "targets"),
        ("pipeline.drafter_devices", p.drafter_devices, p.drafters, "drafters"),
    ):
        if listed and len(listed) != count:
            report.error(
                key,
                f"lists {len(listed)} devices for {count} {role}; list one device per worker, "
                f"or change pipeline.{role}",
            )
        valid = []
        for name in listed:
            try:
                cuda_index(name)
                valid.append(name)
            except ValueError as e:
                report.error(key, str(e))
        problem = missing_devices(key, valid, gpus)
        if problem is not None:
            report.config_error(problem)
    if len(report.errors) > before:
        return  # worker_devices below would refuse the same lists

    targets, drafters = worker_devices(cfg)
    for problem in placement_problems(cfg, targets, drafters, device_count=None):
        report.config_error(problem)


def _check_data(cfg: JobConfig, report: Report) -> None:
    path = Path(cfg.data.path)
    if cfg.data.path != "demo" and not (path.is_file() and os.access(path, os.R_OK)):
        # The job reads one file (dflash.data.dataset.load_dataset), so a directory is refused here too.
        what = "is a directory" if path.is_dir() else "is not a readable file"
        report.error("data.path", f"{path} {what}; pass a JSONL file of text/messages records, or `demo`")


def _check_writable(key: str, path: str, report: Report) -> None:
    """The directory exists and is writable, or its nearest existing parent lets it be created."""
    reason = unusable_reason(path)
    if reason is not None:
        report.error(key, f"{path}: {reason}; choose another path or fix its permissions")


class TargetSizes(NamedTuple):
    """The target's sizes as dflash.check reads them from config.json alone (no weights): heads and
    head dim None where the file does not give them (the tiny demo target has no file)."""

    layers: int
    hidden: int
    heads: int | None = None
    head_dim: int | None = None
    config: dict[str, Any] | None = None
    """The language model's part of config.json (None for the tiny demo target)."""


def _target_sizes(cfg: JobConfig, report: Report) -> TargetSizes | None:
    if cfg.target.path == "tiny":
        from dflash.data.demo import check_tiny

        try:
            check_tiny(cfg.target.tiny_layers, cfg.target.tiny_hidden)
        except DFlashError as e:
            report.error("target.tiny_layers" if cfg.target.tiny_layers < 1 else "target.tiny_hidden", str(e))
            return None
        return TargetSizes(cfg.target.tiny_layers, cfg.target.tiny_hidden)
    from dflash.target import check_model_dir

    try:
        model_dir = check_model_dir(cfg.target.path)
        text = json.loads((model_dir / "config.json").read_text())
    except (DFlashError, OSError, ValueError) as e:
        report.error("target.path", str(e))
        return None
    sizes = text if isinstance(text, dict) else {}
    if "num_hidden_layers" not in sizes:  # multimodal checkpoints keep the language model's here
        sizes = sizes.get("text_config") or {}
    try:
        layers, hidden = int(sizes["num_hidden_layers"]), int(sizes["hidden_size"])
    except (KeyError, TypeError, ValueError):
        report.error("target.path", f"{model_dir}/config.json has no num_hidden_layers and hidden_size")
        return None

    def optional(key: str) -> int | None:
        try:
            return int(sizes[key]) or None
        except (KeyError, TypeError, ValueError):
            return None

    return TargetSizes(layers, hidden, optional("num_attention_heads"), optional("head_dim"), sizes)


def _shm_bytes(cfg: JobConfig, layers: int, hidden: int, report: Report) -> int | None:
    """Bytes of /dev/shm the launcher's hidden-state queue maps, exactly as it will size it."""
    from dflash.pipeline.transport import segment_bytes, segment_path
    from dflash.plan.placement import slot_bytes, slot_problem
    from dflash.plan.resolve import torch_dtype
    from dflash.plan.spec import target_layer_ids

    try:
        features = len(target_layer_ids(cfg.drafter, layers)) * hidden
    except ConfigError as e:
        report.config_error(e)
        return None
    elem = torch_dtype(cfg.target.dtype).itemsize
    problem = slot_problem(cfg, features, elem)
    if problem is not None:
        report.error("pipeline.slot_mb", problem)
    need = segment_bytes(cfg.pipeline.queue_depth, slot_bytes(cfg, features, elem))
    shm = segment_path("dflash-check").parent
    fs = os.statvfs(shm)
    free = fs.f_bavail * fs.f_frsize
    if need > free:
        # A warning: the runner may size the job's container from shm_bytes after this check.
        report.warn(
            "pipeline.queue_depth",
            f"the hidden-state queue needs {need / 2**20:.0f} MiB of {shm} but {free / 2**20:.0f} MiB "
            "are free here: give the container more (docker --shm-size), or lower pipeline.queue_depth "
            "or pipeline.slot_mb",
        )
    return need


def _state_copy_bytes(cfg: JobConfig, spec: Any, report: Report) -> int:
    """Bytes of /dev/shm the host's two drafter state copies take (pipeline.state_copy_every), as
    the launcher sizes them: the drafter built on the meta device from the plan's spec."""
    if not cfg.pipeline.state_copy_every:
        return 0
    from dflash.pipeline.state_copy import copies_nbytes

    if spec is None:
        if not report.errors:
            report.warn(
                "pipeline.state_copy_every",
                "the drafter state copies cannot be sized from the target's config.json "
                "(shm_bytes counts the queue only)",
            )
        return 0
    return copies_nbytes(spec)


def _spare(cfg: JobConfig, spec: Any, report: Report) -> dict[str, Any] | None:
    """The spare drafters' mode and cost on this host, decided as the launcher decides them before
    any worker (dflash.plan.spares.plan_spares); a mode asked for that does not fit is an error naming
    the key."""
    from dflash.plan.resolve import torch_dtype, worker_devices
    from dflash.plan.spares import plan_spares

    if spec is None:
        if not report.errors:
            report.warn(
                "pipeline.spare_drafters", "the spare drafters cannot be sized from the target's config.json"
            )
        return None
    try:
        devices = worker_devices(cfg)
        plan = plan_spares(cfg, devices, spec, torch_dtype(cfg.target.dtype).itemsize, cfg.target.path)
    except ConfigError as e:
        report.config_error(e)
        return None
    except DFlashError:
        return None  # device lists: reported by their own check
    return {**plan.to_dict(), "per_host": len(devices[1])}


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # reported like any other error (as JSON with --json)
        raise _UsageError(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog="python -m dflash.check", description=__doc__.split("\n\n")[0])
    add_config_args(p, run_dir=None)
    p.add_argument("--nnodes", type=int, help="hosts in the drafter group (overrides pipeline.nnodes)")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index, 0..nnodes-1")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous")
    p.add_argument(
        "--run-dir", help="the run directory the job will use: checked that it can be made and written"
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object (last line)")
    return p.parse_args(argv)


def _print_human(config: str, report: Report) -> None:
    for kind, items in (("error", report.errors), ("warning", report.warnings)):
        for item in items:
            key, message = item["key"], item["message"]
            where = "" if not key or message.startswith(key) else f"{key}: "
            print(f"{kind}: {where}{message}")
    if report.errors:
        print(f"{config}: {len(report.errors)} error(s)")
    elif report.shm_bytes is None:
        print(f"{config}: ok")
    else:
        print(f"{config}: ok (hidden-state queue: {report.shm_bytes / 2**20:.1f} MiB of /dev/shm)")
    if not report.errors and report.spare is not None:
        sp = report.spare
        cost = (
            f": {sp['per_host']} x ({sp['host_bytes'] / 2**30:.1f} GiB host, {sp['gpu_bytes'] / 2**30:.1f} GiB GPU)"
            if sp["mode"] != "off"
            else ""
        )
        print(f"spare drafters: {sp['mode']}{cost} ({sp['why']})")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    as_json = "--json" in argv
    try:
        args = parse_args(argv)
        report = check(
            args.config,
            args.overrides,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
            run_dir=args.run_dir,
        )
        config = args.config
    except _UsageError as e:
        report, config = Report(errors=[{"key": "", "message": f"usage: {e}"}]), "(arguments)"
    except Exception as e:  # the caller parses the JSON: a traceback alone would say nothing to it
        traceback.print_exc(file=sys.stderr)
        report = Report(errors=[{"key": "", "message": f"the check itself failed: {type(e).__name__}: {e}"}])
        config = "(check)"
    if as_json:
        print(json.dumps(report.to_json()), flush=True)
    else:
        _print_human(config, report)
    return 2 if report.errors else 0


if __name__ == "__main__":
    with without_final_gc():
        raise SystemExit(main())
