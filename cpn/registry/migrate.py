"""Create and evolve the registry's schema with Alembic (the only way tables are made).

The migration scripts live in the top-level `migrations/` package, installed with cpn, so
`cpn db upgrade` works from any directory.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy.exc import DatabaseError

import migrations
from cpn.errors import CpnError, InputError
from cpn.registry.db import make_engine, normalize_url

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent


class DatabaseUnavailable(CpnError):
    """The database cannot be reached or opened."""


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Alembic's config is an INI parser: a % in a password must be doubled.
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return cfg


def _run(url: str, action: str, revision: str) -> None:
    cfg = alembic_config(url)
    try:
        if action == "upgrade":
            command.upgrade(cfg, revision)
        else:
            command.downgrade(cfg, revision)
    except DatabaseError as exc:  # unreachable, or not a database ("file is not a database")
        raise DatabaseUnavailable(f"database {_safe(url)}: {_first_line(exc)}") from None
    except CommandError as exc:  # Alembic's own: a revision it does not know
        raise InputError(f"revision {revision!r}: {_first_line(exc)}") from None


def upgrade(url: str, revision: str = "head") -> None:
    _run(url, "upgrade", revision)


def downgrade(url: str, revision: str) -> None:
    _run(url, "downgrade", revision)


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert head is not None
    return head


def current_revision(url: str) -> str | None:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except DatabaseError as exc:
        raise DatabaseUnavailable(f"database {_safe(url)}: {_first_line(exc)}") from None
    finally:
        engine.dispose()


def _safe(url: str) -> str:
    from sqlalchemy.engine import make_url  # noqa: PLC0415

    return make_url(normalize_url(url)).render_as_string(hide_password=True)


def _first_line(exc: Exception) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
