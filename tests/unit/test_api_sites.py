"""The sites API on each backend: the shape of the answers, liveness checked on read,
pages that follow each other, bad parameters named, and a number of queries that does not
grow with the registry."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import event, update

from api import create_app
from cpn.registry import (
    NicInfo,
    Registry,
    SiteSettings,
    allocate_gpus,
    apply_heartbeats,
    build_topology,
    create_job,
    mark_lost,
)
from cpn.registry.leases import HeartbeatRecord, LinkSample
from cpn.registry.models import Lease, utcnow
from tests.registry_factories import node, register


def _get(app: FastAPI, path: str) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cpn") as client:
            return await client.get(path)

    return asyncio.run(call())


def _json(app: FastAPI, path: str) -> Any:
    reply = _get(app, path)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _all(app: FastAPI, path: str) -> list[Any]:
    """Every item, following the Link headers; also checks no page is longer than asked."""
    items: list[Any] = []
    url: str | None = path
    while url is not None:
        reply = _get(app, url)
        assert reply.status_code == 200, reply.text
        items.extend(reply.json())
        url = reply.links.get("next", {}).get("url")
    return items


def test_sites_agents_nodes_and_links(registry: Registry) -> None:
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
    sites = {s["name"]: s for s in _json(app, "/v1/sites")}
    assert list(sites) == ["a", "b"]
    site_a = sites["a"]
    assert (site_a["gpu_price_per_hour"], site_a["intra_site_gbps"]) == (2.5, 400.0)
    counts = ("agents_total", "agents_alive", "nodes_total", "gpus_total", "gpus_free",
              "gpus_allocated", "gpus_lost")  # fmt: skip
    assert [site_a[c] for c in counts] == [1, 1, 1, 2, 1, 1, 0]
    assert [sites["b"][c] for c in counts] == [1, 0, 1, 1, 0, 0, 1]  # its agent is not alive
    [link] = site_a["links"]
    assert (link["peer"], link["bandwidth_gbps"], link["rtt_ms"], link["reported_by"]) == (
        "b",
        9.5,
        21.0,
        "a-agent",
    )
    [agent] = _json(app, "/v1/sites/a/agents")
    assert (agent["agent_id"], agent["alive"], agent["status"], agent["registrations"]) == (
        "a-agent",
        True,
        "alive",
        1,
    )
    [agent_b] = _json(app, "/v1/sites/b/agents")
    assert (agent_b["alive"], agent_b["status"]) == (False, "lost")
    [n] = _json(app, "/v1/sites/a/nodes")
    assert (n["name"], n["agent_id"], n["alive"]) == ("a0", "a-agent", True)
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
    [n_b] = _json(app, "/v1/sites/b/nodes")
    assert n_b["alive"] is False
    paths = _json(app, "/openapi.json")["paths"]
    assert {"/v1/sites", "/v1/sites/{site}/agents", "/v1/sites/{site}/nodes"} <= set(paths)


def test_pages_follow_each_other(registry: Registry) -> None:
    for site in ("s1", "s2", "s3", "s4", "s5"):
        register(registry, site, nodes=(node(f"{site}-n0", gpus=1),))
    for i in range(4):
        register(registry, "s1", f"agent-{i}", nodes=(node(f"n{i}", gpus=2),))
    app = create_app(registry)
    first = _get(app, "/v1/sites?limit=2")
    assert [s["name"] for s in first.json()] == ["s1", "s2"]
    assert first.links["next"]["url"] == "http://cpn/v1/sites?after=s2&limit=2"
    assert [s["name"] for s in _all(app, "/v1/sites?limit=2")] == ["s1", "s2", "s3", "s4", "s5"]
    last = _get(app, "/v1/sites?limit=2&after=s4")
    assert [s["name"] for s in last.json()] == ["s5"] and "link" not in last.headers
    assert _json(app, "/v1/sites?after=s5") == []
    exact = _get(app, "/v1/sites?limit=5")
    assert len(exact.json()) == 5 and "link" not in exact.headers
    agents = _all(app, "/v1/sites/s1/agents?limit=2")
    assert [a["agent_id"] for a in agents] == [
        "agent-0", "agent-1", "agent-2", "agent-3", "s1-agent",
    ]  # fmt: skip
    nodes = _all(app, "/v1/sites/s1/nodes?limit=3")
    assert [(n["name"], len(n["gpus"])) for n in nodes] == [
        ("n0", 2), ("n1", 2), ("n2", 2), ("n3", 2), ("s1-n0", 1),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "status", "field"),
    [
        ("/v1/sites?limit=0", 422, "limit"),
        ("/v1/sites?limit=1001", 422, "limit"),
        ("/v1/sites?limit=99999999999999999999999", 422, "limit"),
        ("/v1/sites?after=a%00b", 422, "after"),
        ("/v1/sites?after=" + "x" * 65, 422, "after"),
        ("/v1/sites/a%0A/nodes", 422, "site"),
        ("/v1/sites/a/agents?after=%1B%5B2J", 422, "after"),
        ("/v1/sites/nowhere/nodes", 404, None),
        ("/v1/sites/nowhere/agents", 404, None),
    ],
)
def test_bad_parameters_are_named(registry: Registry, path: str, status: int, field: str) -> None:
    reply = _get(create_app(registry), path)
    assert reply.status_code == status, reply.text
    if field is not None:
        assert [e["loc"][-1] for e in reply.json()["detail"]] == [field]
    else:
        assert reply.json()["detail"] == "site: no site 'nowhere'"


@contextmanager
def _counting(registry: Registry) -> Iterator[list[str]]:
    statements: list[str] = []

    def count(*args: Any) -> None:
        if not args[2].startswith("BEGIN"):  # SQLite's explicit BEGIN (see cpn/registry/db.py)
            statements.append(args[2])

    event.listen(registry.engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(registry.engine, "before_cursor_execute", count)


def _populate(registry: Registry, sites: int, agents_per_site: int) -> None:
    nic = (NicInfo("mlx5_0", 1, "infiniband", 200.0, "active"),)
    for s in range(sites):
        site = f"site{s:02d}"
        for a in range(agents_per_site):
            reg = register(registry, site, f"agent{a:02d}", nodes=(node(f"n{a}", 4, nics=nic),))
            now = utcnow()
            with registry.write() as w:
                apply_heartbeats(w, [HeartbeatRecord(
                    agent_pk=reg.agent_pk, lease_pk=reg.lease_pk, site_id=reg.site_id,
                    agent_id=f"agent{a:02d}", at=now, expires_at=now + timedelta(minutes=5),
                    health="ok", links=tuple(
                        LinkSample(f"site{p:02d}", 1.0 + p, 10.0, now)
                        for p in range(s) if a == 0
                    ),
                )])  # fmt: skip
                if a == 1:
                    mark_lost(w, reg.agent_pk, reg.lease_id, now, "test")
        with registry.write() as w:
            create_job(w, f"job{s}", f"job{s}")
            allocate_gpus(w, f"job{s}", {site: {"n0": [0, 1]}})


def _queries(registry: Registry, app: FastAPI) -> dict[str, int]:
    out = {}
    for path in ("/v1/sites", "/v1/sites/site01/agents", "/v1/sites/site01/nodes"):
        with _counting(registry) as statements:
            assert _get(app, path).status_code == 200
        out[path] = len(statements)
    with _counting(registry) as statements, registry.read() as session:
        build_topology(session)
    out["build_topology"] = len(statements)
    return out


def test_reads_take_the_same_number_of_queries_whatever_the_size(registry: Registry) -> None:
    app = create_app(registry)
    _populate(registry, sites=2, agents_per_site=2)
    small = _queries(registry, app)
    for s in range(2, 6):  # more sites, more agents per site, more links
        for a in range(6):
            register(registry, f"site{s:02d}", f"agent{a:02d}", nodes=(node(f"n{a}", 4),))
    for a in range(2, 12):
        register(registry, "site01", f"agent{a:02d}", nodes=(node(f"n{a}", 4),))
    large = _queries(registry, app)
    assert large == small, (small, large)
    assert small == {
        "/v1/sites": 5,
        "/v1/sites/site01/agents": 2,
        "/v1/sites/site01/nodes": 4,
        "build_topology": 5,
    }


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    path=st.sampled_from(["/v1/sites", "/v1/sites/a/agents", "/v1/sites/a/nodes"]),
    limit=st.one_of(st.none(), st.integers(), st.text(max_size=30)),
    after=st.one_of(st.none(), st.text(max_size=300)),
    site=st.one_of(st.just("a"), st.text(max_size=80)),
)
def test_any_query_gets_an_answer_never_a_500(
    registry: Registry, path: str, limit: object, after: str | None, site: str
) -> None:
    register(registry, "a", nodes=(node("a0", gpus=2),))  # again: the same rows
    params: dict[str, Any] = {}
    if limit is not None:
        params["limit"] = limit
    if after is not None:
        params["after"] = after
    if path != "/v1/sites":
        path = path.replace("/a/", f"/{quote(site, safe='')}/")
    app = create_app(registry)

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cpn") as client:
            return await client.get(path, params=params)

    reply = asyncio.run(call())
    assert reply.status_code in {200, 404, 422}, (path, params, reply.text[:300])
    if reply.status_code == 422:
        assert {e["loc"][-1] for e in reply.json()["detail"]} <= {"limit", "after", "site"}
