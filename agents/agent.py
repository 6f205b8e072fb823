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
import os
import socket
import time
from collections.abc import Collection

import grpc
from grpc import aio

from agents.backends import BackendError, Capacity, SiteBackend
from agents.backends.local import LocalBackend
from agents.backends.slurm import SlurmBackend
from agents.backoff import Backoff
from agents.config import AgentConfig, KubernetesSettings
from agents.control import ControlLink, SessionEnded
from agents.convert import node_message
from agents.discovery.gpus import DiscoveredGpu, sample_usage
from agents.events import (
    HealthEvent,
    HealthState,
    HeartbeatEvent,
    Peers,
    ProbeEvent,
    cancel_all,
    run_events,
)
from agents.hardware import Hardware
from agents.launches import LaunchManager
from agents.links import LinkBook
from agents.logs import Outbox
from agents.probe import ProbeServer
from agents.reports import ReportQueue
from agents.tasks import TaskUpdate
from proto.cpn.v1 import agent_pb2 as pb

log = logging.getLogger("cpn.agent")

#: How often the agent checks whether it must fence its workers.
FENCE_CHECK_S = 0.5
#: How often a site engine's agent compares what the engine offers with what it registered.
CAPACITY_CHECK_S = 5.0
#: What a fenced agent's stopped ranks say: the control plane reads the prefix as a loss
#: of infrastructure (`cpn.orchestration.lifecycle.FENCED`; the protocol has no field).
FENCED_REASON = "fenced: no contact with the control plane for {silent:.0f} s"
#: Tries at reading the engine's capacity, a second apart, before a refresh gives up
#: (after a launch ended, the next periodic check is the next chance).
CAPACITY_TRIES = 3

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


def make_backend(config: AgentConfig, gpus: Hardware) -> SiteBackend:
    """The site engine `config.backend` names, with its options."""
    if config.backend == "local":
        return LocalBackend(config.node_name, lambda: len(gpus.gpus.gpus))
    if config.backend == "slurm":
        if config.slurm is None:
            raise AgentError("--backend slurm needs --slurm-partition")
        return SlurmBackend(config.slurm, config.agent_id)
    if config.backend == "kubernetes":
        if config.kubernetes is None:
            raise AgentError("--backend kubernetes needs --k8s-namespace and --k8s-image")
        return _kubernetes(config, config.kubernetes)
    raise AgentError(f"--backend: {config.backend!r} is not one of local, slurm, kubernetes")


def _kubernetes(config: AgentConfig, k8s: KubernetesSettings) -> SiteBackend:
    """The client configured as kubectl would be: in-cluster (a service account), else
    $KUBECONFIG / ~/.kube/config."""
    try:
        from kubernetes import client  # noqa: PLC0415
        from kubernetes import config as kube_config  # noqa: PLC0415
        from kubernetes.config.config_exception import ConfigException  # noqa: PLC0415
    except ModuleNotFoundError:  # an optional extra: a plain `pip install cpn` lacks it
        raise AgentError(
            "--backend kubernetes: the kubernetes package is not installed "
            "(pip install 'cpn[kubernetes]')"
        ) from None

    from agents.backends.kubernetes import KubernetesBackend, KubernetesOptions  # noqa: PLC0415

    configuration = client.Configuration()
    try:
        kube_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except ConfigException:
        try:
            kube_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
            )
        except (ConfigException, OSError) as exc:
            raise AgentError(
                f"kubernetes: no in-cluster or kubeconfig credentials ({exc})"
            ) from None
    options = KubernetesOptions(
        k8s.namespace, k8s.image, k8s.service_account, k8s.work_claim, str(config.work_dir)
    )
    return KubernetesBackend(options, config.agent_id, client.ApiClient(configuration))


def site_inventory(
    capacity: Capacity,
    config: AgentConfig,
    backend: SiteBackend,
    held: Collection[tuple[str, int]] = (),
) -> pb.Inventory:
    """A site engine's nodes as the registry's inventory: each usable node's GPUs as the
    engine counts them, described by the virtual-GPU flags (model from Slurm's GRES type
    when it names one).

    A node the engine no longer offers (down, drained, not responding) still lists the
    GPUs that a started launch of this agent runs on (`held`: (node, GPU) pairs), up to
    the highest of them, until the launch ends (a capacity check then drops the node):
    the launch's fate is the engine's word. Slurm lets running jobs finish on a draining
    node, and fails them itself (NODE_FAIL) when a node that stopped answering is
    declared down; dropping the node at once planned the job again on a ping that a
    loaded node missed for a moment."""
    nodes = []
    for n in capacity.nodes:
        if n.usable:
            count = n.gpus
        else:
            # GPUs 0..the highest held: the protocol numbers a node's GPUs from 0, so one
            # held GPU 5 registers 0-5 (those not held stay offered, a window that lasts
            # until the launch ends; a job placed there waits for the node, or the engine
            # refuses it and it is planned again).
            count = 1 + max((gpu for node, gpu in held if node == n.name), default=-1)
        if count == 0:
            continue
        indices = range(count)
        kind = backend.gpu_type(n.name) if isinstance(backend, SlurmBackend) else ""
        gpus = [
            DiscoveredGpu(
                index=i,
                model=kind or config.virtual.model,
                memory_gb=config.virtual.memory_gb,
                uuid=f"{config.site}-{n.name}-gpu{i}",
                source="virtual",
                tflops=config.virtual.tflops,
            )
            for i in indices
        ]
        nodes.append(node_message(n.name, gpus, [], config.intra_node_gbps))
    return pb.Inventory(nodes=nodes)


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
        self._registering = asyncio.Lock()
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
            backend=make_backend(config, self.hardware),
            time_limit_s=config.time_limit_s,
            on_node_lost=self.refresh_capacity,
            links=self.links.latest,
        )
        self.links.on_record = self.launches.publish_links

    # ------------------------------------------------------------------ main loop

    async def run(self) -> None:
        if self.config.tls_ca is not None:
            try:
                self.control.tls_roots = self.config.tls_ca.read_bytes()
            except OSError as exc:
                raise AgentError(
                    f"--tls-ca: {self.config.tls_ca}: cannot read ({exc.strerror})"
                ) from None
        engine = self.launches.engine
        capacity = None
        if engine.site_wide:
            try:
                await engine.check()
                capacity = await engine.capacity()
            except BackendError as exc:
                raise AgentError(str(exc)) from None
            log.info(
                "%s: %d nodes, %d GPUs usable",
                engine.name,
                sum(1 for n in capacity.nodes if n.usable and n.gpus),
                capacity.gpus,
            )
        else:
            self.inventory = await asyncio.to_thread(self.hardware.discover)
            self.launches.real_gpus = self.hardware.real_gpus
        try:
            port = await self.probe.start()
        except OSError as exc:
            where = f"{self.config.probe_host}:{self.config.probe_port}"
            raise AgentError(f"--probe-port: cannot listen on {where} ({exc.strerror})") from None
        host = self.config.advertise_host or route_address(self.control.target)
        self.probe_address = f"{host}:{port}"
        self.launches.advertise_host = host
        log.info("WAN probe endpoint on %s", self.probe_address)
        try:
            await self.launches.adopt()
        except BackendError as exc:
            raise AgentError(f"cannot look for running launches: {exc}") from None
        if capacity is not None:  # after adopting: the nodes its launches hold stay
            self.inventory = site_inventory(
                capacity, self.config, engine, self.launches.started_gpus()
            )
        backoff = Backoff(max_s=self.config.max_backoff_s)
        fence = asyncio.create_task(self._fence(), name="cpn-fence")
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
                    self.control.fail_over()
                    await asyncio.sleep(min(backoff.next(), 1.0))
                except TimeoutError:
                    delay = backoff.next()
                    log.warning(
                        "control plane %s did not answer in time; retrying in %.1f s",
                        self.control.target,
                        delay,
                    )
                    self.control.fail_over()
                    await asyncio.sleep(delay)
                finally:
                    await self.control.close()
        finally:
            fence.cancel()
            await self.launches.stop_all()
            await self.probe.stop()

    async def _fence(self) -> None:
        """Fencing: once our lease cannot have been renewed for a whole TTL, the control
        plane has declared us lost and planned our jobs elsewhere (a newer epoch): every
        worker here is stopped, so that a site cut off from the control plane does not
        train on — nor write checkpoints — beside the epoch that replaced it. Checked
        right after a SIGSTOP/SIGCONT too (the clock is monotonic)."""
        while True:
            await asyncio.sleep(FENCE_CHECK_S)
            renewed = self.control.last_renewal
            if renewed is None or not self.launches.any_running():
                continue
            silent = time.monotonic() - renewed
            if silent > self.control.lease_ttl_s:
                log.warning(
                    "fenced: no lease renewal for %.1f s (TTL %.1f s); stopping every worker",
                    silent,
                    self.control.lease_ttl_s,
                )
                await self.launches.stop_all(FENCED_REASON.format(silent=silent), fence=True)

    async def _after_rpc_error(self, exc: aio.AioRpcError, backoff: Backoff) -> None:
        if exc.code() in REFUSALS:
            raise AgentRefused(
                f"control plane {self.control.target} refused the agent: "
                f"{exc.code().name}: {exc.details()}"
            ) from None
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            log.info("control plane does not know our lease (%s)", exc.details())
            self.control.lease_id = None
            return
        delay = backoff.next()
        log.warning(
            "control plane %s: %s (%s); retrying in %.1f s",
            self.control.target,
            exc.code().name,
            exc.details(),
            delay,
        )
        self.control.fail_over()
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
        # Orders come only once connected: the list is complete, nothing starts meanwhile.
        async with self._registering:
            await self.control.register(
                self.inventory, self.probe_address, self.launches.followed()
            )

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
            HealthEvent(self._check_health, self.health),
        ]
        tasks = [
            asyncio.create_task(run_events(events), name="events"),
            asyncio.create_task(self._watch(), name="orders"),
            asyncio.create_task(
                self.reports.deliver(self._request, self.control.report), name="reports"
            ),
        ]
        if self.launches.engine.site_wide:
            tasks.append(asyncio.create_task(self._watch_capacity(), name="capacity"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            raise SessionEnded("session ended")
        finally:
            await cancel_all(tasks)
            self.control.close_stream()

    # ------------------------------------------------------------------ session work

    async def refresh_capacity(self) -> None:
        """A site engine's nodes as it offers them now; when that changed (a node down,
        drained, or back), the agent registers again with them, so that the registry's
        GPUs are what the engine offers: GPUs of a node gone while a job holds them are
        marked lost (the job is planned again), a node back is offered again."""
        engine = self.launches.engine
        if not engine.site_wide or self.inventory is None:
            return
        capacity = await self._capacity()  # outside the lock: it may take a while
        if capacity is None:
            return
        # One registration at a time, each with the inventory it sets: a refresh while
        # the connection's registration is in flight (lease not known yet) would set an
        # inventory that no registration carried, and none would carry it later.
        async with self._registering:
            inventory = site_inventory(capacity, self.config, engine, self.launches.started_gpus())
            if inventory != self.inventory:
                await self._register_again(inventory)

    async def _capacity(self) -> Capacity | None:
        for attempt in range(CAPACITY_TRIES):
            try:
                return await self.launches.engine.capacity()
            except BackendError as exc:
                log.warning("site capacity unknown: %s", exc)
            if attempt < CAPACITY_TRIES - 1:
                await asyncio.sleep(1.0)
        return None

    async def _register_again(self, inventory: pb.Inventory) -> None:
        assert self.inventory is not None
        before = {n.name for n in self.inventory.nodes}
        after = {n.name for n in inventory.nodes}
        log.warning(
            "%s now offers %d nodes (gone: %s; back: %s); registering again",
            self.launches.engine.name,
            len(after),
            ", ".join(sorted(before - after)) or "none",
            ", ".join(sorted(after - before)) or "none",
        )
        if self.control.lease_id is not None:  # else the next connection registers it
            await self.control.register(inventory, self.probe_address)
        self.inventory = inventory  # only once registered: a failed try is tried again

    async def _watch_capacity(self) -> None:
        """Every health interval, for a site engine: its capacity, registered again when
        it changed (a task of the session: it never returns)."""
        while True:
            await asyncio.sleep(CAPACITY_CHECK_S)
            await self.refresh_capacity()

    def _check_health(self) -> tuple[pb.Health.ValueType, str]:
        """This node's hardware; for a Slurm site, the registered nodes as Slurm sees them
        now (a node down or drained offers no GPUs: DEGRADED, naming it)."""
        engine = self.launches.engine
        if isinstance(engine, SlurmBackend) and self.inventory is not None:
            worst, lost = engine.node_health({n.name for n in self.inventory.nodes})
            health = {"ok": pb.HEALTH_OK, "degraded": pb.HEALTH_DEGRADED}.get(
                worst, pb.HEALTH_FAILING
            )
            return health, ("slurm nodes without GPUs now: " + ", ".join(lost)) if lost else ""
        return self.hardware.check_health()

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
        if self.launches.engine.site_wide:
            busy = self.launches.busy_gpus()
            assert self.inventory is not None
            return [
                pb.GpuUsage(
                    node=n.name,
                    index=g.index,
                    utilisation=1.0 if (n.name, g.index) in busy else 0.0,
                )
                for n in self.inventory.nodes
                for g in n.gpus
            ]
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
                stop = assignment.stop
                task = asyncio.create_task(self.launches.stop(stop.job_id, stop.reason, stop.epoch))
                stops.add(task)
                task.add_done_callback(stops.discard)
            else:
                log.warning("order %s of an unknown kind; ignored", assignment.order_id)

    async def _launch(self, order: pb.LaunchOrder) -> None:
        try:
            await self.launches.launch(order)
        except OSError as exc:  # the work directory cannot be written, say
            log.error("job %s: cannot launch: %s", order.job_id, exc)
            for r in self.launches.mine(order):
                self.reports.put(
                    TaskUpdate(
                        job_id=order.job_id,
                        rank=r.rank,
                        state=pb.TASK_STATE_FAILED,
                        exit_code=-1,
                        message=f"cannot launch: {exc}",
                        epoch=order.epoch,
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
