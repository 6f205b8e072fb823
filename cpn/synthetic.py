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
