"""`dflashctl build`: a variant's environment as a Docker image (content-addressed tag) or a uv venv."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from runner.build import apply_image, apply_venv, plan_image, plan_venv
from runner.console import cli_errors, console
from runner.envs import LOCK_FILES, load_variant, project_root
from runner.errors import BadInput
from runner.exec import remote


def build(
    variant: Annotated[str, typer.Option("--variant", "-v", help="Variant under envs/ (cu128 or cu130).")],
    host: Annotated[
        Optional[str], typer.Option(help="Build on this docker host over ssh (USER@HOST).")
    ] = None,
    base_image: Annotated[
        Optional[str], typer.Option(help="Base image ref instead of the variant's pinned one.")
    ] = None,
    ca_cert: Annotated[
        Optional[Path],
        typer.Option(
            help="Extra CA bundle for a TLS-intercepting proxy (e.g. the file $SSL_CERT_FILE names).",
            envvar="DFLASH_CA_CERT",
        ),
    ] = None,
    wheelhouse: Annotated[
        Optional[Path], typer.Option(help="Install offline from this directory of wheels.")
    ] = None,
    lock_kind: Annotated[
        str, typer.Option(help="full: the training job; runner: the runner-only CI image.")
    ] = "full",
    network: Annotated[Optional[str], typer.Option(help="docker build --network (e.g. host).")] = None,
    venv: Annotated[
        Optional[Path], typer.Option(help="Build a uv venv at this path instead of an image.")
    ] = None,
    venv_python: Annotated[
        Optional[str],
        typer.Option(help="Interpreter (version or path) for --venv; default: the variant's python."),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; build nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Build a variant's pinned environment; an unchanged build is a no-op that says so."""
    with cli_errors():
        if lock_kind not in LOCK_FILES:
            raise BadInput(f"--lock-kind {lock_kind!r}: use one of {', '.join(LOCK_FILES)}")
        if host is not None:
            remote.parse_host(host)  # refused here, also for --dry-run, which prints the host
        root = project_root()
        v = load_variant(variant, root)
        if venv is not None:
            if host or base_image or network:
                raise BadInput(
                    "--venv builds on this machine without Docker: drop --host/--base-image/--network "
                    "(run dflashctl on the target host to build a venv there)"
                )
            vplan = plan_venv(
                v,
                venv.resolve(),
                root=root,
                lock_kind=lock_kind,
                python=venv_python,
                ca_cert=ca_cert,
                wheelhouse=wheelhouse,
            )
            if dry_run:
                _show(vplan.to_dict(), as_json)
                return
            apply_venv(vplan, on_line=_progress(as_json))
            _done({"status": "built", "venv": vplan.path, "lock_sha256": vplan.lock_sha256}, as_json)
            return
        plan = plan_image(
            v,
            root=root,
            lock_kind=lock_kind,
            base_image=base_image,
            ca_cert=ca_cert,
            wheelhouse=wheelhouse,
            host=host,
            network=network,
        )
        if dry_run:
            _show(plan.to_dict(), as_json)
            return
        if as_json:
            result = apply_image(plan, root, on_line=lambda line: None)
        else:
            with console.status(f"building {plan.tag}") as status:

                def on_line(line: str) -> None:
                    # Steps stay on screen as progress; every other line only flashes in the status bar.
                    if line.startswith("Step "):
                        console.print(f"[dim]{escape(line)}[/]", highlight=False)
                    status.update(f"building {plan.tag}: {escape(line[:100])}")

                result = apply_image(plan, root, on_line=on_line)
        _done(
            {
                "status": result.status,
                "tag": result.tag,
                "image_id": result.image_id,
                "fingerprint": plan.fingerprint,
                "labels": result.labels,
            },
            as_json,
        )


def _progress(as_json: bool):  # type: ignore[no-untyped-def]
    def on_line(line: str) -> None:
        if not as_json:
            console.print(escape(line), highlight=False)

    return on_line


def _show(data: dict[str, object], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    for key, value in data.items():
        if isinstance(value, dict):
            console.print(f"[bold]{key}[/]:")
            for k, v in value.items():
                console.print(f"  {k} = {escape(str(v))}", highlight=False, soft_wrap=True)
        elif isinstance(value, list) and key != "command":
            console.print(f"[bold]{key}[/]: {len(value)} entries")
            for item in value:
                console.print(
                    f"  {escape(' '.join(item) if isinstance(item, list) else str(item))}", highlight=False
                )
        else:
            shown = " ".join(value) if isinstance(value, list) else value
            console.print(f"[bold]{key}[/]: {escape(str(shown))}", highlight=False)


def _done(data: dict[str, object], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    elif data["status"] == "exists":
        console.print(
            f"[green]up to date:[/] {data['tag']} already exists with the same inputs; nothing built"
        )
    else:
        console.print(f"[green]built[/] {data.get('tag') or data.get('venv')}")


def register(app: typer.Typer) -> None:
    app.command("build")(build)
