"""`dflashctl lock`: regenerate (or --check) a variant's hash-pinned, URL-free locks."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from runner.console import cli_errors, console
from runner.envs import LOCK_FILES, list_variants, load_variant, project_root
from runner.errors import BadInput
from runner.lock import check_lock, compile_lock


def lock(
    variant: Annotated[
        Optional[list[str]], typer.Option("--variant", "-v", help="Variant(s); default: all.")
    ] = None,
    kind: Annotated[Optional[list[str]], typer.Option(help="full and/or runner; default: both.")] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Verify the committed locks (no network): "
            "URL-free, hash-pinned, generated from today's inputs.",
        ),
    ] = False,
) -> None:
    """Resolve locks with `uv pip compile --universal --generate-hashes` (set SSL_CERT_FILE behind a proxy)."""
    with cli_errors():
        root = project_root()
        kinds = kind or list(LOCK_FILES)
        for k in kinds:
            if k not in LOCK_FILES:
                raise BadInput(f"--kind {k!r}: use one of {', '.join(LOCK_FILES)}")
        for name in variant or list_variants(root):
            v = load_variant(name, root)
            for k in kinds:
                if check:
                    found = check_lock(v, k, root=root)
                    console.print(f"[green]ok[/] {found.path.relative_to(root)} ({len(found.entries)} pins)")
                else:
                    with console.status(f"resolving {name}/{k}"):
                        path = compile_lock(v, k, root=root)
                    console.print(f"[green]wrote[/] {path.relative_to(root)}")


def register(app: typer.Typer) -> None:
    app.command("lock")(lock)
