"""The control server: gRPC agent service with auth, health, reflection, and the two
background jobs that keep leases honest — the reaper and the heartbeat flusher.

    server = ControlServer(settings, registry, tokens)
    await server.start()          # binds, restores leases from the database, serves
    server.dispatcher.launch(...) # the orchestration's way to send orders
    await server.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from sqlalchemy import select
from sqlalchemy.orm import Session

from cpn.control.auth import BearerTokenInterceptor
from cpn.control.dispatch import AssignmentDispatcher, drop_orders
from cpn.control.handlers import add_agent_service
from cpn.control.leases import LeaseTable, LiveLease
from cpn.control.servicer import AgentServicer, ControlState
from cpn.control.settings import ControlSettings
from cpn.control.tokens import SiteTokens
from cpn.errors import CpnError, InputError
from cpn.registry import Registry
from cpn.registry.leases import (
    HeartbeatRecord,
    StoredLease,
    apply_heartbeats,
    is_current_lease,
    live_leases,
    mark_lost,
)
from cpn.registry.models import Lease, utcnow
from proto.cpn.v1 import agent_pb2

log = logging.getLogger("cpn.control")

SERVICE_NAME = agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name


class PortInUse(CpnError):
    """The gRPC port cannot be bound."""


class ControlServer:
    def __init__(self, settings: ControlSettings, registry: Registry, tokens: SiteTokens) -> None:
        self.state = ControlState(settings=settings, registry=registry, tokens=tokens)
        self._server: aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._health = health.aio.HealthServicer()
        self.port = 0

    @property
    def dispatcher(self) -> AssignmentDispatcher:
        return self.state.dispatcher

    @property
    def leases(self) -> LeaseTable:
        return self.state.leases

    async def start(self) -> int:
        """Restore leases, bind and serve. Returns the bound gRPC port."""
        settings = self.state.settings
        self.dispatcher.bind(asyncio.get_running_loop(), self.state.run_db)
        await self._restore_leases()
        limit = settings.max_message_bytes
        server = aio.server(
            interceptors=[BearerTokenInterceptor(self.state.tokens)],
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ("grpc.so_reuseport", 0),
                ("grpc.http2.bdp_probe", 0),
                # Agents keep WatchAssignments open for hours: ping to notice dead peers.
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ],
        )
        add_agent_service(AgentServicer(self.state), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        address = f"{settings.host}:{settings.grpc_port}"
        try:
            if settings.tls_cert is not None and settings.tls_key is not None:
                credentials = grpc.ssl_server_credentials(
                    [
                        (
                            _read_pem(settings.tls_key, "--tls-key"),
                            _read_pem(settings.tls_cert, "--tls-cert"),
                        )
                    ]
                )
                self.port = server.add_secure_port(address, credentials)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise PortInUse(f"--grpc-port: cannot listen on {address} (in use?)")
        await server.start()
        self._server = server
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._tasks = [
            asyncio.create_task(self._reaper(), name="cpn-reaper"),
            asyncio.create_task(self._flusher(), name="cpn-flusher"),
        ]
        log.info(
            "gRPC agent service on %s:%d (%s)",
            settings.host,
            self.port,
            "TLS" if settings.tls_cert is not None else "plaintext",
        )
        return self.port

    async def stop(self, grace: float = 2.0) -> None:
        await self._health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.stop(grace)
        await self._flush()  # the last renewals, so the database is as fresh as we were
        self.state.db.shutdown(wait=True)

    # ------------------------------------------------------------------ background work

    async def _restore_leases(self) -> None:
        """After a restart: every agent the database calls alive gets `restart_grace_s`
        (at least one TTL) to register again (heartbeat grace, as Nomad gives after a
        leader change: agents that backed off while we were down need time to come back);
        the reaper declares lost those that do not."""
        stored = await self.state.run_db(self._load_leases)
        ttl = self.state.settings.lease_ttl_s
        grace = max(ttl, self.state.settings.restart_grace_s)
        now_wall, now_mono = datetime.now(UTC), time.monotonic()
        for s in stored:
            remaining = max((s.expires_at - now_wall).total_seconds(), grace)
            self.leases.put(
                LiveLease(
                    lease_id=s.lease_id,
                    site=s.site,
                    agent_id=s.agent_id,
                    agent_pk=s.agent_pk,
                    site_id=0,
                    lease_pk=0,
                    ttl_s=ttl,
                    expires_mono=now_mono + remaining,
                    restored=True,
                )
            )
        if stored:
            log.info("restored %d leases; waiting for their agents to register again", len(stored))

    def _load_leases(self) -> list[StoredLease]:
        with self.state.registry.read() as session:
            return list(live_leases(session))

    async def _reaper(self) -> None:
        interval = self.state.settings.reaper_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reap()
            except Exception:
                log.exception("reaper: will retry")

    async def reap(self) -> list[LiveLease]:
        """Declare every agent whose lease expired lost. Returns their leases.

        On PostgreSQL other control planes may share the database, each holding the leases
        of the agents connected to it and writing their renewals: leases this process
        restored at start but whose agents renew elsewhere are let go, not declared lost,
        and leases the database shows expired that no process here holds (another control
        plane died with them) are reaped from the database."""
        if self.state.registry.dialect == "postgresql":
            await self.state.run_db(self._reap_stored)
        expired = self.leases.expired()
        reaped: list[LiveLease] = []
        for lease in expired:
            # The list was taken before the awaits below: an agent may have registered
            # again meanwhile (its new lease replaced this one). Closing its stream now
            # would close the new session's, which the agent, renewing its new lease,
            # would never notice — its orders would wait for ever.
            if self.leases.get(lease.lease_id) is not lease:
                continue
            self.leases.remove(lease)
            self.dispatcher.close(lease.site, lease.agent_id)
            marked = await self.state.run_db(self._mark_lost, lease)
            if marked is None:
                continue  # the agent is not lost: nothing to tell, nothing to log as a loss
            reaped.append(lease)
            gpus, dropped = marked
            self._tell_loss(lease.site, lease.agent_id)
            log.warning(
                "agent %s/%s lost: lease expired (%d GPUs lost, %d orders dropped)",
                lease.site,
                lease.agent_id,
                gpus,
                dropped,
            )
        return reaped

    def _reap_stored(self) -> None:
        settings = self.state.settings
        margin = timedelta(seconds=2 * settings.flush_interval_s + settings.reaper_interval_s)
        with self.state.registry.read() as session:
            stale = [
                s
                for s in live_leases(session)
                if s.expires_at < utcnow() - margin and self.leases.get(s.lease_id) is None
            ]
        for s in stale:
            with self.state.registry.write() as session:
                dropped = drop_orders(session, s.site, s.agent_id)
                gpus = mark_lost(
                    session, s.agent_pk, s.lease_id, utcnow(), "lease expired (held elsewhere)"
                )
            if gpus or dropped:
                log.warning("agent %s/%s lost: lease expired elsewhere", s.site, s.agent_id)
            self._tell_loss(s.site, s.agent_id)

    def _tell_loss(self, site: str, agent_id: str) -> None:
        for listener in self.state.loss_listeners:
            try:
                listener(site, agent_id)
            except Exception:
                log.exception("loss listener failed")

    def _renewed_elsewhere(self, session: Session, lease: LiveLease) -> bool:
        """A lease restored at start whose agent renews it through another control plane."""
        if not lease.restored:
            return False
        row = session.scalar(select(Lease).where(Lease.lease_id == lease.lease_id))
        return row is not None and row.revoked_at is None and row.expires_at > utcnow()

    def _mark_lost(self, lease: LiveLease) -> tuple[int, int] | None:
        """GPUs marked lost and orders dropped, in one transaction; None when the agent is
        not lost after all (its lease renewed through another control plane, or replaced
        by a registration that reached the database after the reaper's in-memory check)."""
        with self.state.registry.write() as session:
            if self._renewed_elsewhere(session, lease):
                log.info("lease of %s/%s is renewed elsewhere: let go", lease.site, lease.agent_id)
                return None
            if not is_current_lease(session, lease.agent_pk, lease.lease_id):
                # Registered again since: its orders are the new session's.
                log.info("lease of %s/%s was replaced: not lost", lease.site, lease.agent_id)
                return None
            dropped = drop_orders(session, lease.site, lease.agent_id)
            reason = "lease expired"
            if dropped:
                reason += f"; {dropped} queued orders dropped"
            gpus = mark_lost(session, lease.agent_pk, lease.lease_id, utcnow(), reason)
            return gpus, dropped

    async def _flusher(self) -> None:
        interval = self.state.settings.flush_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self._flush()
            except Exception:
                log.exception("heartbeat flush failed: will retry with fresher data")

    async def _flush(self) -> None:
        batch = self.leases.take_dirty()
        if batch:
            await self.state.run_db(self._write_batch, batch)

    def _write_batch(self, batch: list[HeartbeatRecord]) -> None:
        with self.state.registry.write() as session:
            apply_heartbeats(session, batch)


def _read_pem(path: Path, flag: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{flag}: {path}: cannot read ({exc.strerror})") from None
    if b"-----BEGIN " not in data:
        raise InputError(f"{flag}: {path}: not a PEM file")
    return data


__all__ = ["ControlServer", "PortInUse"]
