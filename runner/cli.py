"""dflashctl entry point. Verbs live in runner/commands/<verb>.py, each with `register(app)`."""

from __future__ import annotations

import importlib
import pkgutil

import typer

import runner.commands
from runner import __version__

HELP = (
    "Run DFlash drafter training jobs on GPU hosts, from environment to result: build and lock the "
    "environments (build, lock, doctor), warm and manage their compile caches (warm-cache, cache); "
    "launch a job in tmux, a container or this terminal, here or over ssh (run), then find, follow "
    "and stop it (ps, logs, attach, stop); watch it live and act on hangs (watch, baselines); report "
    "on a finished run (report) and measure its drafter under speculative decoding (eval); or try it "
    "all on CPU (demo)."
)

app = typer.Typer(
    name="dflashctl",
    help=HELP,
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
    """Run DFlash drafter training jobs on GPU hosts: build, run, watch, report."""


for _mod in sorted(m.name for m in pkgutil.iter_modules(runner.commands.__path__)):
    importlib.import_module(f"runner.commands.{_mod}").register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
