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


#: The module that registers each top-level command (importing a command module registers
#: its commands on `app`). `cpn jobs …` then imports its own module alone, not the
#: others' (the agents' backends and settings, the key store, the contracts): 0.09 s of
#: CPU to start instead of 0.36 s (measured; a training worker, which imports torch
#: anyway, saves the same 0.09 s). tests/unit/test_cli_commands.py checks the table.
COMMAND_MODULES = {
    "agent": "agent",
    "db": "db",
    "demo": "demo",
    "jobs": "jobs",
    "submit": "jobs",
    "quote": "jobs",
    "keys": "keys",
    "plan": "plan",
    "serve": "serve",
    "worker": "worker",
    "launch": "worker",
    "train": "worker",
}


def register(argv: list[str]) -> None:
    """Register the command `argv` names (its first word), or every command when it names
    none (`cpn`, `cpn --help`, a misspelt command: the help and typer's error list all)."""
    import importlib  # noqa: PLC0415

    named = COMMAND_MODULES.get(argv[0]) if argv else None
    for module in [named] if named else sorted(set(COMMAND_MODULES.values())):
        importlib.import_module(f"cpn.cli.{module}")


def main() -> None:
    register(sys.argv[1:])
    try:
        app()
    except CpnError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
