"""Registry reads as the registry grows: `GET /v1/sites`, a site's nodes and agents, and the
scheduler's topology build, at 1,000 and 10,000 agents, SQLite and PostgreSQL.

    .venv/bin/python bench/registry_reads.py                  # both backends, ~3 minutes
    .venv/bin/python bench/registry_reads.py --backend sqlite --markdown
    .venv/bin/python bench/registry_reads.py --quick          # 1,000 agents only

Each point is a fresh database (a temporary SQLite file, or a new PostgreSQL database
dropped afterwards) migrated by Alembic and filled with bulk inserts of the rows that
registration writes: every agent has one node with 8 GPUs and 2 RDMA ports and a live
lease; 5 % of the agents are lost (lease revoked, GPUs lost); one job per site holds 16
GPUs; every site has measured the WAN to every other site. The reads go through a real
HTTP server (uvicorn on a free port, the API of `cpn serve`) with an httpx client.

Beside each read, in the same run and on the same database, its baseline: the code before
issue 14 — `GET /v1/sites` returned every site with every agent, node, GPU and NIC nested,
loaded as ORM objects with `selectinload` (kept below as `baseline_sites`, building the
same JSON by hand, which is faster than its pydantic path was), and `build_topology` loaded
the same ORM graph. Times are the median of `--repeat` calls after one warm-up call, which
is reported too (first); baselines run once (they take seconds). Queries are counted per
call with a SQLAlchemy event.

Goal (issue 14): `GET /v1/sites` with 10,000 agents in under 0.5 s on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import psycopg
import uvicorn
from rich.console import Console
from rich.table import Table
from sqlalchemy import Table as SqlTable
from sqlalchemy import event, insert, select
from sqlalchemy.orm import Session, selectinload

from api import create_app
from cpn.listen_ports import free_port  # the one probe for a free port
from cpn.registry import Registry, build_topology, upgrade
from cpn.registry.models import (
    Agent,
    AgentStatus,
    Allocation,
    Gpu,
    GpuStatus,
    Job,
    JobState,
    Lease,
    Node,
    RdmaNic,
    Site,
    WanLink,
)

PG_ADMIN = os.environ.get("CPN_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
GPUS_PER_NODE = 8
GOAL_S = 0.5


@dataclass
class Result:
    backend: str
    agents: int
    sites: int
    read: str
    first_s: float
    median_s: float
    queries: int
    bytes: int
    baseline_s: float | None
    baseline_queries: int | None


# ---------------------------------------------------------------------------- databases


@contextmanager
def database(backend: str) -> Iterator[str]:
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            yield f"sqlite:///{tmp}/registry.db"
        return
    name = f"cpn_bench_{secrets.token_hex(4)}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _bulk(session: Session, model: type[Any], rows: list[dict[str, Any]]) -> None:
    table: SqlTable = model.__table__
    for i in range(0, len(rows), 5000):
        session.execute(insert(table), rows[i : i + 5000])


def populate(registry: Registry, agents: int, sites: int) -> None:
    """The rows `register_agent` and the heartbeat flusher would have written."""
    now = datetime.now(UTC)
    per_site = agents // sites
    rows: dict[type[Any], list[dict[str, Any]]] = {
        model: [] for model in (Site, Agent, Lease, Node, Gpu, RdmaNic, WanLink, Job, Allocation)
    }
    site_rows, agent_rows, lease_rows = rows[Site], rows[Agent], rows[Lease]
    node_rows, gpu_rows, nic_rows = rows[Node], rows[Gpu], rows[RdmaNic]
    job_rows, alloc_rows, link_rows = rows[Job], rows[Allocation], rows[WanLink]
    for s in range(1, sites + 1):
        site_rows.append(
            {
                "id": s,
                "name": f"site-{s:03d}",
                "gpu_price_per_hour": 2.0,
                "intra_site_gbps": None,
                "created_at": now,
            }
        )
        job_rows.append(
            {
                "id": f"job-{s}",
                "name": f"job-{s}",
                "state": JobState.RUNNING,
                "spec": {},
                "plan": None,
                "created_at": now,
                "updated_at": now,
            }
        )
        for p in range(1, sites + 1):
            if p != s:
                link_rows.append(
                    {
                        "site_id": s,
                        "peer_site_id": p,
                        "bandwidth_gbps": 1.0 + p,
                        "rtt_ms": 20.0,
                        "measured_at": now,
                        "reported_by": f"agent-{s:03d}-0000",
                    }
                )
        for a in range(per_site):
            pk = (s - 1) * per_site + a + 1
            lost = pk % 20 == 0
            agent_rows.append(
                {
                    "id": pk,
                    "site_id": s,
                    "agent_id": f"agent-{s:03d}-{a:04d}",
                    "version": "1",
                    "probe_address": f"10.{s}.{a // 250}.{a % 250}:7070",
                    "health": "ok",
                    "status": AgentStatus.LOST if lost else AgentStatus.ALIVE,
                    "registrations": 1,
                    "registered_at": now,
                    "last_heartbeat_at": now,
                    "lost_at": now if lost else None,
                }
            )
            lease_rows.append(
                {
                    "id": pk,
                    "lease_id": str(uuid.uuid4()),
                    "agent_pk": pk,
                    "ttl_ms": 10_000,
                    "granted_at": now,
                    "renewed_at": now,
                    "expires_at": now + timedelta(hours=1),
                    "revoked_at": now if lost else None,
                }
            )
            node_rows.append(
                {
                    "id": pk,
                    "site_id": s,
                    "agent_pk": pk,
                    "name": f"node-{a:04d}",
                    "intra_node_gbps": 4800.0,
                }
            )
            for g in range(GPUS_PER_NODE):
                gid = (pk - 1) * GPUS_PER_NODE + g + 1
                gpu_rows.append(
                    {
                        "id": gid,
                        "node_id": pk,
                        "index": g,
                        "model": "H100",
                        "memory_gb": 80.0,
                        "tflops": 989.0,
                        "uuid": f"GPU-{gid:08d}",
                        "source": "nvml",
                        "status": GpuStatus.LOST if lost else GpuStatus.AVAILABLE,
                        "utilisation": 0.5,
                        "memory_used_gb": 10.0,
                    }
                )
                if a < 2 and not lost:
                    alloc_rows.append({"job_id": f"job-{s}", "gpu_id": gid, "allocated_at": now})
            for port in (1, 2):
                nic_rows.append(
                    {
                        "node_id": pk,
                        "device": "mlx5_0",
                        "port": port,
                        "transport": "infiniband",
                        "roce_version": 0,
                        "rate_gbps": 200.0,
                        "state": "active",
                    }
                )
    with registry.write() as session:
        for model, table_rows in rows.items():  # parents before children
            _bulk(session, model, table_rows)
    if registry.dialect == "postgresql":
        with registry.engine.begin() as conn:
            conn.exec_driver_sql("ANALYZE")


# ---------------------------------------------------------------------------- baselines


def baseline_sites(session: Session) -> bytes:
    """GET /v1/sites before issue 14: everything, nested, from ORM objects."""
    now = datetime.now(UTC)
    sites = session.scalars(
        select(Site)
        .order_by(Site.name)
        .options(
            selectinload(Site.agents).selectinload(Agent.lease),
            selectinload(Site.nodes).selectinload(Node.gpus).selectinload(Gpu.allocation),
            selectinload(Site.nodes).selectinload(Node.rdma_nics),
            selectinload(Site.nodes).selectinload(Node.agent),
            selectinload(Site.links).selectinload(WanLink.peer_site),
        )
    ).all()
    body = [
        {
            "name": site.name,
            "gpu_price_per_hour": site.gpu_price_per_hour,
            "intra_site_gbps": site.intra_site_gbps,
            "agents": [
                {
                    "agent_id": a.agent_id,
                    "version": a.version,
                    "alive": a.alive_at(now),
                    "status": "alive" if a.alive_at(now) else "lost",
                    "health": a.health,
                    "registrations": a.registrations,
                    "registered_at": a.registered_at.isoformat(),
                    "last_heartbeat_at": str(a.last_heartbeat_at),
                    "lease_expires_at": str(a.lease.expires_at if a.lease else None),
                    "lost_at": str(a.lost_at),
                    "probe_address": a.probe_address,
                }
                for a in site.agents
            ],
            "nodes": [
                {
                    "name": n.name,
                    "agent_id": n.agent.agent_id,
                    "intra_node_gbps": n.intra_node_gbps,
                    "gpus": [
                        {
                            "index": g.index,
                            "model": g.model,
                            "memory_gb": g.memory_gb,
                            "tflops": g.tflops,
                            "uuid": g.uuid,
                            "source": g.source,
                            "status": g.status.value,
                            "allocated_to": g.allocation.job_id if g.allocation else None,
                            "utilisation": g.utilisation,
                            "memory_used_gb": g.memory_used_gb,
                        }
                        for g in n.gpus
                    ],
                    "rdma_nics": [
                        {
                            "device": c.device,
                            "port": c.port,
                            "transport": c.transport,
                            "roce_version": c.roce_version,
                            "rate_gbps": c.rate_gbps,
                            "state": c.state,
                        }
                        for c in n.rdma_nics
                    ],
                }
                for n in site.nodes
            ],
            "links": [
                {
                    "peer": link.peer_site.name,
                    "bandwidth_gbps": link.bandwidth_gbps,
                    "rtt_ms": link.rtt_ms,
                    "measured_at": link.measured_at.isoformat(),
                    "reported_by": link.reported_by,
                }
                for link in site.links
            ],
        }
        for site in sites
    ]
    return json.dumps(body).encode()


def baseline_topology(session: Session) -> int:
    """The ORM graph build_topology loaded before issue 14 (the loading is what cost)."""
    now = datetime.now(UTC)
    sites = session.scalars(
        select(Site)
        .order_by(Site.name)
        .options(
            selectinload(Site.nodes).selectinload(Node.gpus).selectinload(Gpu.allocation),
            selectinload(Site.nodes).selectinload(Node.rdma_nics),
            selectinload(Site.nodes).selectinload(Node.agent).selectinload(Agent.lease),
            selectinload(Site.links).selectinload(WanLink.peer_site),
        )
    ).all()
    return sum(1 for s in sites for n in s.nodes if n.gpus and n.agent.alive_at(now))


# ---------------------------------------------------------------------------- measuring


@contextmanager
def http_server(registry: Registry) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(registry), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def counting(registry: Registry) -> Iterator[list[str]]:
    statements: list[str] = []

    def count(*args: Any) -> None:
        if not args[2].startswith("BEGIN"):
            statements.append(args[2])

    event.listen(registry.engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(registry.engine, "before_cursor_execute", count)


def timed(registry: Registry, fn: Callable[[], int], repeat: int) -> tuple[float, float, int, int]:
    """(first call s, median of `repeat` more, queries per call, bytes) for one read."""
    with counting(registry) as statements:
        start = time.perf_counter()
        size = fn()
        first = time.perf_counter() - start
    queries = len(statements)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times), queries, size


def baseline_child(url: str, which: str) -> None:
    """Run one baseline read in this (fresh) process and print its time and queries."""
    registry = Registry(url)
    fn = baseline_sites if which == "sites" else baseline_topology
    with registry.read() as session:  # configure the mappers and connect: not timed
        session.scalars(select(Site).limit(1)).all()
    with counting(registry) as statements, registry.read() as session:
        start = time.perf_counter()
        fn(session)
        elapsed = time.perf_counter() - start
    print(json.dumps({"seconds": elapsed, "queries": len(statements)}))


def baseline(url: str, which: str) -> tuple[float | None, int | None]:
    """A baseline read in a child process: loading ORM graphs this large has crashed the
    interpreter here (SIGSEGV during garbage collection, SQLAlchemy 2.1.9 on CPython 3.11;
    see the README), and a crash must not end the benchmark."""
    done = subprocess.run(
        [sys.executable, __file__, "--baseline-child", which, "--url", url],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        print(f"baseline {which} failed (exit {done.returncode}): {done.stderr[-300:]}")
        return None, None
    data = json.loads(done.stdout.strip().splitlines()[-1])
    return float(data["seconds"]), int(data["queries"])


def run_point(backend: str, agents: int, sites: int, repeat: int) -> list[Result]:
    results = []
    with database(backend) as url:
        upgrade(url)
        registry = Registry(url)
        populate(registry, agents, sites)
        with http_server(registry) as base, httpx.Client(base_url=base, timeout=120) as client:

            def get(path: str) -> Callable[[], int]:
                def call() -> int:
                    reply = client.get(path)
                    reply.raise_for_status()
                    return len(reply.content)

                return call

            def walk(path: str) -> Callable[[], int]:
                def call() -> int:
                    size = 0
                    url_: str | None = path
                    while url_ is not None:
                        reply = client.get(url_)
                        reply.raise_for_status()
                        size += len(reply.content)
                        url_ = reply.links.get("next", {}).get("url")
                    return size

                return call

            def topology() -> int:
                with registry.read() as session:
                    build_topology(session)
                    return 0  # not an HTTP answer: no size

            nodes, agents_ = "/v1/sites/site-001/nodes", "/v1/sites/site-001/agents"
            reads: list[tuple[str, Callable[[], int], str | None]] = [
                ("GET /v1/sites", get("/v1/sites"), "sites"),
                (f"GET {nodes} (first page)", get(nodes), None),
                (f"GET {agents_} (first page)", get(agents_), None),
                (f"GET {nodes}?limit=1000, every page", walk(f"{nodes}?limit=1000"), None),
                ("build_topology", topology, "topology"),
            ]
            for name, fn, old in reads:
                first, median, queries, size = timed(registry, fn, repeat)
                base_s, base_q = baseline(url, old) if old is not None else (None, None)
                results.append(
                    Result(
                        backend, agents, sites, name, first, median, queries, size, base_s, base_q
                    )
                )
        registry.dispose()
    return results


def _table(results: list[Result], title: str) -> Table:
    table = Table(title=title)
    for col in (
        "backend",
        "agents",
        "sites",
        "read",
        "first s",
        "median s",
        "queries",
        "KB",
        "baseline s",
        "baseline queries",
        "baseline ÷ cpn first",
    ):
        table.add_column(col, justify="left" if col in {"backend", "read"} else "right")
    for r in results:
        ratio = f"{r.baseline_s / r.first_s:.0f}×" if r.baseline_s else ""
        table.add_row(
            r.backend,
            f"{r.agents:,}",
            str(r.sites),
            r.read,
            f"{r.first_s:.3f}",
            f"{r.median_s:.3f}",
            str(r.queries),
            f"{r.bytes / 1024:,.0f}",
            f"{r.baseline_s:.2f}" if r.baseline_s is not None else "",
            str(r.baseline_queries) if r.baseline_queries is not None else "",
            ratio,
        )
    return table


def _markdown(results: list[Result]) -> str:
    lines = [
        "| backend | agents | sites | read | first s | median s | queries | KB | baseline s "
        "| baseline queries | baseline ÷ cpn first |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = f"{r.baseline_s / r.first_s:.0f}×" if r.baseline_s else ""
        base = f"{r.baseline_s:.2f}" if r.baseline_s is not None else ""
        base_q = str(r.baseline_queries) if r.baseline_queries is not None else ""
        size = f"{r.bytes / 1024:,.1f}" if r.bytes else ""
        lines.append(
            f"| {r.backend} | {r.agents:,} | {r.sites} | {r.read} | {r.first_s:.3f} | "
            f"{r.median_s:.3f} | {r.queries} | {size} | {base} | {base_q} | "
            f"{ratio} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1,000 agents only")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--baseline-child", choices=["sites", "topology"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_child:
        baseline_child(args.url, args.baseline_child)
        return
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    points = [(1_000, 10)] if args.quick else [(1_000, 10), (10_000, 100), (10_000, 1)]
    results: list[Result] = []
    for backend in backends:
        for agents, sites in points:
            results.extend(run_point(backend, agents, sites, args.repeat))
    load = os.getloadavg()[0]
    title = f"Registry reads ({datetime.now():%Y-%m-%d %H:%M}, load average {load:.1f})"
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    elif args.markdown:
        print(f"{title}\n\n{_markdown(results)}")
    else:
        Console().print(_table(results, title))
    for r in results:
        if r.read == "GET /v1/sites" and r.agents >= 10_000:
            verdict = "met" if r.median_s < GOAL_S else "NOT met"
            print(
                f"goal: GET /v1/sites at {r.agents:,} agents in {r.sites} sites ({r.backend}): "
                f"{r.median_s:.3f} s median, {r.first_s:.3f} s first (goal < {GOAL_S} s): {verdict}"
            )


if __name__ == "__main__":
    main()
