"""`dflashctl doctor`: fingerprint an environment and check it against its variant lock.

Exit codes: 0 healthy, 3 a check failed (drift, torch swap, driver too old), 1 doctor could not run,
2 bad input (a malformed --host, --python with --image, an unknown --lock-kind).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from runner.console import cli_errors, console, warn
from runner.doctor import Report, collect, diagnose
from runner.envs import LOCK_FILES, load_variant, project_root
from runner.errors import BadInput
from runner.exec import docker, remote
from runner.lock import read_lock

FAILED = 3
_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red"}


def doctor(
    variant: Annotated[
        Optional[str], typer.Option("--variant", "-v", help="Check against this variant's pins and lock.")
    ] = None,
    python: Annotated[
        Optional[str], typer.Option(help="Interpreter of the environment to check (default: this one).")
    ] = None,
    image: Annotated[
        Optional[str], typer.Option(help="Check this Docker image (probed in a throwaway container).")
    ] = None,
    host: Annotated[
        Optional[str], typer.Option(help="Run the probe on this host over ssh (USER@HOST).")
    ] = None,
    lock: Annotated[
        Optional[Path], typer.Option(help="Compare against this lock file instead of the variant's.")
    ] = None,
    lock_kind: Annotated[
        Optional[str],
        typer.Option(
            help="Which variant lock: full or runner (default: the image's io.dflash.lock label, else full)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Fingerprint an environment; with --variant or --lock, report drift (exit 3 when it breaks reproducibility)."""
    with cli_errors():
        if python and image:
            raise BadInput("give --python or --image, not both")
        if lock_kind is not None and lock_kind not in LOCK_FILES:
            raise BadInput(f"--lock-kind {lock_kind!r}: use one of {', '.join(LOCK_FILES)}")
        if host is not None:
            remote.parse_host(host)  # refused here, before any probe
        v = load_variant(variant, project_root()) if variant else None
        lock_obj = None
        if lock is not None:
            lock_obj = read_lock(lock)
        elif v is not None:
            kind = lock_kind
            if kind is None and image:
                label = docker.image_labels(host, image).get("io.dflash.lock")
                kind = next((k for k, f in LOCK_FILES.items() if f == label), None)
            lock_obj = read_lock(v.lock_path(kind or "full"))
        fp = collect(python=python, image=image, host=host, warn=warn)
        target = f"image {image}" if image else f"{python or fp['python']['executable']}"
        target += f" on {host}" if host else ""
        report = diagnose(fp, target=target, variant=v, lock=lock_obj)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    else:
        _render(report)
    if not report.ok:
        raise typer.Exit(FAILED)


def _fingerprint_rows(fp: dict[str, Any]) -> list[tuple[str, str]]:
    torch = fp.get("torch") or {}
    driver = fp.get("driver") or {}
    gpus = fp.get("gpus") or []
    return [
        ("python", f"{fp['python']['version']} ({fp['python']['executable']})"),
        (
            "torch",
            f"{torch.get('version')} git {str(torch.get('git_version'))[:12]}" if torch else "not installed",
        ),
        ("CUDA runtime", str(torch.get("cuda"))),
        ("cuDNN", str(torch.get("cudnn"))),
        ("NCCL", str(torch.get("nccl"))),
        ("triton", str((fp.get("triton") or {}).get("version"))),
        (
            "driver",
            f"{driver.get('version')} (CUDA {driver.get('cuda')})" if driver.get("version") else "none",
        ),
        (
            "GPUs",
            "; ".join(f"{g['index']}: {g['name']} sm {g['compute_capability']}" for g in gpus) or "none",
        ),
        (
            "platform",
            f"{fp['platform']['system']} {fp['platform']['machine']} {fp['platform'].get('libc') or ''}",
        ),
        ("packages", str(len(fp.get("packages") or {}))),
    ]


def _render(report: Report) -> None:
    table = Table(title=f"fingerprint: {escape(report.target)}", show_header=False)
    for key, value in _fingerprint_rows(report.fingerprint):
        table.add_row(key, escape(value))
    console.print(table)
    checks = Table(title=f"checks{' against ' + escape(report.lock) if report.lock else ' (no lock given)'}")
    checks.add_column("check")
    checks.add_column("status")
    checks.add_column("detail")
    for c in report.checks:
        checks.add_row(escape(c.name), f"[{_STYLE[c.status]}]{c.status}[/]", escape(c.detail))
    console.print(checks)
    if report.ok:
        console.print("[green]healthy[/]")
    else:
        console.print("[bold red]not reproducible:[/] fix the failed checks (rebuild with `dflashctl build`)")


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
