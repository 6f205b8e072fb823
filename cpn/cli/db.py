"""`cpn db`: create and migrate the registry's schema (Alembic)."""

from __future__ import annotations

from typing import Annotated

import typer

from cpn.cli import app

db_app = typer.Typer(
    help="Manage the registry database schema (Alembic migrations).", no_args_is_help=True
)
app.add_typer(db_app, name="db")

UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar="CPN_DATABASE_URL",
        help="sqlite:///path.db (default sqlite:///cpn.db) or postgresql://user@host/db.",
        show_default=False,
    ),
]


@db_app.command()
def upgrade(
    database_url: UrlOpt = None,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Bring the schema up to REVISION (default: the newest). Safe to repeat."""
    from cpn.registry import database_url as resolve  # noqa: PLC0415
    from cpn.registry import migrate  # noqa: PLC0415

    url = resolve(database_url)
    migrate.upgrade(url, revision)
    typer.echo(f"database at revision {migrate.current_revision(url)}")


@db_app.command()
def downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision; 'base' drops everything.")],
    database_url: UrlOpt = None,
) -> None:
    """Take the schema back to REVISION. 'base' removes every table cpn made."""
    from cpn.registry import database_url as resolve  # noqa: PLC0415
    from cpn.registry import migrate  # noqa: PLC0415

    url = resolve(database_url)
    migrate.downgrade(url, revision)
    typer.echo(f"database at revision {migrate.current_revision(url) or 'base (empty)'}")


@db_app.command()
def current(database_url: UrlOpt = None) -> None:
    """Print the schema's revision and whether it is the newest."""
    from cpn.registry import database_url as resolve  # noqa: PLC0415
    from cpn.registry import migrate  # noqa: PLC0415

    url = resolve(database_url)
    rev = migrate.current_revision(url)
    head = migrate.head_revision()
    state = "up to date" if rev == head else f"behind (newest is {head}): run cpn db upgrade"
    typer.echo(f"{rev or 'base (empty)'}: {state}")
