"""Checking what agents send, field by field, before anything is stored.

Every failure names the field the way the .proto spells it, with indices
(`inventory.nodes[2].rdma_nics[0].transport: unknown transport 9`), and becomes
INVALID_ARGUMENT. A request that fails here has written nothing.
"""

from __future__ import annotations

import math
import re

from cpn.control import convert
from cpn.control.errors import InvalidField
from cpn.registry.inventory import AgentRegistration, GpuInfo, NicInfo, NodeInfo
from cpn.registry.models import TaskState
from proto.cpn.v1 import agent_pb2 as pb

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
AGENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@:\-]*$")
MAX_GPUS_PER_NODE = 1024
MAX_NODES = 10_000
MAX_NICS_PER_NODE = 64


def _name(value: str, field: str, pattern: re.Pattern[str] = NAME, max_len: int = 64) -> None:
    if not value:
        raise InvalidField(field, "required")
    if len(value) > max_len:
        raise InvalidField(field, f"at most {max_len} characters, got {len(value)}")
    if not pattern.match(value):
        raise InvalidField(field, f"{value!r}: use letters, digits and _ . - (start alphanumeric)")


def _number(
    value: float, field: str, *, positive: bool = False, upper: float | None = None
) -> None:
    if not math.isfinite(value):
        raise InvalidField(field, f"must be a finite number, got {value}")
    if positive and value <= 0:
        raise InvalidField(field, f"must be > 0, got {value:g}")
    if value < 0:
        raise InvalidField(field, f"must be ≥ 0, got {value:g}")
    if upper is not None and value > upper:
        raise InvalidField(field, f"must be ≤ {upper:g}, got {value:g}")


def identity(site: str, agent_id: str) -> None:
    _name(site, "site")
    _name(agent_id, "agent_id", AGENT_ID, 128)


def lease(site: str, agent_id: str, lease_id: str) -> None:
    identity(site, agent_id)
    if not lease_id:
        raise InvalidField("lease_id", "required (from the Register response)")


def probe_address(value: str) -> None:
    if not value:
        return
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidField("probe_address", f"{value!r}: expected host:port")


def register_request(req: pb.RegisterRequest) -> AgentRegistration:
    identity(req.site, req.agent_id)
    if len(req.version) > 64:
        raise InvalidField("version", "at most 64 characters")
    probe_address(req.probe_address)
    if not req.HasField("inventory"):
        raise InvalidField("inventory", "required")
    nodes = req.inventory.nodes
    if not nodes:
        raise InvalidField("inventory.nodes", "at least one node")
    if len(nodes) > MAX_NODES:
        raise InvalidField("inventory.nodes", f"at most {MAX_NODES} nodes, got {len(nodes)}")
    seen: dict[str, int] = {}
    out = []
    for i, node in enumerate(nodes):
        where = f"inventory.nodes[{i}]"
        _name(node.name, f"{where}.name")
        if node.name in seen:
            raise InvalidField(
                f"{where}.name", f"duplicate node {node.name!r} (also nodes[{seen[node.name]}])"
            )
        seen[node.name] = i
        out.append(_node(node, where))
    return AgentRegistration(
        site=req.site,
        agent_id=req.agent_id,
        version=req.version,
        probe_address=req.probe_address,
        nodes=tuple(out),
    )


def _node(node: pb.Node, where: str) -> NodeInfo:
    if node.gpu_count < 0:
        raise InvalidField(f"{where}.gpu_count", f"must be ≥ 0, got {node.gpu_count}")
    if node.gpu_count > MAX_GPUS_PER_NODE:
        raise InvalidField(
            f"{where}.gpu_count", f"at most {MAX_GPUS_PER_NODE}, got {node.gpu_count}"
        )
    if len(node.gpus) != node.gpu_count:
        raise InvalidField(
            f"{where}.gpus", f"describes {len(node.gpus)} GPUs, gpu_count says {node.gpu_count}"
        )
    _number(node.intra_node_gbps, f"{where}.intra_node_gbps")
    gpus = []
    indices: set[int] = set()
    for j, gpu in enumerate(node.gpus):
        at = f"{where}.gpus[{j}]"
        if gpu.index >= node.gpu_count:
            raise InvalidField(f"{at}.index", f"{gpu.index} out of range 0..{node.gpu_count - 1}")
        if gpu.index in indices:
            raise InvalidField(f"{at}.index", f"duplicate GPU index {gpu.index}")
        indices.add(gpu.index)
        if not gpu.model or len(gpu.model) > 64:
            raise InvalidField(f"{at}.model", "required, at most 64 characters")
        _number(gpu.memory_gb, f"{at}.memory_gb", positive=True, upper=1e5)
        _number(gpu.tflops, f"{at}.tflops", upper=1e6)
        if len(gpu.uuid) > 64:
            raise InvalidField(f"{at}.uuid", "at most 64 characters")
        gpus.append(
            GpuInfo(
                index=gpu.index,
                model=gpu.model,
                memory_gb=gpu.memory_gb,
                tflops=gpu.tflops,
                uuid=gpu.uuid,
                source=convert.gpu_source(gpu.source, f"{at}.source"),
            )
        )
    if len(node.rdma_nics) > MAX_NICS_PER_NODE:
        raise InvalidField(f"{where}.rdma_nics", f"at most {MAX_NICS_PER_NODE} ports")
    nics = []
    ports: set[tuple[str, int]] = set()
    for k, nic in enumerate(node.rdma_nics):
        at = f"{where}.rdma_nics[{k}]"
        if not nic.device or len(nic.device) > 64:
            raise InvalidField(f"{at}.device", "required, at most 64 characters")
        if nic.port < 1:
            raise InvalidField(f"{at}.port", f"ports count from 1, got {nic.port}")
        if (nic.device, nic.port) in ports:
            raise InvalidField(f"{at}.port", f"duplicate port {nic.device} {nic.port}")
        ports.add((nic.device, nic.port))
        transport = convert.rdma_transport(nic.transport, f"{at}.transport")
        if transport == "roce":
            if nic.roce_version not in (1, 2):
                raise InvalidField(f"{at}.roce_version", f"must be 1 or 2, got {nic.roce_version}")
        elif nic.roce_version != 0:
            raise InvalidField(f"{at}.roce_version", f"only for RoCE ports, got {nic.roce_version}")
        _number(nic.rate_gbps, f"{at}.rate_gbps", upper=1e5)
        nics.append(
            NicInfo(
                device=nic.device,
                port=nic.port,
                transport=transport,
                rate_gbps=nic.rate_gbps,
                state=convert.port_state(nic.state, f"{at}.state"),
                roce_version=nic.roce_version,
            )
        )
    return NodeInfo(
        name=node.name,
        gpus=tuple(sorted(gpus, key=lambda g: g.index)),
        nics=tuple(nics),
        intra_node_gbps=node.intra_node_gbps or None,
    )


def heartbeat_request(req: pb.HeartbeatRequest) -> str:
    """Check a heartbeat; returns its health as the registry spells it."""
    lease(req.site, req.agent_id, req.lease_id)
    health = convert.health(req.health, "health")
    for i, usage in enumerate(req.gpus):
        # Fast path first (NaN fails every comparison): this runs for every GPU of every
        # heartbeat; the precise message is worked out only for a bad value.
        if not (0.0 <= usage.utilisation <= 1.0 and 0.0 <= usage.memory_used_gb <= 1e5):
            _number(usage.utilisation, f"gpus[{i}].utilisation", upper=1.0)
            _number(usage.memory_used_gb, f"gpus[{i}].memory_used_gb", upper=1e5)
    for i, link in enumerate(req.links):
        _name(link.peer_site, f"links[{i}].peer_site")
        if link.peer_site == req.site:
            raise InvalidField(f"links[{i}].peer_site", "a link joins two different sites")
        _number(link.bandwidth_gbps, f"links[{i}].bandwidth_gbps", upper=1e6)
        _number(link.rtt_ms, f"links[{i}].rtt_ms", upper=1e6)
    return health


def task_status_request(req: pb.ReportTaskStatusRequest) -> TaskState:
    lease(req.site, req.agent_id, req.lease_id)
    if not req.job_id or len(req.job_id) > 64:
        raise InvalidField("job_id", "required, at most 64 characters")
    state = convert.task_state(req.state, "state")
    # A non-finite loss is allowed: a diverged run reporting inf/nan is news, not garbage.
    if len(req.checkpoint_id) > 256:
        raise InvalidField("checkpoint_id", "at most 256 characters")
    if len(req.message) > 4096:
        raise InvalidField("message", "at most 4096 characters")
    return state
