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
#: The cyclic collector's thresholds for `cpn serve` (see where they are set).
GC_THRESHOLDS = (20_000, 50, 100)
#: How long HTTP requests still running at shutdown may take before they are cancelled.
GRACEFUL_SHUTDOWN_S = 5


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def bind_http(host: str, port: int) -> socket.socket:
    """Bind the HTTP socket ourselves, so a taken port is one clear line, not a traceback."""
    # proto=IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off
    # (TCP_NODELAY) only on sockets whose proto says TCP, and the connections accepted
    # here inherit it. With Nagle on, a response written in two parts (headers, body)
    # waited for the client's delayed ACK: 40 ms added to every request.
    sock = socket.socket(
        socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CpnError(f"--http-port: cannot listen on {host}:{port} ({exc.strerror})") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _help(name: str, text: str) -> str:
    """A flag's help naming its variable. The defaults live only in ControlSettings
    (`cpn serve --print-settings` shows them); importing it here would slow every `cpn`
    command down."""
    return f"{text} (or $CPN_{name.upper()})."


@app.command()
def serve(
    site_tokens: Annotated[
        Path | None,
        typer.Option(
            "--site-tokens",
            help="YAML mapping site name → bearer token (or → {token, gpu_price_per_hour, "
            "intra_site_gbps}); agents of a site authenticate with its token. Required "
            "(or $CPN_SITE_TOKENS).",
            show_default=False,
        ),
    ] = None,
    database_url: Annotated[
        str | None,
        typer.Option(
            "--database-url",
            help=_help("database_url", "sqlite:///path.db or postgresql://user@host/db"),
            show_default=False,
        ),
    ] = None,
    grpc_port: Annotated[
        int | None,
        typer.Option(
            "--grpc-port",
            help=_help("grpc_port", "Agent service port, 0: any free port"),
            show_default=False,
        ),
    ] = None,
    http_port: Annotated[
        int | None,
        typer.Option(
            "--http-port",
            help=_help("http_port", "REST API port, 0: any free port"),
            show_default=False,
        ),
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(help=_help("host", "Address both servers listen on"), show_default=False),
    ] = None,
    lease_ttl: Annotated[
        float | None,
        typer.Option(
            "--lease-ttl",
            help=_help("lease_ttl_s", "Seconds without a heartbeat before an agent is lost"),
            show_default=False,
        ),
    ] = None,
    heartbeat_interval: Annotated[
        float | None,
        typer.Option(
            "--heartbeat-interval",
            help=_help("heartbeat_interval_s", "Seconds between heartbeats asked of agents"),
            show_default=False,
        ),
    ] = None,
    max_message_bytes: Annotated[
        int | None,
        typer.Option(
            "--max-message-bytes",
            help=_help("max_message_bytes", "Largest request accepted from an agent"),
            show_default=False,
        ),
    ] = None,
    log_level: Annotated[
        str | None,
        typer.Option(
            "--log-level",
            help=_help("log_level", "debug, info, warning, error"),
            show_default=False,
        ),
    ] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option(
            "--tls-cert",
            help=_help("tls_cert", "PEM certificate chain: serve gRPC over TLS"),
            show_default=False,
        ),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option(
            "--tls-key", help=_help("tls_key", "PEM private key for --tls-cert"), show_default=False
        ),
    ] = None,
    print_settings: Annotated[
        bool,
        typer.Option(
            "--print-settings",
            help="Print every setting with its value (defaults, $CPN_* and flags applied) "
            "as JSON, and exit.",
        ),
    ] = False,
) -> None:
    """Run the control plane: migrate the database, then serve agents over gRPC, run the
    orchestration loop and serve the REST API over HTTP until interrupted.

    Every setting can also come from a `CPN_*` environment variable (docs/service.md lists
    them); a flag given wins over the environment. Prints one line when ready: the gRPC and
    HTTP ports and the database.
    """
    from cpn.control import SiteTokens  # noqa: PLC0415
    from cpn.registry import upgrade  # noqa: PLC0415
    from cpn.registry.db import normalize_url  # noqa: PLC0415

    flags = {
        "site_tokens": site_tokens,
        "database_url": database_url,
        "grpc_port": grpc_port,
        "http_port": http_port,
        "host": host,
        "lease_ttl_s": lease_ttl,
        "heartbeat_interval_s": heartbeat_interval,
        "max_message_bytes": max_message_bytes,
        "log_level": log_level,
        "tls_cert": tls_cert,
        "tls_key": tls_key,
    }
    settings = load_settings({k: v for k, v in flags.items() if v is not None})
    if print_settings:
        typer.echo(settings.model_dump_json(indent=2))
        return
    setup_logging(settings.log_level)
    if settings.site_tokens is None:
        raise InputError("--site-tokens: required (or $CPN_SITE_TOKENS)")
    tokens = SiteTokens.load(settings.site_tokens)
    settings = settings.model_copy(update={"database_url": normalize_url(settings.database_url)})
    upgrade(settings.database_url)
    http_sock = bind_http(settings.host, settings.http_port)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(settings, tokens, http_sock))


_FLAG_NAMES = {
    "lease_ttl_s": "--lease-ttl",
    "heartbeat_interval_s": "--heartbeat-interval",
}


def load_settings(overrides: dict[str, object]) -> ControlSettings:
    """Defaults < $CPN_* < flags; a bad value is one line naming the flag or variable."""
    from cpn.control import ControlSettings  # noqa: PLC0415

    try:
        return ControlSettings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["loc"]:
            name = str(err["loc"][0])
            where = (
                _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
                if name in overrides
                else f"$CPN_{name.upper()}"
            )
            msg = f"{where}: {msg}"
        raise InputError(msg) from None


async def _serve(settings: ControlSettings, tokens: SiteTokens, http_sock: socket.socket) -> None:
    import uvicorn  # noqa: PLC0415
    from sqlalchemy.engine import make_url  # noqa: PLC0415

    from api import create_app  # noqa: PLC0415
    from cpn.cli.http_server import HttpServer  # noqa: PLC0415
    from cpn.control import ControlServer  # noqa: PLC0415
    from cpn.orchestration import JobService, ServiceMetrics  # noqa: PLC0415
    from cpn.orchestration.loop import Orchestrator  # noqa: PLC0415
    from cpn.registry import Registry  # noqa: PLC0415

    registry = Registry(settings.database_url)
    control = ControlServer(settings, registry, tokens)
    await control.start()
    metrics = ServiceMetrics(registry, heartbeats=lambda: control.state.heartbeats)
    orchestrator = Orchestrator(control, registry, metrics)
    await orchestrator.start()
    service = JobService(
        registry,
        settings,
        wake=orchestrator.wake,
        capacity_version=lambda: control.leases.peers_version,
        submitted=orchestrator.submitted,
    )

    def ready() -> str | None:
        return None if orchestrator.ticks > 0 else "the orchestration loop has not run yet"

    app = create_app(registry, settings=settings, service=service, metrics=metrics, ready=ready)
    # Requests still running at shutdown get GRACEFUL_SHUTDOWN_S to finish, then are
    # cancelled: a stop never waits on a client.
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    http = HttpServer(config)
    loop = asyncio.get_running_loop()

    def stop() -> None:
        app.state.stopping.set()  # followed log streams end now
        http.request_exit()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    http_port = http_sock.getsockname()[1]
    shown = make_url(settings.database_url).render_as_string(hide_password=True)
    # Everything loaded so far (modules, the ORM's mappers) lives as long as the process:
    # keep it out of the cyclic collector's way, which shortens GC pauses on the hot path.
    gc.freeze()
    # Young collections every 20,000 allocations instead of 700, and the older generations
    # far more rarely: a request allocates thousands of objects, and with the defaults the
    # collector ran ~400 times in a bench run (1.6 s of pauses, a full collection up to
    # 99 ms, every request in flight waiting); with these, 8 times (0.1 s). Cyclic garbage
    # is still collected, by the young collections, where nearly all of it is.
    gc.set_threshold(*GC_THRESHOLDS)
    print(
        f"cpn serve: gRPC on {settings.host}:{control.port}, HTTP on {settings.host}:{http_port}, "
        f"database {shown}, sites {', '.join(tokens.sites)}",
        flush=True,
    )
    try:
        await http.serve(sockets=[http_sock])  # returns after SIGINT/SIGTERM
    finally:
        log.info("shutting down")
        await orchestrator.stop()
        await control.stop()
        registry.dispose()
