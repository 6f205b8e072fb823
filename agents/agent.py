"""The agent's life: discover, register, heartbeat, watch for orders, report, and come
back by itself when the control plane goes away or restarts.

    connect ──► heartbeat with the lease we have ──NOT_FOUND──► Register (same identity)
       ▲                     │ ok                                   │
       │                     ▼                                      ▼
       └── backoff ◄── session: HeartbeatEvent · ProbeEvent · HealthEvent · orders · reports
                       (any RPC failing UNAVAILABLE ends the session)

The parts, each in its own module: `Hardware` (discovery, health), `ControlLink` (lease,
peers, RPCs), `LinkBook` (WAN measurements), `LaunchManager` (workers), `ReportQueue`
(task updates), the periodic events, `Backoff`. This module only wires them together.

Refusals that retrying cannot fix — a bad token, another site's name, an inventory the
control plane rejects — stop the agent with the control plane's message (`AgentRefused`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import grpc
from grpc import aio

from agents.backoff import Backoff
from agents.config import AgentConfig
from agents.control import ControlLink, SessionEnded
from agents.discovery.gpus import sample_usage
from agents.events import HealthEvent, HealthState, HeartbeatEvent, Peers, ProbeEvent, run_events
from agents.hardware import Hardware
from agents.launches import LaunchManager
from agents.links import LinkBook
from agents.logs import Outbox
from agents.probe import ProbeServer
from agents.reports import ReportQueue
from agents.tasks import TaskUpdate
from proto.cpn.v1 import agent_pb2 as pb

log = logging.getLogger("cpn.agent")

REFUSALS = {
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class AgentError(Exception):
    """The agent cannot run; the message says why (the CLI prints it as one line)."""


class AgentRefused(AgentError):
    """The control plane refused this agent for a reason retrying cannot fix."""


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
        self.hardware = Hardware(config)
        self.health = HealthState()
        self.links = LinkBook()
        self.control = ControlLink(config)
        self.probe = ProbeServer(config.probe_host, config.probe_port)
        self.probe_address = ""
        self.inventory: pb.Inventory | None = None
        outbox = Outbox()
        self.reports = ReportQueue(outbox)
        self.launches = LaunchManager(
            site=config.site,
            node=config.node_name,
            work_dir=config.work_dir,
            report=self.reports.put,
            outbox=outbox,
            worker_command=config.worker_command,
            stop_grace_s=config.stop_grace_s,
        )

    # ------------------------------------------------------------------ main loop

    async def run(self) -> None:
        if self.config.tls_ca is not None:
            try:
                self.control.tls_roots = self.config.tls_ca.read_bytes()
            except OSError as exc:
                raise AgentError(
                    f"--tls-ca: {self.config.tls_ca}: cannot read ({exc.strerror})"
                ) from None
        self.inventory = await asyncio.to_thread(self.hardware.discover)
        self.launches.real_gpus = self.hardware.real_gpus
        try:
            port = await self.probe.start()
        except OSError as exc:
            where = f"{self.config.probe_host}:{self.config.probe_port}"
            raise AgentError(f"--probe-port: cannot listen on {where} ({exc.strerror})") from None
        host = self.config.advertise_host or route_address(self.config.control)
        self.probe_address = f"{host}:{port}"
        self.launches.advertise_host = host
        log.info("WAN probe endpoint on %s", self.probe_address)
        backoff = Backoff(max_s=self.config.max_backoff_s)
        try:
            while True:
                self.control.connect()
                try:
                    await self._connect()
                    backoff.reset()
                    await self._session()
                except aio.AioRpcError as exc:
                    await self._after_rpc_error(exc, backoff)
                except SessionEnded as exc:
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
                    await self.control.close()
        finally:
            await self.launches.stop_all()
            await self.probe.stop()

    async def _after_rpc_error(self, exc: aio.AioRpcError, backoff: Backoff) -> None:
        if exc.code() in REFUSALS:
            raise AgentRefused(
                f"control plane {self.config.control} refused the agent: "
                f"{exc.code().name}: {exc.details()}"
            ) from None
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            log.info("control plane does not know our lease (%s)", exc.details())
            self.control.lease_id = None
            return
        delay = backoff.next()
        log.warning(
            "control plane %s: %s (%s); retrying in %.1f s",
            self.config.control,
            exc.code().name,
            exc.details(),
            delay,
        )
        await asyncio.sleep(delay)

    async def _connect(self) -> None:
        if self.control.lease_id is not None:
            try:
                await self.heartbeat(unary=True)
                log.info("reconnected with lease %s", self.control.lease_id)
                return
            except aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                self.control.lease_id = None
        assert self.inventory is not None
        await self.control.register(self.inventory, self.probe_address)

    async def _session(self) -> None:
        events = [
            HeartbeatEvent(self.heartbeat, lambda: self.control.heartbeat_interval_s),
            ProbeEvent(
                self.config.site,
                Peers(lambda: self.control.peers, self.control.peers_changed),
                self.links,
                self.config.probe_interval_s,
                self.config.probe_bytes,
            ),
            HealthEvent(self.hardware.check_health, self.health),
        ]
        tasks = [
            asyncio.create_task(run_events(events)),
            asyncio.create_task(self._watch()),
            asyncio.create_task(self.reports.deliver(self._request, self.control.report)),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            raise SessionEnded("session ended")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.control.close_stream()

    # ------------------------------------------------------------------ session work

    async def heartbeat(self, *, unary: bool = False) -> None:
        """Renew the lease. A heartbeat the control plane refuses as invalid (a WAN
        measurement from a clock far off, usage of a GPU added since registration) is sent
        again at once without those parts: the lease must not lapse over them."""
        links = self.links.pending()
        usage = await self._usage()
        try:
            await self.control.heartbeat(self.health.health, usage, links, unary=unary)
        except aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            log.warning("heartbeat refused (%s); sent again without usage and links", exc.details())
            self.control.close_stream()  # the refusal ended the stream
            await self.control.heartbeat(self.health.health, [], [], unary=unary)
        self.links.delivered(links)

    async def _usage(self) -> list[pb.GpuUsage]:
        node = self.config.node_name
        samples = await asyncio.to_thread(sample_usage, self.hardware.gpus.source)
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
        busy = self.launches.busy_gpus()
        return [
            pb.GpuUsage(
                node=node, index=g.index, utilisation=1.0 if (node, g.index) in busy else 0.0
            )
            for g in self.hardware.gpus.gpus
        ]

    def _request(self, update: TaskUpdate) -> pb.ReportTaskStatusRequest:
        return update.request(self.config.site, self.config.agent_id, self.control.lease)

    async def _watch(self) -> None:
        stops: set[asyncio.Task[int]] = set()
        async for assignment in self.control.assignments():
            which = assignment.WhichOneof("order")
            if which == "launch":
                order = assignment.launch
                log.info("order %s: launch job %s", assignment.order_id, order.job_id)
                await self._launch(order)
            elif which == "stop":
                log.info("order %s: stop job %s", assignment.order_id, assignment.stop.job_id)
                task = asyncio.create_task(
                    self.launches.stop(assignment.stop.job_id, assignment.stop.reason)
                )
                stops.add(task)
                task.add_done_callback(stops.discard)
            else:
                log.warning("order %s of an unknown kind; ignored", assignment.order_id)

    async def _launch(self, order: pb.LaunchOrder) -> None:
        try:
            await self.launches.launch(order)
        except OSError as exc:  # the work directory cannot be written, say
            log.error("job %s: cannot launch: %s", order.job_id, exc)
            for r in order.ranks:
                if r.site == self.config.site and r.node == self.config.node_name:
                    self.reports.put(
                        TaskUpdate(
                            job_id=order.job_id,
                            rank=r.rank,
                            state=pb.TASK_STATE_FAILED,
                            exit_code=-1,
                            message=f"cannot launch: {exc}",
                        )
                    )


async def run_agent(config: AgentConfig) -> None:
    """Run until cancelled (SIGINT/SIGTERM in `cpn agent`)."""
    agent = Agent(config)
    started = time.monotonic()
    try:
        await agent.run()
    finally:
        log.info("agent stopped after %.0f s", time.monotonic() - started)


__all__ = ["Agent", "AgentError", "AgentRefused", "run_agent"]
