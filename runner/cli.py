"""dflashctl entry point. Verbs live in runner/commands/<verb>.py, each with `register(app)`."""

from __future__ import annotations

import importlib
import pkgutil

import typer

import runner.commands
from runner import __version__

app = typer.Typer(
    name="dflashctl",
    help="Build, check and cache the environments of DFlash drafter training jobs on GPU hosts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dflashctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Build, check and cache the environments of DFlash drafter training jobs on GPU hosts."""


for _mod in sorted(m.name for m in pkgutil.iter_modules(runner.commands.__path__)):
    importlib.import_module(f"runner.commands.{_mod}").register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
