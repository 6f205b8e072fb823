"""The agent's life: discover, register, heartbeat, watch for orders, report, and come
back by itself when the control plane goes away or restarts.

    connect ──► heartbeat with the lease we have ──NOT_FOUND──► Register (same identity)
       ▲                     │ ok                                   │
       │                     ▼                                      ▼
       └── backoff ◄── session: HeartbeatEvent · ProbeEvent · WatchAssignments · reports
                       (any RPC failing UNAVAILABLE ends the session)

Refusals that retrying cannot fix — a bad token, another site's name, an inventory the
control plane rejects — stop the agent with the control plane's message (`AgentRefused`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio

from agents import __version__
from agents.config import AgentConfig
from agents.convert import node_message
from agents.discovery import GpuDiscovery, discover_gpus, discover_rdma
from agents.discovery.gpus import sample_usage
from agents.events import HealthEvent, HeartbeatEvent, ProbeEvent, run_events
from agents.probe import ProbeResult, ProbeServer
from agents.workers import TaskUpdate, WorkerManager
from proto.cpn.v1 import agent_pb2 as pb
from proto.cpn.v1 import agent_pb2_grpc

log = logging.getLogger("cpn.agent")

REFUSALS = {
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Reconnect attempts are ours (with backoff); keep gRPC's own short.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
RPC_TIMEOUT_S = 30.0


class AgentError(Exception):
    """The agent cannot run; the message says why (the CLI prints it as one line)."""


class AgentRefused(AgentError):
    """The control plane refused this agent for a reason retrying cannot fix."""


class _SessionEnded(Exception):
    """The control plane ended the assignment stream: reconnect."""


@dataclass
class Backoff:
    """Exponential backoff with jitter, reset after a successful (re)connection."""

    initial_s: float = 0.5
    max_s: float = 30.0
    current_s: float = 0.5

    def next(self) -> float:
        delay = self.current_s * random.uniform(0.8, 1.2)
        self.current_s = min(self.current_s * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self.current_s = self.initial_s


def route_address(control: str) -> str:
    """The local address that routes to the control plane: what peers can reach us on."""
    host = control.rpartition(":")[0].strip("[]") or "127.0.0.1"
    try:
        infos = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # UDP: no packet is sent, the kernel just picks a route
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.metadata = (("authorization", f"Bearer {config.token}"),)
        self.lease_id: str | None = None
        self.heartbeat_interval_s = 3.0
        self.peers: list[pb.Peer] = []
        self.peers_changed = asyncio.Event()  # set when the control plane sends new peers
        self.peers_version = 0
        self.registrations = 0
        self.gpus = GpuDiscovery([], "none")
        self.inventory: pb.Inventory | None = None
        self.probe = ProbeServer(config.probe_host, config.probe_port)
        self.probe_address = ""
        self._links: dict[str, ProbeResult] = {}
        self.health: pb.Health.ValueType = pb.HEALTH_OK
        self._active_ports: set[tuple[str, int]] = set()
        self._reports: dict[tuple[str, int], TaskUpdate] = {}
        self._reports_changed = asyncio.Event()
        self._stub: agent_pb2_grpc.AgentServiceAsyncStub | None = None
        self._beats: Any = None  # the session's HeartbeatStream call, opened on first use
        self._tls_roots: bytes | None = None
        self.workers = WorkerManager(
            site=config.site,
            nodes={config.node_name},
            command=config.worker_command,
            work_dir=config.work_dir,
            report=self.report,
            stop_grace_s=config.stop_grace_s,
        )

    # ------------------------------------------------------------------ discovery

    def discover(self) -> pb.Inventory:
        self.gpus = discover_gpus(self.config.virtual)
        nics = discover_rdma(self.config.sysfs_root)
        self._active_ports = {(n.device, n.port) for n in nics if n.state == "active"}
        self.workers.real_gpus = self.gpus.source != "virtual"
        log.info(
            "discovered %d GPUs (%s) and %d RDMA ports on node %s",
            len(self.gpus.gpus),
            self.gpus.source,
            len(nics),
            self.config.node_name,
        )
        node = node_message(
            self.config.node_name, self.gpus.gpus, nics, self.config.intra_node_gbps
        )
        return pb.Inventory(nodes=[node])

    @property
    def health_name(self) -> str:
        return pb.Health.Name(self.health).removeprefix("HEALTH_").lower()

    def check_health(self) -> tuple[pb.Health.ValueType, str]:
        """(health, why) from a fresh look at the hardware found at start."""
        if self.gpus.source not in ("virtual", "none"):
            found = discover_gpus(self.config.virtual)
            if found.source != self.gpus.source or len(found.gpus) < len(self.gpus.gpus):
                return pb.HEALTH_FAILING, (
                    f"{len(found.gpus)} GPUs visible ({found.source}), "
                    f"{len(self.gpus.gpus)} at start ({self.gpus.source})"
                )
        active = {
            (n.device, n.port) for n in discover_rdma(self.config.sysfs_root) if n.state == "active"
        }
        lost = sorted(self._active_ports - active)
        if lost:
            ports = ", ".join(f"{device} port {port}" for device, port in lost)
            return pb.HEALTH_DEGRADED, f"RDMA {ports} no longer active"
        return pb.HEALTH_OK, ""

    # ------------------------------------------------------------------ main loop

    async def run(self) -> None:
        if self.config.tls_ca is not None:
            try:
                self._tls_roots = self.config.tls_ca.read_bytes()
            except OSError as exc:
                raise AgentError(
                    f"--tls-ca: {self.config.tls_ca}: cannot read ({exc.strerror})"
                ) from None
        self.inventory = await asyncio.to_thread(self.discover)
        try:
            port = await self.probe.start()
        except OSError as exc:
            where = f"{self.config.probe_host}:{self.config.probe_port}"
            raise AgentError(f"--probe-port: cannot listen on {where} ({exc.strerror})") from None
        host = self.config.advertise_host or route_address(self.config.control)
        self.probe_address = f"{host}:{port}"
        log.info("WAN probe endpoint on %s", self.probe_address)
        backoff = Backoff(max_s=self.config.max_backoff_s)
        try:
            while True:
                channel = self._channel()
                self._stub = agent_pb2_grpc.AgentServiceStub(channel)
                try:
                    await self._connect()
                    backoff.reset()
                    await self._session()
                except aio.AioRpcError as exc:
                    if exc.code() in REFUSALS:
                        raise AgentRefused(
                            f"control plane {self.config.control} refused the agent: "
                            f"{exc.code().name}: {exc.details()}"
                        ) from None
                    if exc.code() == grpc.StatusCode.NOT_FOUND:
                        log.info("control plane does not know our lease (%s)", exc.details())
                        self.lease_id = None
                        continue
                    delay = backoff.next()
                    log.warning(
                        "control plane %s: %s (%s); retrying in %.1f s",
                        self.config.control,
                        exc.code().name,
                        exc.details(),
                        delay,
                    )
                    await asyncio.sleep(delay)
                except _SessionEnded as exc:
                    log.info("%s; reconnecting", exc)
                    await asyncio.sleep(min(backoff.next(), 1.0))
                except TimeoutError:
                    delay = backoff.next()
                    log.warning(
                        "control plane %s did not answer in time; retrying in %.1f s",
                        self.config.control,
                        delay,
                    )
                    await asyncio.sleep(delay)
                finally:
                    self._close_beats()
                    await channel.close(grace=None)
        finally:
            await self.workers.stop_all()
            await self.probe.stop()

    def _channel(self) -> aio.Channel:
        if self._tls_roots is None:
            return aio.insecure_channel(self.config.control, options=CHANNEL_OPTIONS)
        credentials = grpc.ssl_channel_credentials(root_certificates=self._tls_roots)
        return aio.secure_channel(self.config.control, credentials, options=CHANNEL_OPTIONS)

    @property
    def stub(self) -> agent_pb2_grpc.AgentServiceAsyncStub:
        assert self._stub is not None
        return self._stub

    async def _connect(self) -> None:
        if self.lease_id is not None:
            try:
                await self.heartbeat(unary=True)
                log.info("reconnected with lease %s", self.lease_id)
                return
            except aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                self.lease_id = None
        await self.register()

    async def register(self) -> None:
        request = pb.RegisterRequest(
            site=self.config.site,
            agent_id=self.config.agent_id,
            version=__version__,
            inventory=self.inventory,
            probe_address=self.probe_address,
        )
        response = await self.stub.Register(request, metadata=self.metadata, timeout=RPC_TIMEOUT_S)
        self.lease_id = response.lease_id
        self.heartbeat_interval_s = response.heartbeat_interval_ms / 1000
        self.peers = list(response.peers)
        self.peers_version = response.peers_version
        self.peers_changed.set()
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

    async def _session(self) -> None:
        tasks = [
            asyncio.create_task(run_events(self, [HeartbeatEvent(), ProbeEvent(), HealthEvent()])),
            asyncio.create_task(self._watch()),
            asyncio.create_task(self._send_reports()),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            raise _SessionEnded("session ended")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._close_beats()

    # ------------------------------------------------------------------ RPCs

    def _close_beats(self) -> None:
        if self._beats is not None:
            self._beats.cancel()
            self._beats = None

    async def heartbeat(self, *, unary: bool = False) -> None:
        """Renew the lease: on the session's heartbeat stream (cheap for the control plane),
        or as a unary call (when checking whether a lease is still known)."""
        assert self.lease_id is not None
        usage = await self._usage()
        links = [
            pb.LinkMeasurement(
                peer_site=site,
                bandwidth_gbps=r.bandwidth_gbps,
                rtt_ms=r.rtt_ms,
                measured_at_unix_ms=int(r.measured_at * 1000),
            )
            for site, r in sorted(self._links.items())
        ]
        request = pb.HeartbeatRequest(
            site=self.config.site,
            agent_id=self.config.agent_id,
            lease_id=self.lease_id,
            health=self.health,
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
            await asyncio.wait_for(self._beats.write(request), timeout)
            answer = await asyncio.wait_for(self._beats.read(), timeout)
            if answer is aio.EOF:  # the server ended the stream without an error
                raise _SessionEnded("the control plane closed the heartbeat stream")
            response = answer
        for site in [link.peer_site for link in links]:
            self._links.pop(site, None)  # delivered; newer ones may have arrived meanwhile
        if response.heartbeat_interval_ms:
            self.heartbeat_interval_s = response.heartbeat_interval_ms / 1000
        if response.peers_changed:
            self.peers = list(response.peers)
            self.peers_version = response.peers_version
            self.peers_changed.set()

    async def _usage(self) -> list[pb.GpuUsage]:
        node = self.config.node_name
        samples = await asyncio.to_thread(sample_usage, self.gpus.source)
        if samples is not None:
            return [
                pb.GpuUsage(
                    node=node,
                    index=s.index,
                    utilisation=min(max(s.utilisation, 0.0), 1.0),
                    memory_used_gb=s.memory_used_gb,
                )
                for s in samples
            ]
        busy = self.workers.busy_gpus()
        return [
            pb.GpuUsage(
                node=node, index=g.index, utilisation=1.0 if (node, g.index) in busy else 0.0
            )
            for g in self.gpus.gpus
        ]

    async def _watch(self) -> None:
        assert self.lease_id is not None
        request = pb.WatchAssignmentsRequest(
            site=self.config.site, agent_id=self.config.agent_id, lease_id=self.lease_id
        )
        stops: set[asyncio.Task[int]] = set()
        async for assignment in self.stub.WatchAssignments(request, metadata=self.metadata):
            which = assignment.WhichOneof("order")
            if which == "launch":
                order = assignment.launch
                log.info("order %s: launch job %s", assignment.order_id, order.job_id)
                try:
                    await self.workers.launch(order)
                except OSError as exc:  # the work directory cannot be written, say
                    log.error("job %s: cannot launch: %s", order.job_id, exc)
                    for r in order.ranks:
                        if r.site == self.config.site and r.node == self.config.node_name:
                            self.report(
                                TaskUpdate(
                                    job_id=order.job_id,
                                    rank=r.rank,
                                    state=pb.TASK_STATE_FAILED,
                                    exit_code=-1,
                                    message=f"cannot launch: {exc}",
                                )
                            )
            elif which == "stop":
                log.info("order %s: stop job %s", assignment.order_id, assignment.stop.job_id)
                task = asyncio.create_task(
                    self.workers.stop(assignment.stop.job_id, assignment.stop.reason)
                )
                stops.add(task)
                task.add_done_callback(stops.discard)
            else:
                log.warning("order %s of an unknown kind; ignored", assignment.order_id)
        raise _SessionEnded("the control plane closed the assignment stream")

    def report(self, update: TaskUpdate) -> None:
        """Queue a task update; the newest per (job, rank) is sent, none is lost to an
        outage (they wait for the next session)."""
        self._reports[(update.job_id, update.rank)] = update
        self._reports_changed.set()

    async def _send_reports(self) -> None:
        while True:
            await self._reports_changed.wait()
            self._reports_changed.clear()
            for key, update in list(self._reports.items()):
                assert self.lease_id is not None
                request = pb.ReportTaskStatusRequest(
                    site=self.config.site,
                    agent_id=self.config.agent_id,
                    lease_id=self.lease_id,
                    job_id=update.job_id,
                    rank=update.rank,
                    state=update.state,
                    step=update.step,
                    bytes=pb.LinkBytes(
                        intra_node=update.bytes_intra_node,
                        intra_site=update.bytes_intra_site,
                        wan=update.bytes_wan,
                    ),
                    checkpoint_id=update.checkpoint_id,
                    exit_code=update.exit_code,
                    message=update.message,
                )
                if update.loss is not None:
                    request.loss = update.loss
                self.workers.outbox.fill(request)  # new log lines and steps (agents/logs.py)
                try:
                    await self.stub.ReportTaskStatus(
                        request, metadata=self.metadata, timeout=RPC_TIMEOUT_S
                    )
                except BaseException:
                    self.workers.outbox.put_back(request)
                    raise
                if self.workers.outbox.pending(update.job_id, update.rank):
                    self._reports_changed.set()  # more than one report's worth: go again
                elif self._reports.get(key) is update:
                    del self._reports[key]

    def record_link(self, site: str, result: ProbeResult) -> None:
        self._links[site] = result


async def run_agent(config: AgentConfig) -> None:
    """Run until cancelled (SIGINT/SIGTERM in `cpn agent`)."""
    agent = Agent(config)
    started = time.monotonic()
    try:
        await agent.run()
    finally:
        log.info("agent stopped after %.0f s", time.monotonic() - started)


__all__ = ["Agent", "AgentError", "AgentRefused", "Backoff", "run_agent"]
