"""GET /v1/sites on each backend: the shape of the answer, and liveness checked on read."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import httpx
from fastapi import FastAPI
from sqlalchemy import update

from api import create_app
from cpn.registry import (
    NicInfo,
    Registry,
    SiteSettings,
    allocate_gpus,
    apply_heartbeats,
    create_job,
)
from cpn.registry.leases import HeartbeatRecord, LinkSample
from cpn.registry.models import Lease, utcnow
from tests.registry_factories import node, register


def _get(app: FastAPI, path: str) -> tuple[int, Any]:
    async def call() -> tuple[int, Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cpn") as client:
            reply = await client.get(path)
            return reply.status_code, reply.json()

    return asyncio.run(call())


def test_sites_with_agents_inventory_and_links(registry: Registry) -> None:
    nic = NicInfo("mlx5_0", 1, "roce", 100.0, "active", roce_version=2)
    a = register(
        registry, "a", nodes=(node("a0", gpus=2, nics=(nic,)),), settings=SiteSettings(2.5, 400.0)
    )
    b = register(registry, "b", nodes=(node("b0", gpus=1),))
    now = utcnow()
    with registry.write() as s:
        apply_heartbeats(s, [HeartbeatRecord(
            agent_pk=a.agent_pk, lease_pk=a.lease_pk, site_id=a.site_id, agent_id="a-agent", at=now,
            expires_at=now + timedelta(minutes=5), health="ok",
            links=(LinkSample("b", 9.5, 21.0, now),),
        )])  # fmt: skip
        create_job(s, "job-1", "job-1")
        allocate_gpus(s, "job-1", {"a": {"a0": [1]}})
        # b's lease ran out, and no reaper has run: the API must say so anyway.
        s.execute(
            update(Lease)
            .where(Lease.id == b.lease_pk)
            .values(expires_at=now - timedelta(seconds=1))
        )
    app = create_app(registry)
    status, body = _get(app, "/v1/sites")
    assert status == 200
    sites = {s["name"]: s for s in body}
    assert list(sites) == ["a", "b"]
    site_a = sites["a"]
    assert (site_a["gpu_price_per_hour"], site_a["intra_site_gbps"]) == (2.5, 400.0)
    [agent] = site_a["agents"]
    assert (agent["agent_id"], agent["alive"], agent["status"], agent["registrations"]) == (
        "a-agent",
        True,
        "alive",
        1,
    )
    [n] = site_a["nodes"]
    assert [(g["index"], g["model"], g["status"], g["allocated_to"]) for g in n["gpus"]] == [
        (0, "A100-80G", "available", None),
        (1, "A100-80G", "available", "job-1"),
    ]
    assert n["rdma_nics"] == [
        {
            "device": "mlx5_0",
            "port": 1,
            "transport": "roce",
            "roce_version": 2,
            "rate_gbps": 100.0,
            "state": "active",
        }
    ]
    [link] = site_a["links"]
    assert (link["peer"], link["bandwidth_gbps"], link["rtt_ms"], link["reported_by"]) == (
        "b",
        9.5,
        21.0,
        "a-agent",
    )
    [agent_b] = sites["b"]["agents"]
    assert (agent_b["alive"], agent_b["status"]) == (False, "lost")
    assert _get(app, "/openapi.json")[1]["paths"]["/v1/sites"]["get"]
