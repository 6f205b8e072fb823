"""The `cpn` command line (typer). Each sub-command lives in its own module.

Errors the user can cause (`CpnError`) are printed as one line on stderr with exit
status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

import typer

from cpn import __version__
from cpn.errors import CpnError

app = typer.Typer(
    name="cpn",
    help="Scheduler for a computing power network: plan and run 3D-parallel training "
    "across datacenters joined by slow WAN links.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Markdown joins a docstring's wrapped lines into paragraphs that fit the terminal
    # (the default keeps every source line break, then wraps again: ragged at 80 columns).
    rich_markup_mode="markdown",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"cpn {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """cpn: plan and run training jobs across sites."""


def _register() -> None:
    # Importing a command module registers its commands on `app`.
    from cpn.cli import agent, db, demo, jobs, keys, plan, serve, worker  # noqa: F401, PLC0415


def main() -> None:
    _register()
    try:
        app()
    except CpnError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
