"""The CLI edge: turns RunnerError into one red message and its exit code (runner.errors)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer
from rich.console import Console
from rich.markup import escape

from runner.errors import RunnerError

console = Console()
err_console = Console(stderr=True, soft_wrap=True)
"""Errors, warnings and notes, soft-wrapped: one line per message at any terminal width, so a path or
command in them stays whole for copying and for grep."""


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    try:
        yield
    except RunnerError as e:
        # Escaped: messages quote config sections like "[cache] signing_key", which rich would eat.
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(e.exit_code) from None
    except OSError as e:
        # The last net under every verb: a path the library did not expect to fail (a file where a
        # directory should be, no permission, a full disk) is one message naming it, not a traceback.
        where = f"{e.filename}: " if e.filename else ""
        err_console.print(
            f"[bold red]error:[/] {escape(where + (e.strerror or str(e)))}; check that path "
            "(its kind, owner and permissions) and the free space there",
            highlight=False,
        )
        raise typer.Exit(1) from None


def warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False)
