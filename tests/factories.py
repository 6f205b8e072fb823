"""Small topologies and jobs for tests, built from plain dicts like the YAML files."""

from __future__ import annotations

from typing import Any

from cpn.contracts import JobSpec, Topology


def site(
    name: str,
    nodes: int = 1,
    gpus: int = 8,
    memory_gb: float = 80,
    tflops: float = 312,
    model: str = "A100-80G",
    intra_site_gbps: float = 800,
    price: float = 2.0,
) -> dict[str, Any]:
    return {
        "name": name,
        "gpu_price_per_hour": price,
        "intra_site_gbps": intra_site_gbps,
        "nodes": [
            {
                "name": f"{name}-n",
                "count": nodes,
                "gpu": {"model": model, "count": gpus, "memory_gb": memory_gb, "tflops": tflops},
                "intra_node_gbps": 4800,
            }
        ],
    }


def link(a: str, b: str, gbps: float = 10, ms: float = 20, price: float = 0.0) -> dict[str, Any]:
    return {
        "a": a,
        "b": b,
        "bandwidth_gbps": gbps,
        "latency_ms": ms,
        "transport": "tcp",
        "price_per_gb": price,
    }


def topology(sites: list[dict[str, Any]], links: list[dict[str, Any]]) -> Topology:
    return Topology.model_validate({"sites": sites, "links": links})


def job(
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    seq_len: int = 128,
    vocab: int = 512,
    micro_batch: int = 1,
    micro_batches: int = 2,
    dtype: str = "fp32",
    wan: str = "none",
    density: float | None = None,
    every: int | None = None,
    values: str | None = None,
    **extra: Any,
) -> JobSpec:
    compression: dict[str, Any] = {"wan": wan}
    if density is not None:
        compression["density"] = density
    if every is not None:
        compression["every"] = every
    if values is not None:
        compression["values"] = values
    doc = {
        "name": "test-job",
        "model": {
            "layers": layers,
            "hidden": hidden,
            "heads": heads,
            "seq_len": seq_len,
            "vocab": vocab,
        },
        "train": {
            "global_batch": dp * micro_batch * micro_batches,
            "micro_batch": micro_batch,
            "dtype": dtype,
            "steps": 10,
        },
        "parallel": {"dp": dp, "tp": tp, "pp": pp},
        "compression": compression,
        **extra,
    }
    return JobSpec.model_validate(doc)
