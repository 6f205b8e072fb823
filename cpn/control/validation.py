"""Checking what agents send, field by field, before anything is stored.

Every failure names the field the way the .proto spells it, with indices
(`inventory.nodes[2].rdma_nics[0].transport: unknown transport 9`), says the rule, quotes
at most a short prefix of the value (`cpn.control.errors.quote`), and becomes
INVALID_ARGUMENT. A request that fails here has written nothing.

The rules (bounds in `cpn.contracts.limits`, shared with the contract files and the REST
API) make every value that passes storable on SQLite and PostgreSQL alike and usable by
the scheduler:

- integers fit the column they go to: 32-bit for indices, ports and ranks, 64-bit for
  steps and byte counters (protobuf's uint32/uint64 go beyond both);
- floats are finite and within physical ceilings; a loss may be inf or NaN (a diverged
  run reporting it is news, not garbage);
- timestamps are not negative, not in the future beyond `MAX_CLOCK_SKEW`, not older than
  `MAX_MEASUREMENT_AGE`, so they are valid `datetime`s too;
- names are ASCII from a small alphabet, labels printable on one line, messages printable
  text: never NUL (PostgreSQL refuses it, SQLite would store it), never escape sequences;
- references must exist: GPU usage for a GPU the agent registered, a link to a site the
  control plane knows (has a token for), a task status for a job this agent was ordered
  to run (checked in the database, see `cpn.control.references`).
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cpn.contracts.limits import (
    ADDRESS_MAX,
    CHECKPOINT_ID_MAX,
    INT32_MAX,
    INT64_MAX,
    JOB_ID_MAX,
    LABEL_MAX,
    LEASE_ID_MAX,
    MAX_GBPS,
    MAX_GPU_MEMORY_GB,
    MAX_GPUS_PER_NODE,
    MAX_LAUNCHES_PER_AGENT,
    MAX_MILLISECONDS,
    MAX_NICS_PER_NODE,
    MAX_NODES_PER_AGENT,
    MAX_RDMA_PORT,
    MAX_TFLOPS,
    MESSAGE_MAX,
    MIN_GBPS,
    MIN_GPU_MEMORY_GB,
    MIN_TFLOPS,
    is_agent_id,
    is_label,
    is_name,
    is_text,
)
from cpn.control import convert
from cpn.control.errors import InvalidField, quote
from cpn.registry.inventory import AgentRegistration, GpuInfo, NicInfo, NodeInfo
from cpn.registry.leases import LinkSample
from cpn.registry.models import TaskState, utcnow
from proto.cpn.v1 import agent_pb2 as pb

#: How far ahead of the control plane's clock an agent's timestamp may be (Kerberos'
#: default tolerance): hosts are NTP-synchronised, but not perfectly.
MAX_CLOCK_SKEW = timedelta(minutes=5)
#: A WAN measurement older than this describes a network that may no longer exist.
MAX_MEASUREMENT_AGE = timedelta(days=1)

_PORT = re.compile(r"[0-9]{1,5}")
_HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*\.?")


# ---------------------------------------------------------------------------- primitives


def _name(value: str, field: str) -> None:
    if not value:
        raise InvalidField(field, "required")
    if not is_name(value):
        raise InvalidField(
            field,
            f"{quote(value)}: use at most 64 letters, digits and _ . - (start alphanumeric)",
        )


def _label(value: str, field: str, *, required: bool = False, max_len: int = LABEL_MAX) -> None:
    if not value:
        if required:
            raise InvalidField(field, "required")
        return
    if len(value) > max_len:
        raise InvalidField(field, f"at most {max_len} characters, got {len(value)}")
    if not is_label(value):
        raise InvalidField(
            field, f"{quote(value)}: must be printable on one line (no control characters)"
        )


def _number(
    value: float,
    field: str,
    *,
    positive: bool = False,
    upper: float | None = None,
    lower: float | None = None,
    zero_means: str | None = None,
) -> None:
    """A finite number ≥ 0 (> 0 if `positive`) within [lower, upper]; where `zero_means`
    names what 0 stands for (unknown, link down), 0 is allowed below `lower`."""
    if not math.isfinite(value):
        raise InvalidField(field, f"must be a finite number, got {value}")
    if positive and value <= 0:
        raise InvalidField(field, f"must be > 0, got {value:g}")
    if value < 0:
        raise InvalidField(field, f"must be ≥ 0, got {value:g}")
    if lower is not None and value < lower and not (value == 0 and zero_means is not None):
        either = f"0 ({zero_means}) or " if zero_means is not None else ""
        raise InvalidField(field, f"must be {either}≥ {lower:g}, got {value:g}")
    if upper is not None and value > upper:
        raise InvalidField(field, f"must be ≤ {upper:g}, got {value:g}")


def _integer(value: int, field: str, upper: int) -> None:
    if value > upper:
        raise InvalidField(field, f"must be ≤ {upper}, got {value}")


def timestamp_ms(value: int, field: str, now: datetime) -> datetime:
    """An agent's unix-milliseconds timestamp as a UTC datetime (0 means now)."""
    if value == 0:
        return now
    if value < 0:
        raise InvalidField(field, f"must be ≥ 0 (unix milliseconds; 0 for now), got {value}")
    now_ms = now.timestamp() * 1000
    if value > now_ms + MAX_CLOCK_SKEW.total_seconds() * 1000:
        raise InvalidField(
            field,
            f"{value} is in the future (more than {MAX_CLOCK_SKEW.seconds // 60} min ahead "
            "of the control plane's clock)",
        )
    if value < now_ms - MAX_MEASUREMENT_AGE.total_seconds() * 1000:
        raise InvalidField(field, f"{value} is more than {MAX_MEASUREMENT_AGE.days} day old")
    return datetime.fromtimestamp(value / 1000, UTC)


# ---------------------------------------------------------------------------- identity


def identity(site: str, agent_id: str) -> None:
    _name(site, "site")
    if not agent_id:
        raise InvalidField("agent_id", "required")
    if not is_agent_id(agent_id):
        raise InvalidField(
            "agent_id",
            f"{quote(agent_id)}: use at most 128 letters, digits and _ . - @ : "
            "(start alphanumeric)",
        )


def lease(site: str, agent_id: str, lease_id: str) -> None:
    identity(site, agent_id)
    if not lease_id:
        raise InvalidField("lease_id", "required (from the Register response)")
    _label(lease_id, "lease_id", max_len=LEASE_ID_MAX)


def is_host_port(value: str) -> bool:
    """`host:port` with port 1–65535 and host an IPv4 address, a bracketed IPv6 address
    (no zone id: it means nothing to another host) or a DNS name. The one check of an
    address cpn dials or tells others to dial (a probe address, `cpn agent --control`)."""
    if len(value) > ADDRESS_MAX or not value.isascii() or not value.isprintable():
        return False
    host, sep, port = value.rpartition(":")
    if not sep or not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
        return False
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return "%" not in host
    return bool(_HOSTNAME.fullmatch(host))


def probe_address(value: str) -> None:
    """`host:port` (`is_host_port`); empty is fine.

    Other agents are told this address and connect to it, so it must be an address and
    nothing else."""
    if value and not is_host_port(value):
        raise InvalidField("probe_address", f"{quote(value)}: expected host:port")


# ---------------------------------------------------------------------------- register


def register_request(req: pb.RegisterRequest) -> AgentRegistration:
    identity(req.site, req.agent_id)
    _label(req.version, "version")
    probe_address(req.probe_address)
    if not req.HasField("inventory"):
        raise InvalidField("inventory", "required")
    nodes = req.inventory.nodes
    if not nodes:
        raise InvalidField("inventory.nodes", "at least one node")
    if len(nodes) > MAX_NODES_PER_AGENT:
        raise InvalidField(
            "inventory.nodes", f"at most {MAX_NODES_PER_AGENT} nodes, got {len(nodes)}"
        )
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
        launches=_launches(req) if req.launches_listed else None,
    )


def _launches(req: pb.RegisterRequest) -> frozenset[tuple[str, int]]:
    if len(req.launches) > MAX_LAUNCHES_PER_AGENT:
        raise InvalidField(
            "launches", f"at most {MAX_LAUNCHES_PER_AGENT} launches, got {len(req.launches)}"
        )
    for i, launch in enumerate(req.launches):
        _label(launch.job_id, f"launches[{i}].job_id", required=True, max_len=JOB_ID_MAX)
        _integer(launch.epoch, f"launches[{i}].epoch", INT64_MAX)
    return frozenset((launch.job_id, launch.epoch) for launch in req.launches)


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
    _number(
        node.intra_node_gbps,
        f"{where}.intra_node_gbps",
        lower=MIN_GBPS,
        upper=MAX_GBPS,
        zero_means="unknown",
    )
    gpus = []
    indices: set[int] = set()
    for j, gpu in enumerate(node.gpus):
        at = f"{where}.gpus[{j}]"
        if gpu.index >= node.gpu_count:
            raise InvalidField(f"{at}.index", f"{gpu.index} out of range 0..{node.gpu_count - 1}")
        if gpu.index in indices:
            raise InvalidField(f"{at}.index", f"duplicate GPU index {gpu.index}")
        indices.add(gpu.index)
        _label(gpu.model, f"{at}.model", required=True)
        _number(gpu.memory_gb, f"{at}.memory_gb", lower=MIN_GPU_MEMORY_GB, upper=MAX_GPU_MEMORY_GB)
        _number(
            gpu.tflops, f"{at}.tflops", lower=MIN_TFLOPS, upper=MAX_TFLOPS, zero_means="unknown"
        )
        _label(gpu.uuid, f"{at}.uuid")
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
        _label(nic.device, f"{at}.device", required=True)
        if not 1 <= nic.port <= MAX_RDMA_PORT:
            raise InvalidField(
                f"{at}.port", f"ports count from 1 to {MAX_RDMA_PORT}, got {nic.port}"
            )
        if (nic.device, nic.port) in ports:
            raise InvalidField(f"{at}.port", f"duplicate port {nic.device} {nic.port}")
        ports.add((nic.device, nic.port))
        transport = convert.rdma_transport(nic.transport, f"{at}.transport")
        if transport == "roce":
            if nic.roce_version not in (1, 2):
                raise InvalidField(f"{at}.roce_version", f"must be 1 or 2, got {nic.roce_version}")
        elif nic.roce_version != 0:
            raise InvalidField(f"{at}.roce_version", f"only for RoCE ports, got {nic.roce_version}")
        _number(
            nic.rate_gbps, f"{at}.rate_gbps", lower=MIN_GBPS, upper=MAX_GBPS, zero_means="unknown"
        )
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


# ---------------------------------------------------------------------------- heartbeat


@dataclass(frozen=True)
class Heartbeat:
    """A checked heartbeat: its health as the registry spells it, its WAN samples."""

    health: str
    links: list[LinkSample]


def heartbeat_request(
    req: pb.HeartbeatRequest, *, known_sites: Container[str], now: datetime | None = None
) -> Heartbeat:
    """Check a heartbeat on its own; `usage_references` checks its GPUs against the lease.

    `now` (default: the clock, read only if the heartbeat carries links) is what link
    timestamps are checked against."""
    lease(req.site, req.agent_id, req.lease_id)
    health = convert.health(req.health, "health")
    for i, usage in enumerate(req.gpus):
        # Fast path first (NaN fails every comparison): this runs for every GPU of every
        # heartbeat; the precise message is worked out only for a bad value.
        if not (0.0 <= usage.utilisation <= 1.0 and 0.0 <= usage.memory_used_gb <= 1e5):
            _number(usage.utilisation, f"gpus[{i}].utilisation", upper=1.0)
            _number(usage.memory_used_gb, f"gpus[{i}].memory_used_gb", upper=MAX_GPU_MEMORY_GB)
    links = []
    peers: dict[str, int] = {}
    if req.links and now is None:
        now = utcnow()
    for i, link in enumerate(req.links):
        where = f"links[{i}]"
        _name(link.peer_site, f"{where}.peer_site")
        if link.peer_site == req.site:
            raise InvalidField(f"{where}.peer_site", "a link joins two different sites")
        if link.peer_site not in known_sites:
            raise InvalidField(
                f"{where}.peer_site", f"unknown site {link.peer_site!r} (no token for it)"
            )
        if link.peer_site in peers:
            raise InvalidField(
                f"{where}.peer_site",
                f"second measurement to {link.peer_site!r} (also links[{peers[link.peer_site]}])",
            )
        peers[link.peer_site] = i
        _number(
            link.bandwidth_gbps,
            f"{where}.bandwidth_gbps",
            lower=MIN_GBPS,
            upper=MAX_GBPS,
            zero_means="link down",
        )
        _number(link.rtt_ms, f"{where}.rtt_ms", upper=MAX_MILLISECONDS)
        assert now is not None
        at = timestamp_ms(link.measured_at_unix_ms, f"{where}.measured_at_unix_ms", now)
        links.append(LinkSample(link.peer_site, link.bandwidth_gbps, link.rtt_ms, at))
    return Heartbeat(health, links)


def usage_references(
    usages: Iterable[pb.GpuUsage], registered: Mapping[tuple[str, int], object]
) -> None:
    """Every GPU usage is for a GPU the agent registered (its lease's), at most once."""
    seen: dict[tuple[str, int], int] = {}
    for i, usage in enumerate(usages):
        key = (usage.node, usage.index)
        if key not in registered:
            if not any(node == usage.node for node, _ in registered):
                raise InvalidField(
                    f"gpus[{i}].node", f"{quote(usage.node)}: not a node this agent registered"
                )
            raise InvalidField(
                f"gpus[{i}].index", f"node {usage.node!r} has no GPU {usage.index} registered"
            )
        if key in seen:
            raise InvalidField(
                f"gpus[{i}]",
                f"second usage of {usage.node!r} GPU {usage.index} (also gpus[{seen[key]}])",
            )
        seen[key] = i


# ---------------------------------------------------------------------------- task status


def task_status_request(req: pb.ReportTaskStatusRequest) -> TaskState:
    """Check a task status on its own; `cpn.control.references` checks that its job exists."""
    lease(req.site, req.agent_id, req.lease_id)
    _label(req.job_id, "job_id", required=True, max_len=JOB_ID_MAX)
    state = convert.task_state(req.state, "state")
    _integer(req.rank, "rank", INT32_MAX)
    _integer(req.step, "step", INT64_MAX)
    _integer(req.epoch, "epoch", INT64_MAX)
    for name in ("intra_node", "intra_site", "wan"):
        _integer(getattr(req.bytes, name), f"bytes.{name}", INT64_MAX)
    # A non-finite loss is allowed: a diverged run reporting inf/nan is news, not garbage.
    _label(req.checkpoint_id, "checkpoint_id", max_len=CHECKPOINT_ID_MAX)
    if len(req.message) > MESSAGE_MAX:
        raise InvalidField("message", f"at most {MESSAGE_MAX} characters, got {len(req.message)}")
    if not is_text(req.message):
        raise InvalidField(
            "message",
            f"{quote(req.message)}: must be printable text (tabs and line breaks allowed)",
        )
    return state
