"""The CLI edge: turns RunnerError into a red message and exit code 1."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer
from rich.console import Console

from runner.errors import RunnerError

console = Console()
err_console = Console(stderr=True)


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    try:
        yield
    except RunnerError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(1) from None
