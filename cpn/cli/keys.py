"""`cpn keys`: API keys for the REST API, made and revoked on the registry's database
(run beside `cpn serve`, with the same --database-url)."""

from __future__ import annotations

from typing import Annotated

import typer

from cpn.cli import app
from cpn.contracts.limits import INT32_MAX

keys_app = typer.Typer(help="Create, list and revoke API keys.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")

DbOpt = Annotated[
    str | None,
    typer.Option("--database-url", envvar="CPN_DATABASE_URL",
                 help="The registry (default sqlite:///cpn.db).", show_default=False),
]  # fmt: skip


def _registry(url: str | None):  # type: ignore[no-untyped-def]
    from cpn.registry import Registry, database_url, upgrade  # noqa: PLC0415

    resolved = database_url(url)
    upgrade(resolved)
    return Registry(resolved)


@keys_app.command("create")
def create(
    tenant: Annotated[str, typer.Option(help="The tenant the key acts for (made if new).")],
    admin: Annotated[bool, typer.Option("--admin", help="Sees every tenant's jobs.")] = False,
    gpu_quota: Annotated[
        int | None,
        typer.Option(
            "--gpu-quota",
            min=0,
            max=INT32_MAX,  # the column is a 32-bit INTEGER on PostgreSQL
            help="Set the tenant's GPU quota.",
            show_default=False,
        ),
    ] = None,
    database_url: DbOpt = None,
) -> None:
    """Make a key and print it (once: only its digest is stored)."""
    from cpn.orchestration.tenants import create_key  # noqa: PLC0415
    from cpn.registry.models import Role  # noqa: PLC0415

    registry = _registry(database_url)
    try:
        with registry.write() as session:
            new = create_key(
                session, tenant, role=Role.ADMIN if admin else Role.USER, gpu_quota=gpu_quota
            )
    finally:
        registry.dispose()
    typer.echo(new.key)
    typer.echo(f"key {new.prefix}… for tenant {new.tenant} ({new.role.value})", err=True)


@keys_app.command("revoke")
def revoke(
    key: Annotated[str, typer.Argument(help="The key, or its prefix as `cpn keys list` shows.")],
    database_url: DbOpt = None,
) -> None:
    """Revoke a key: requests with it get 401 from now on (a running `cpn serve` may still
    accept it for its CPN_API_KEY_CACHE_S, 1 s by default)."""
    from cpn.orchestration.tenants import revoke_key  # noqa: PLC0415

    registry = _registry(database_url)
    try:
        with registry.write() as session:
            row = revoke_key(session, key)
            prefix = row.prefix
    finally:
        registry.dispose()
    typer.echo(f"key {prefix}… revoked")


@keys_app.command("list")
def list_keys(database_url: DbOpt = None) -> None:
    """Every key: prefix, tenant, role, created, revoked."""
    from cpn.orchestration.tenants import list_keys as rows  # noqa: PLC0415

    registry = _registry(database_url)
    try:
        with registry.read() as session:
            for key, tenant in rows(session):
                revoked = f"revoked {key.revoked_at:%Y-%m-%d %H:%M}" if key.revoked_at else ""
                typer.echo(f"{key.prefix}…  {tenant.name:<20} {key.role.value:<6} "
                           f"{key.created_at:%Y-%m-%d %H:%M}  {revoked}")  # fmt: skip
    finally:
        registry.dispose()
