"""`cpn serve`: the control plane — gRPC agent service and HTTP API in one process."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic import ValidationError

from cpn.cli import app
from cpn.errors import CpnError, InputError

if TYPE_CHECKING:  # imported when the command runs, so that `cpn --help` stays quick
    from cpn.control import ControlSettings, SiteTokens

log = logging.getLogger("cpn.serve")


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def bind_http(host: str, port: int) -> socket.socket:
    """Bind the HTTP socket ourselves, so a taken port is one clear line, not a traceback."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CpnError(f"--http-port: cannot listen on {host}:{port} ({exc.strerror})") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


@app.command()
def serve(
    site_tokens: Annotated[
        Path,
        typer.Option(
            "--site-tokens",
            envvar="CPN_SITE_TOKENS",
            help="YAML mapping site name → bearer token (or → {token, gpu_price_per_hour, "
            "intra_site_gbps}). Agents of a site authenticate with its token.",
        ),
    ],
    database_url: Annotated[
        str | None,
        typer.Option(
            "--database-url",
            envvar="CPN_DATABASE_URL",
            help="sqlite:///path.db (default sqlite:///cpn.db) or postgresql://user@host/db.",
            show_default=False,
        ),
    ] = None,
    grpc_port: Annotated[
        int,
        typer.Option(
            "--grpc-port", help="Agent service port (0: any free port).", min=0, max=65535
        ),
    ] = 50051,
    http_port: Annotated[
        int, typer.Option("--http-port", help="HTTP API port (0: any free port).", min=0, max=65535)
    ] = 8080,
    host: Annotated[str, typer.Option(help="Address both servers listen on.")] = "0.0.0.0",
    lease_ttl: Annotated[
        float,
        typer.Option(
            "--lease-ttl", help="Seconds without a heartbeat before an agent is lost.", min=0.1
        ),
    ] = 10.0,
    heartbeat_interval: Annotated[
        float,
        typer.Option(
            "--heartbeat-interval", help="Seconds between heartbeats asked of agents.", min=0.05
        ),
    ] = 3.0,
    max_message_bytes: Annotated[
        int,
        typer.Option(
            "--max-message-bytes", help="Largest request accepted from an agent.", min=1024
        ),
    ] = 4 * 1024 * 1024,
    log_level: Annotated[
        str, typer.Option("--log-level", help="debug, info, warning, error.")
    ] = "info",
    tls_cert: Annotated[
        Path | None,
        typer.Option(
            "--tls-cert", help="PEM certificate chain: serve gRPC over TLS.", show_default=False
        ),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option("--tls-key", help="PEM private key for --tls-cert.", show_default=False),
    ] = None,
) -> None:
    """Run the control plane: migrate the database, then serve agents over gRPC and the
    REST API over HTTP until interrupted.

    Prints one line when ready: the gRPC and HTTP ports and the database.
    """
    from cpn.control import ControlSettings, SiteTokens  # noqa: PLC0415
    from cpn.registry import database_url as resolve_url  # noqa: PLC0415
    from cpn.registry import upgrade  # noqa: PLC0415
    from cpn.registry.db import normalize_url  # noqa: PLC0415

    setup_logging(log_level)
    tokens = SiteTokens.load(site_tokens)
    url = normalize_url(resolve_url(database_url))
    try:
        settings = ControlSettings(
            database_url=url,
            host=host,
            grpc_port=grpc_port,
            http_port=http_port,
            site_tokens=site_tokens,
            lease_ttl_s=lease_ttl,
            heartbeat_interval_s=heartbeat_interval,
            max_message_bytes=max_message_bytes,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        raise InputError(str(err["msg"]).removeprefix("Value error, ")) from None
    upgrade(url)
    http_sock = bind_http(host, http_port)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(settings, tokens, http_sock))


async def _serve(settings: ControlSettings, tokens: SiteTokens, http_sock: socket.socket) -> None:
    import uvicorn  # noqa: PLC0415
    from sqlalchemy.engine import make_url  # noqa: PLC0415

    from api import create_app  # noqa: PLC0415
    from cpn.cli.http_server import HttpServer  # noqa: PLC0415
    from cpn.control import ControlServer  # noqa: PLC0415
    from cpn.registry import Registry  # noqa: PLC0415

    registry = Registry(settings.database_url)
    control = ControlServer(settings, registry, tokens)
    await control.start()
    config = uvicorn.Config(
        create_app(registry), log_level="warning", access_log=False, lifespan="off"
    )
    http = HttpServer(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, http.request_exit)
    http_port = http_sock.getsockname()[1]
    shown = make_url(settings.database_url).render_as_string(hide_password=True)
    # Everything loaded so far (modules, the ORM's mappers) lives as long as the process:
    # keep it out of the cyclic collector's way, which shortens GC pauses on the hot path.
    gc.freeze()
    print(
        f"cpn serve: gRPC on {settings.host}:{control.port}, HTTP on {settings.host}:{http_port}, "
        f"database {shown}, sites {', '.join(tokens.sites)}",
        flush=True,
    )
    try:
        await http.serve(sockets=[http_sock])  # returns after SIGINT/SIGTERM
    finally:
        log.info("shutting down")
        await control.stop()
        registry.dispose()
