"""`dflashctl eval RUN`: the run's drafter under real speculative decoding with its target (tau,
acceptance per position, tok/s), measured by the job's own `python -m dflash.eval` in the job's
environment on the run's host (its interpreter, or its image with the run's mounts)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Annotated, Any

import typer

from runner.console import cli_errors
from runner.errors import RunnerError
from runner.exec import remote
from runner.exec.jobenv import JobEnv
from runner.launch.registry import Registry


def eval_argv(rec: Any, node: int, args: list[str]) -> tuple[str | None, list[str]]:
    """(host, argv) that runs `python -m dflash.eval <node's run dir> ARGS` where the run ran."""
    plans = [h for h in (rec.plan.get("hosts") or []) if h.get("node_rank") == node]
    hosts = [h for h in rec.hosts if h.node_rank == node]
    if not hosts or not plans:
        raise RunnerError(f"{rec.run_id} has no node {node} (nodes 0..{len(rec.hosts) - 1})")
    hp = plans[0]
    image = rec.plan.get("image") if rec.backend == "docker" else None
    env = JobEnv(
        python=hp["argv"][0],
        host=hosts[0].host,
        image=image,
        gpus=bool(hp.get("gpus")) and image is not None,
        mounts=[(m["source"], m["target"], bool(m.get("read_only"))) for m in hp.get("mounts") or []],
    )
    return hosts[0].host, env.argv(["dflash.eval", hp["run_dir"], *args])


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_cmd(
        run: Annotated[str, typer.Argument(help="Run id, id prefix or name.")],
        prompts: Annotated[
            str | None,
            typer.Option(help="JSONL prompts file on the run's host (default: its held-out prompts)."),
        ] = None,
        max_new: Annotated[
            int | None, typer.Option(help="New tokens per prompt (default: the run's train.tau_max_new).")
        ] = None,
        limit: Annotated[
            int | None, typer.Option(help="Prompts at most (default: the run's train.tau_prompt_count).")
        ] = None,
        temperature: Annotated[float, typer.Option(help="0 = greedy verification; > 0 samples.")] = 0.0,
        node: Annotated[int, typer.Option(help="Node rank whose run directory holds the checkpoints.")] = 0,
        as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    ) -> None:
        """Measure the run's newest checkpoint under speculative decoding: tau (accepted tokens per
        target verification, the target's own counted), its histogram, acceptance per block
        position, tokens per second against the target alone."""
        with cli_errors():
            rec = Registry().find(run)
            if prompts is not None and Path(prompts).is_file() and rec.hosts and rec.hosts[0].host is None:
                prompts = str(Path(prompts).resolve())
            args = ["--temperature", str(temperature)]
            args += [*(["--max-new", str(max_new)] if max_new is not None else [])]
            args += [*(["--limit", str(limit)] if limit is not None else [])]
            args += [*(["--prompts", prompts] if prompts else []), *(["--json"] if as_json else [])]
            host, argv = eval_argv(rec, node, args)
            full = remote.remote_argv(host, argv)
        try:
            code = subprocess.run(full).returncode
        except FileNotFoundError as e:
            with cli_errors():
                raise RunnerError(
                    f"cannot run {full[0]!r}: {e.strerror}; is it installed and on PATH?"
                ) from e
        raise typer.Exit(code)
