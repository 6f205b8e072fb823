"""The WAN between sites as a networkx graph, and the best route between any two sites.

The best route between two sites is the *widest* path (largest bottleneck bandwidth);
among the widest, the one with the least summed latency. A lexicographic Dijkstra on
(bottleneck, latency) is not correct for this: extending two paths by the same narrow
link can make their bottlenecks equal and reverse which one is better. So routes are
found exactly, the way a widest-path tree is built: links are added in decreasing order
of bandwidth, and when two connected components merge at bandwidth w, every pair that
becomes connected has bottleneck w; its best route is the least-latency path in the graph
of links ≥ w, found by Dijkstra from the smaller side (so each node runs O(log V)
Dijkstras in all).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from itertools import groupby

from cpn.contracts.reservations import Reservations
from cpn.contracts.topology import LinkSpec, Topology, link_key

# networkx is imported where it is used: a fifth of a second that every training worker
# (which imports this module through the cost model but never routes) would pay at start.


@dataclass(frozen=True)
class Route:
    """How bytes travel from one site to another."""

    sites: tuple[str, ...]  # from the source to the destination, both included
    bandwidth_gbps: float  # bottleneck: the narrowest link on the way
    latency_ms: float  # summed over the links

    @property
    def links(self) -> tuple[str, ...]:
        """Keys of the links on the way, in order."""
        return tuple(link_key(u, v) for u, v in itertools.pairwise(self.sites))

    @property
    def hops(self) -> int:
        return len(self.sites) - 1

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        """Time to move `nbytes` split into `messages` sequential messages along the route."""
        return messages * self.latency_ms / 1e3 + nbytes * 8 / (self.bandwidth_gbps * 1e9)


class SiteGraph:
    """Sites and the WAN links between them, with bandwidth already reserved taken out."""

    def __init__(self, topology: Topology, reservations: Reservations | None = None) -> None:
        self.topology = topology
        import networkx as nx  # noqa: PLC0415

        self.graph = nx.Graph()
        self.graph.add_nodes_from(topology.site_names)
        reserved = reservations.wan_gbps if reservations else {}
        self.links: dict[str, LinkSpec] = {}
        for link in topology.links:
            free = link.bandwidth_gbps - reserved.get(link.key, 0.0)
            self.links[link.key] = link
            if free <= 0:
                continue  # fully reserved by other jobs: unusable for now
            self.graph.add_edge(
                link.a, link.b, bandwidth=free, latency=link.latency_ms, key=link.key
            )

    def free_gbps(self, key: str) -> float:
        a, _, b = key.partition("|")
        data = self.graph.get_edge_data(a, b)
        return float(data["bandwidth"]) if data else 0.0

    def components(self) -> list[frozenset[str]]:
        """Groups of sites that can reach each other, largest first, ties by name."""
        import networkx as nx  # noqa: PLC0415

        comps = [frozenset(c) for c in nx.connected_components(self.graph)]
        return sorted(comps, key=lambda c: (-len(c), min(c)))

    def route(self, a: str, b: str) -> Route | None:
        """The best route from a to b, or None when no WAN path joins them."""
        if a == b:
            return Route((a,), float("inf"), 0.0)
        return self._routes.get((a, b))

    @cached_property
    def _routes(self) -> dict[tuple[str, str], Route]:
        import networkx as nx  # noqa: PLC0415

        routes: dict[tuple[str, str], Route] = {}
        edges = sorted(self.graph.edges(data=True), key=lambda e: (-e[2]["bandwidth"], e[2]["key"]))
        current = nx.Graph()
        current.add_nodes_from(self.graph.nodes)
        comp_of: dict[str, int] = {n: i for i, n in enumerate(sorted(self.graph.nodes))}
        members: dict[int, list[str]] = {i: [n] for n, i in comp_of.items()}
        for width, level in groupby(edges, key=lambda e: e[2]["bandwidth"]):
            level_edges = list(level)
            merged: list[tuple[list[str], list[str]]] = []
            for u, v, data in level_edges:
                current.add_edge(u, v, **data)
            for u, v, _ in level_edges:
                cu, cv = comp_of[u], comp_of[v]
                if cu == cv:
                    continue
                small, big = (cu, cv) if len(members[cu]) <= len(members[cv]) else (cv, cu)
                merged.append((list(members[small]), list(members[big])))
                for n in members[small]:
                    comp_of[n] = big
                members[big].extend(members.pop(small))
            # All level edges are in `current` before any Dijkstra: a pair joined at this
            # width may use several links of the same width.
            for small_side, big_side in merged:
                for src in small_side:
                    dist, paths = nx.single_source_dijkstra(current, src, weight="latency")
                    for dst in big_side:
                        path = tuple(paths[dst])
                        routes[(src, dst)] = Route(path, width, float(dist[dst]))
                        routes[(dst, src)] = Route(path[::-1], width, float(dist[dst]))
        # Every pair that becomes connected at this width lies on opposite sides of
        # exactly one merge (union-find merges form a tree), so all pairs are covered.
        return routes
