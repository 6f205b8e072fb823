"""RDMA NIC ports from sysfs, as laid out in the kernel's ABI document
(Documentation/ABI/stable/sysfs-class-infiniband):

    /sys/class/infiniband/<device>/node_type              "1: CA", "4: RNIC", ...
    /sys/class/infiniband/<device>/ports/<N>/link_layer   "InfiniBand" | "Ethernet"
    /sys/class/infiniband/<device>/ports/<N>/rate         "100 Gb/sec (4X EDR)"
    /sys/class/infiniband/<device>/ports/<N>/state        "4: ACTIVE"
    /sys/class/infiniband/<device>/ports/<N>/gid_attrs/types/<index>
                                                          "IB/RoCE v1" | "RoCE v2"

Transport: node type 4 (RNIC) is iWARP whatever the link layer says; otherwise link layer
InfiniBand is InfiniBand and Ethernet is RoCE, version 2 if any GID of the port is of type
"RoCE v2", else 1 if any is "IB/RoCE v1". The sysfs root is a parameter so tests can point
it at fixture trees.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("cpn.agent")

DEFAULT_SYSFS_ROOT = Path("/sys")
RNIC_NODE_TYPE = 4
PORT_STATES = {1: "down", 2: "init", 3: "armed", 4: "active", 5: "active_defer"}
_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")
_NUMBERED = re.compile(r"^\s*([0-9]+)\s*:")


@dataclass(frozen=True)
class DiscoveredNic:
    device: str
    port: int
    transport: str  # infiniband | roce | iwarp
    roce_version: int  # 1 or 2 for RoCE, else 0
    rate_gbps: float
    state: str  # down | init | armed | active | active_defer


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # missing, or EINVAL (e.g. the type of an empty GID slot)
        return None


def parse_rate(text: str | None) -> float:
    """ "100 Gb/sec (4X EDR)" → 100.0; unreadable → 0."""
    match = _RATE.match(text or "")
    return float(match.group(1)) if match else 0.0


def parse_numbered(text: str | None) -> int | None:
    """ "4: ACTIVE" → 4."""
    match = _NUMBERED.match(text or "")
    return int(match.group(1)) if match else None


def parse_state(text: str | None) -> str:
    number = parse_numbered(text)
    if number in PORT_STATES:
        return PORT_STATES[number]
    word = (text or "").partition(":")[2].strip().lower() or (text or "").strip().lower()
    return word if word in PORT_STATES.values() else "down"


def roce_version(port_dir: Path) -> int:
    types_dir = port_dir / "gid_attrs" / "types"
    seen = set()
    if types_dir.is_dir():
        for entry in types_dir.iterdir():
            text = _read(entry)
            if text:
                seen.add(text.lower())
    if any("roce v2" in t for t in seen):
        return 2
    if any("roce v1" in t for t in seen):
        return 1
    # No readable GID type (old kernel): every current NIC defaults to RoCE v2.
    return 2


def discover_rdma(sysfs_root: Path = DEFAULT_SYSFS_ROOT) -> list[DiscoveredNic]:
    base = sysfs_root / "class" / "infiniband"
    if not base.is_dir():
        return []
    nics = []
    for device_dir in sorted(base.iterdir()):
        device = device_dir.name
        node_type = parse_numbered(_read(device_dir / "node_type"))
        ports_dir = device_dir / "ports"
        if not ports_dir.is_dir():
            continue
        for port_dir in sorted(ports_dir.iterdir(), key=lambda p: (len(p.name), p.name)):
            if not port_dir.name.isdigit():
                continue
            link_layer = (_read(port_dir / "link_layer") or "").lower()
            if node_type == RNIC_NODE_TYPE:
                transport, version = "iwarp", 0
            elif link_layer == "infiniband":
                transport, version = "infiniband", 0
            elif link_layer == "ethernet":
                transport, version = "roce", roce_version(port_dir)
            else:
                log.warning(
                    "%s port %s: unknown link layer %r; skipped", device, port_dir.name, link_layer
                )
                continue
            nics.append(
                DiscoveredNic(
                    device=device,
                    port=int(port_dir.name),
                    transport=transport,
                    roce_version=version,
                    rate_gbps=parse_rate(_read(port_dir / "rate")),
                    state=parse_state(_read(port_dir / "state")),
                )
            )
    return nics
