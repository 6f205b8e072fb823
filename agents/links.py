"""WAN measurements waiting to ride on the next heartbeat."""

from __future__ import annotations

from collections.abc import Callable

from agents.probe import ProbeResult
from cpn.contracts.limits import MIN_GBPS
from proto.cpn.v1 import agent_pb2 as pb


class LinkBook:
    """The newest measurement per peer site, until a heartbeat has delivered it; and the
    newest per peer site for good (`latest`: what running `wan: auto` jobs follow)."""

    def __init__(self) -> None:
        self._pending: dict[str, ProbeResult] = {}
        self._latest: dict[str, ProbeResult] = {}
        #: Called after each measurement (the agent writes its launches' links files).
        self.on_record: Callable[[], None] | None = None

    def record(self, site: str, result: ProbeResult) -> None:
        self._pending[site] = result
        self._latest[site] = result
        if self.on_record is not None:
            self.on_record()

    def latest(self) -> dict[str, dict[str, float]]:
        """The newest measurement per peer site, as `cpn.train.wan_auto` reads it."""
        return {
            site: {
                "bandwidth_gbps": r.bandwidth_gbps,
                "rtt_ms": r.rtt_ms,
                "measured_at": r.measured_at,
            }
            for site, r in sorted(self._latest.items())
        }

    def pending(self) -> list[pb.LinkMeasurement]:
        return [
            pb.LinkMeasurement(
                peer_site=site,
                # Below the protocol's floor a link carries nothing useful: report it down
                # (0) rather than a value the control plane refuses.
                bandwidth_gbps=r.bandwidth_gbps if r.bandwidth_gbps >= MIN_GBPS else 0.0,
                rtt_ms=r.rtt_ms,
                measured_at_unix_ms=int(r.measured_at * 1000),
            )
            for site, r in sorted(self._pending.items())
        ]

    def delivered(self, sent: list[pb.LinkMeasurement]) -> None:
        """Forget what a heartbeat carried (newer measurements may have come meanwhile)."""
        for link in sent:
            current = self._pending.get(link.peer_site)
            if current is not None and int(current.measured_at * 1000) == link.measured_at_unix_ms:
                del self._pending[link.peer_site]
