"""The agent's side of the protocol (proto/cpn/v1/agent.proto): one object that holds the
lease and the peer list across reconnections and makes the RPCs on the current channel.

It knows nothing of workers or hardware: callers hand it the messages' contents.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc import aio

from agents import __version__
from agents.config import AgentConfig
from proto.cpn.v1 import agent_pb2 as pb
from proto.cpn.v1 import agent_pb2_grpc

log = logging.getLogger("cpn.agent")

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Reconnect attempts are ours (with backoff); keep gRPC's own short.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
RPC_TIMEOUT_S = 30.0


class SessionEnded(Exception):
    """The control plane ended a stream without an error: reconnect."""


class ControlLink:
    """Lease, peers and RPCs. `connect` a channel for each session, `close` after it."""

    def __init__(self, config: AgentConfig, tls_roots: bytes | None = None) -> None:
        self.config = config
        self.metadata = (("authorization", f"Bearer {config.token}"),)
        self.tls_roots = tls_roots
        self.lease_id: str | None = None
        self.heartbeat_interval_s = 3.0
        self.lease_ttl_s = 10.0
        #: When the control plane last renewed our lease (monotonic): fencing's clock.
        self.last_renewal: float | None = None
        self.peers: list[pb.Peer] = []
        self.peers_version = 0
        self.peers_changed = asyncio.Event()  # set when the control plane sends new peers
        self.registrations = 0
        #: Control planes to try, in turn (`--control a:1,b:2`: several sharing a database).
        self.targets = [t.strip() for t in config.control.split(",") if t.strip()]
        self._target = 0
        self._channel: aio.Channel | None = None
        self._stub: agent_pb2_grpc.AgentServiceAsyncStub | None = None
        self._beats: Any = None  # the session's HeartbeatStream call, opened on first use

    # -- channels --------------------------------------------------------------------------
    @property
    def target(self) -> str:
        return self.targets[self._target]

    def fail_over(self) -> None:
        """The current control plane cannot be reached: the next session tries the next."""
        if len(self.targets) > 1:
            self._target = (self._target + 1) % len(self.targets)
            log.info("trying control plane %s next", self.target)

    def connect(self) -> None:
        target = self.target
        if self.tls_roots is None:
            self._channel = aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        else:
            credentials = grpc.ssl_channel_credentials(root_certificates=self.tls_roots)
            self._channel = aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
        self._stub = agent_pb2_grpc.AgentServiceStub(self._channel)

    async def close(self) -> None:
        self.close_stream()
        if self._channel is not None:
            await self._channel.close(grace=None)
            self._channel = self._stub = None

    def close_stream(self) -> None:
        if self._beats is not None:
            self._beats.cancel()
            self._beats = None

    @property
    def stub(self) -> agent_pb2_grpc.AgentServiceAsyncStub:
        assert self._stub is not None, "connect() first"
        return self._stub

    @property
    def lease(self) -> str:
        assert self.lease_id is not None, "register first"
        return self.lease_id

    # -- RPCs ------------------------------------------------------------------------------
    async def register(
        self,
        inventory: pb.Inventory,
        probe_address: str,
        launches: list[tuple[str, int]] | None = None,
    ) -> None:
        """Register (again). `launches`: every launch this process follows, listed when
        the control plane may have workers of ours it should stop waiting for (the first
        registration of a process, or after its lease was lost); None when registering
        again only to say that the site's nodes changed."""
        request = pb.RegisterRequest(
            site=self.config.site,
            agent_id=self.config.agent_id,
            version=__version__,
            inventory=inventory,
            probe_address=probe_address,
            launches=[pb.LaunchRef(job_id=j, epoch=e) for j, e in launches or []],
            launches_listed=launches is not None,
        )
        response = await self.stub.Register(request, metadata=self.metadata, timeout=RPC_TIMEOUT_S)
        self.lease_id = response.lease_id
        self.heartbeat_interval_s = response.heartbeat_interval_ms / 1000
        self.lease_ttl_s = response.lease_ttl_ms / 1000 or self.lease_ttl_s
        self.last_renewal = time.monotonic()
        self._new_peers(response.peers, response.peers_version)
        self.registrations += 1
        log.info(
            "registered as %s/%s: lease %s, TTL %.1f s, heartbeat every %.1f s, %d peers",
            self.config.site,
            self.config.agent_id,
            self.lease_id,
            response.lease_ttl_ms / 1000,
            self.heartbeat_interval_s,
            len(self.peers),
        )

    async def heartbeat(
        self,
        health: pb.Health.ValueType,
        usage: list[pb.GpuUsage],
        links: list[pb.LinkMeasurement],
        *,
        unary: bool = False,
    ) -> None:
        """Renew the lease: on the session's heartbeat stream (cheap for the control plane),
        or as a unary call (when checking whether a lease is still known)."""
        request = pb.HeartbeatRequest(
            site=self.config.site,
            agent_id=self.config.agent_id,
            lease_id=self.lease,
            health=health,
            gpus=usage,
            links=links,
            peers_version=self.peers_version,
        )
        timeout = max(2.0, self.heartbeat_interval_s * 2)
        if unary:
            response = await self.stub.Heartbeat(request, metadata=self.metadata, timeout=timeout)
        else:
            if self._beats is None:
                self._beats = self.stub.HeartbeatStream(metadata=self.metadata)
            async with asyncio.timeout(timeout):  # not wait_for: see agents/events.py
                await self._beats.write(request)
            async with asyncio.timeout(timeout):
                answer = await self._beats.read()
            if answer is aio.EOF:  # the server ended the stream without an error
                raise SessionEnded("the control plane closed the heartbeat stream")
            response = answer
        self.last_renewal = time.monotonic()
        if response.lease_ttl_ms:
            self.lease_ttl_s = response.lease_ttl_ms / 1000
        if response.heartbeat_interval_ms:
            self.heartbeat_interval_s = response.heartbeat_interval_ms / 1000
        if response.peers_changed:
            self._new_peers(response.peers, response.peers_version)

    def _new_peers(self, peers: Any, version: int) -> None:
        self.peers = list(peers)
        self.peers_version = version
        self.peers_changed.set()

    async def assignments(self) -> AsyncIterator[pb.Assignment]:
        """Orders for this agent until the control plane ends the stream."""
        request = pb.WatchAssignmentsRequest(
            site=self.config.site, agent_id=self.config.agent_id, lease_id=self.lease
        )
        async for assignment in self.stub.WatchAssignments(request, metadata=self.metadata):
            yield assignment
        raise SessionEnded("the control plane closed the assignment stream")

    async def report(self, request: pb.ReportTaskStatusRequest) -> None:
        await self.stub.ReportTaskStatus(request, metadata=self.metadata, timeout=RPC_TIMEOUT_S)
