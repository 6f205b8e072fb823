"""Synthetic topologies and jobs for benchmarks, demos and property tests.

Sites are scattered on a 4000 km square; each links to its nearest neighbours (plus a
minimum spanning tree, so every site is reachable), with latency from distance. A
*homogeneous* network has equal sites and equal 10 Gb/s links; a *heterogeneous* one has
GPU counts drawn from a skewed distribution, a mix of GPU models, and links of
0.3–10 Gb/s with 5–250 ms latency.
"""

from __future__ import annotations

import math
import random

import networkx as nx

from cpn.contracts.job import JobSpec
from cpn.contracts.topology import Topology

GPUS_PER_NODE = 8

#: (model, memory GiB, bf16 TFLOP/s, NVLink Gb/s, price per GPU-hour)
GPU_KINDS = [
    ("A100-80G", 80, 312, 4800, 2.2),
    ("H100-80G", 80, 989, 7200, 4.5),
    ("A800-80G", 80, 312, 3200, 1.6),
    ("H800-80G", 80, 989, 3200, 3.2),
    ("L40S-48G", 48, 362, 512, 1.1),
]


def _node_counts(sites: int, gpus: int, heterogeneous: bool, rng: random.Random) -> list[int]:
    nodes = max(sites, gpus // GPUS_PER_NODE)
    if not heterogeneous:
        base, extra = divmod(nodes, sites)
        return [base + (1 if i < extra else 0) for i in range(sites)]
    weights = [rng.lognormvariate(0, 1.0) for _ in range(sites)]
    total = sum(weights)
    counts = [max(1, math.floor(nodes * w / total)) for w in weights]
    # Hand out what rounding left, to the largest sites first.
    order = sorted(range(sites), key=lambda i: -weights[i])
    i = 0
    while sum(counts) < nodes:
        counts[order[i % sites]] += 1
        i += 1
    while sum(counts) > nodes:
        j = order[i % sites]
        if counts[j] > 1:
            counts[j] -= 1
        i += 1
    return counts


def generate_topology(
    sites: int, gpus: int, *, heterogeneous: bool = True, seed: int = 0, degree: int = 3
) -> Topology:
    """A connected network of `sites` sites with `gpus` GPUs in 8-GPU nodes."""
    rng = random.Random(seed)
    points = [(rng.uniform(0, 4000), rng.uniform(0, 4000)) for _ in range(sites)]
    counts = _node_counts(sites, gpus, heterogeneous, rng)
    site_docs = []
    for i in range(sites):
        if heterogeneous:
            model, mem, tflops, nvlink, price = GPU_KINDS[rng.randrange(len(GPU_KINDS))]
            fabric = rng.choice([400, 800, 1600, 3200])
        else:
            model, mem, tflops, nvlink, price = GPU_KINDS[0]
            fabric = 800
        site_docs.append(
            {
                "name": f"site{i:03d}",
                "gpu_price_per_hour": price,
                "intra_site_gbps": fabric,
                "nodes": [
                    {
                        "name": "n",
                        "count": counts[i],
                        "gpu": {
                            "model": model,
                            "count": GPUS_PER_NODE,
                            "memory_gb": mem,
                            "tflops": tflops,
                        },
                        "intra_node_gbps": nvlink,
                        "rdma": [{"device": "mlx5_0", "transport": "infiniband", "rate_gbps": 200}],
                    }
                ],
            }
        )
    g = nx.Graph()
    g.add_nodes_from(range(sites))

    def dist(a: int, b: int) -> float:
        return math.dist(points[a], points[b])

    complete = nx.Graph()
    for a in range(sites):
        for b in range(a + 1, sites):
            complete.add_edge(a, b, weight=dist(a, b))
    g.add_edges_from(nx.minimum_spanning_edges(complete, data=False))
    for a in range(sites):
        nearest = sorted((b for b in range(sites) if b != a), key=lambda b: dist(a, b))
        g.add_edges_from((a, b) for b in nearest[:degree])
    links = []
    for a, b in sorted(tuple(sorted(e)) for e in g.edges):
        if heterogeneous:
            bw = round(math.exp(rng.uniform(math.log(0.3), math.log(10))), 3)
            latency = round(5 + 245 * min(1.0, dist(a, b) / 4000), 1)
        else:
            bw, latency = 10.0, 20.0
        links.append(
            {
                "a": f"site{a:03d}",
                "b": f"site{b:03d}",
                "bandwidth_gbps": bw,
                "latency_ms": latency,
                "transport": "tcp",
                "price_per_gb": 0.02,
            }
        )
    return Topology.model_validate({"sites": site_docs, "links": links})


def benchmark_job(
    gpus: int,
    *,
    compression: str = "none",
    tp: int = 8,
    pp: int | None = None,
    fill: float = 0.75,
) -> JobSpec:
    """A 13B-parameter GPT sized to use about `fill` of `gpus` GPUs."""
    if pp is None:
        pp = 2 if gpus <= 64 else 4 if gpus <= 1024 else 8
    dp = max(1, int(gpus * fill) // (tp * pp))
    doc: dict[str, object] = {
        "name": f"bench-{gpus}",
        "model": {"layers": 40, "hidden": 5120, "heads": 40, "seq_len": 2048, "vocab": 50257},
        "train": {"global_batch": dp * 4 * pp, "micro_batch": 1, "dtype": "bf16", "steps": 1000},
        "parallel": {"dp": dp, "tp": tp, "pp": pp},
        "compression": {"wan": compression},
    }
    if compression == "topk":
        doc["compression"] = {"wan": "topk", "density": 0.001}
    return JobSpec.model_validate(doc)


#: Measured AWS inter-region latency (ms) and bandwidth (Gb/s) that DT-FM's simulated
#: scenarios use (Yuan et al., NeurIPS 2022, §5 and its public scheduler's scenarios).
DTFM_LINKS: dict[tuple[str, str], tuple[float, float]] = {
    ("Oregon", "Virginia"): (67, 0.79),
    ("Oregon", "Ohio"): (49, 1.10),
    ("Oregon", "Tokyo"): (96, 0.523),
    ("Oregon", "Seoul"): (124, 0.46),
    ("Oregon", "London"): (136, 0.42),
    ("Oregon", "Frankfurt"): (143, 0.404),
    ("Oregon", "Ireland"): (124, 0.482),
    ("Virginia", "Ohio"): (11, 1.12),
    ("Virginia", "Tokyo"): (143, 0.524),
    ("Virginia", "Seoul"): (172, 0.500),
    ("Virginia", "London"): (76, 1.16),
    ("Virginia", "Frankfurt"): (90, 1.02),
    ("Virginia", "Ireland"): (67, 1.05),
    ("Ohio", "Tokyo"): (130, 0.694),
    ("Ohio", "Seoul"): (159, 0.529),
    ("Ohio", "London"): (86, 1.05),
    ("Ohio", "Frankfurt"): (99, 0.799),
    ("Ohio", "Ireland"): (77, 1.14),
    ("Tokyo", "Seoul"): (34, 1.10),
    ("Tokyo", "London"): (210, 0.366),
    ("Tokyo", "Frankfurt"): (223, 0.36),
    ("Tokyo", "Ireland"): (199, 0.465),
    ("Seoul", "London"): (238, 0.342),
    ("Seoul", "Frankfurt"): (235, 0.358),
    ("Seoul", "Ireland"): (228, 0.335),
    ("London", "Frankfurt"): (14, 1.14),
    ("London", "Ireland"): (12, 1.09),
    ("Frankfurt", "Ireland"): (24, 1.08),
    # The regional scenario's US links (DT-FM's case 4).
    ("Virginia", "California"): (59, 1.05),
    ("Oregon", "California"): (12, 1.25),
    ("California", "Ohio"): (52, 1.02),
}
#: DT-FM's heterogeneous multi-region scenarios: the regions each one spreads devices over.
DTFM_SCENARIOS: dict[str, list[str]] = {
    "multi-universities": ["Ohio", "Virginia"],
    "regional": ["Virginia", "Oregon", "California", "Ohio"],
    "worldwide": ["Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt", "Ireland"],
}
#: Between two machines of one region, DT-FM assumes 2 Gb/s and 10 ms.
DTFM_IN_REGION = (10.0, 2.0)


def dtfm_topology(scenario: str, sites_per_region: int = 1, nodes_per_site: int = 1) -> Topology:
    """One of DT-FM's multi-region scenarios, scaled: every region holds `sites_per_region`
    sites of `nodes_per_site` 8-GPU A100 nodes.

    Sites of one region are joined at DT-FM's in-region 2 Gb/s and 10 ms; sites of two
    regions by that pair's measured link (every region pair of the scenario, a full mesh,
    as in DT-FM). At sites_per_region = 1 and 64 GPUs in all this is DT-FM's own setting.
    """
    if scenario not in DTFM_SCENARIOS:
        raise ValueError(f"unknown DT-FM scenario {scenario!r}; one of {sorted(DTFM_SCENARIOS)}")
    model, mem, tflops, nvlink, price = GPU_KINDS[0]
    regions = DTFM_SCENARIOS[scenario]
    names = {r: [f"{r.lower()}{i}" for i in range(sites_per_region)] for r in regions}
    site_docs = [
        {
            "name": name,
            "gpu_price_per_hour": price,
            "intra_site_gbps": 800,
            "nodes": [
                {
                    "name": "n",
                    "count": nodes_per_site,
                    "gpu": {
                        "model": model,
                        "count": GPUS_PER_NODE,
                        "memory_gb": mem,
                        "tflops": tflops,
                    },
                    "intra_node_gbps": nvlink,
                }
            ],
        }
        for r in regions
        for name in names[r]
    ]

    def link(a: str, b: str, latency: float, gbps: float) -> dict[str, object]:
        return {
            "a": a,
            "b": b,
            "bandwidth_gbps": gbps,
            "latency_ms": latency,
            "transport": "tcp",
            "price_per_gb": 0.02,
        }

    links = []
    for i, ra in enumerate(regions):
        sites = names[ra]
        latency, gbps = DTFM_IN_REGION
        links += [link(a, b, latency, gbps) for j, a in enumerate(sites) for b in sites[j + 1 :]]
        for rb in regions[i + 1 :]:
            latency, gbps = DTFM_LINKS.get((ra, rb)) or DTFM_LINKS[(rb, ra)]
            links += [link(a, b, latency, gbps) for a in sites for b in names[rb]]
    return Topology.model_validate({"sites": site_docs, "links": links})
