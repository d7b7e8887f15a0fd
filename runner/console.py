"""The CLI edge: turns RunnerError into a red message and exit code 1."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer
from rich.console import Console
from rich.markup import escape

from runner.errors import RunnerError

console = Console()
err_console = Console(stderr=True)


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    try:
        yield
    except RunnerError as e:
        # Escaped: messages quote config sections like "[cache] signing_key", which rich would eat.
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(1) from None


def warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False)
