"""Random scheduling instances for property tests: small enough to enumerate."""

from __future__ import annotations

from typing import Any

from hypothesis import reject
from hypothesis import strategies as st

from cpn.contracts import JobSpec, Topology
from cpn.costmodel import GIB, Workload
from cpn.errors import InfeasibleError
from cpn.scheduler.instance import Instance, build_instance
from tests.factories import job, link, topology


def instance_or_reject(case: tuple[Topology, JobSpec]) -> Instance:
    """The case's instance; hypothesis drops a case whose job cannot fit at all."""
    topo, spec = case
    try:
        return build_instance(topo, Workload.of(spec))
    except InfeasibleError:
        reject()


@st.composite
def tiny_cases(draw: st.DrawFn) -> tuple[Topology, JobSpec]:
    """2–4 sites, ≤ 4 nodes, ≤ 6 shards: small enough to enumerate every placement.

    Links from slow and far to faster than a site's own fabric with no latency (where a
    WAN hop can beat an in-site one), sites of very unequal room, chains and triangles:
    the shapes two bound bugs once needed (docs/scheduler.md §10)."""
    pp = draw(st.integers(1, 3))
    # At least 3 shards on nodes of 1–2 slots: most cases must spread over sites.
    dp = draw(st.integers(max(1, -(-3 // pp)), 6 // pp))
    tp = draw(st.sampled_from([1, 2]))
    wan = draw(st.sampled_from(["none", "fp16", "int8", "topk"]))
    spec = job(
        dp,
        tp,
        pp,
        layers=6,
        hidden=64,
        heads=4,
        seq_len=32,
        vocab=draw(st.sampled_from([100, 50_000])),
        micro_batches=draw(st.integers(1, 3)),
        wan=wan,
        density=0.01 if wan == "topk" else None,
    )
    w = Workload.of(spec)
    # GPU memory just above one stage's need or another's, so some nodes fit only some stages.
    needs = [*sorted({w.memory_bytes(p) / GIB + 0.001 for p in range(pp)}), 80.0]
    n_sites = draw(st.integers(2, 4))
    names = ["a", "b", "c", "d"][:n_sites]
    n_nodes = draw(st.integers(n_sites, 4))
    owners = [names[i] for i in range(n_sites)] + [
        draw(st.sampled_from(names)) for _ in range(n_nodes - n_sites)
    ]
    site_docs: dict[str, dict[str, Any]] = {}
    for i, owner in enumerate(owners):
        doc = site_docs.setdefault(
            owner,
            {
                "name": owner,
                "gpu_price_per_hour": 1.0,
                "intra_site_gbps": draw(st.sampled_from([1, 100, 800])),
                "nodes": [],
            },
        )
        doc["nodes"].append(
            {
                "name": f"n{i}",
                "gpu": {
                    "model": "X",
                    "count": tp * draw(st.integers(1, 3)),
                    "memory_gb": draw(st.sampled_from(needs)),
                    "tflops": draw(st.sampled_from([100, 300])),
                },
                "intra_node_gbps": 2000,
            }
        )
    gbps = st.sampled_from([0.5, 2, 10, 100, 400])
    ms = st.sampled_from([0, 1, 5, 50, 150])
    links = [link(names[i], names[i + 1], draw(gbps), draw(ms)) for i in range(n_sites - 1)]
    if n_sites >= 3 and draw(st.booleans()):
        links.append(link("a", names[-1], draw(gbps), draw(ms)))
    return topology(list(site_docs.values()), links), spec
