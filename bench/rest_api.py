"""Job service benchmark: submissions per second with p50/p99 latency under concurrent
clients, and submit-to-SCHEDULED latency for a job on 8 sites, on SQLite and PostgreSQL,
against a real `cpn serve` process over HTTP.

    .venv/bin/python bench/api.py                       # both backends, defaults
    .venv/bin/python bench/api.py --backend sqlite --clients 16 --seconds 10
    .venv/bin/python bench/api.py --json

For each backend: `cpn serve` on a fresh database; 8 sites of 8 virtual GPUs registered
over gRPC (and kept alive with heartbeats) by a helper thread, with WAN links measured;
an API key from `cpn keys create`. Then:

- submissions: `--clients` threads, each with its own HTTP connection, POST /v1/jobs as
  fast as answered for `--seconds` (after `--warmup`), each with its own Idempotency-Key;
  the jobs need more GPUs than exist free after the first few, so the orchestration
  loop keeps working (planning the queue's head) while the API answers;
- scheduling: on an idle cluster (the queue cancelled), one job of 16 GPUs at a time:
  the time from POST to the job's `scheduled_at` (the server's clock, both ends), `--jobs`
  times.

Goal (issue 10): ≥ 300 submissions/s with p99 < 100 ms on a 2-core machine, clients
included.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import httpx
import psycopg
from rich.console import Console
from rich.table import Table

from proto.cpn.v1 import agent_pb2 as pb
from proto.cpn.v1 import agent_pb2_grpc

PG_ADMIN = os.environ.get("CPN_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
CPN = [sys.executable, "-m", "cpn"]
SITES = 8
GPUS = 8


def _job(name: str, dp: int) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"layers": 4, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 256},
        "train": {"global_batch": 16, "micro_batch": 1, "dtype": "fp32", "steps": 10},
        "parallel": {"dp": dp, "tp": 1, "pp": 2},
        "compression": {"wan": "topk", "density": 0.01},
    }


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Agents(threading.Thread):
    """8 sites' agents over real gRPC: register, then heartbeat with WAN measurements."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.stop = threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        leases = []
        for i in range(SITES):
            site = f"s{i}"
            meta = (("authorization", f"Bearer token-{site}"),)
            inv = pb.Inventory(nodes=[pb.Node(name=f"{site}-n0", gpu_count=GPUS, gpus=[
                pb.Gpu(index=g, model="A100", memory_gb=80, source=pb.GPU_SOURCE_VIRTUAL)
                for g in range(GPUS)])])  # fmt: skip
            reply = stub.Register(
                pb.RegisterRequest(site=site, agent_id=f"{site}-a", inventory=inv,
                                   probe_address=f"127.0.0.{i + 1}:1"),
                metadata=meta, timeout=30,
            )  # fmt: skip
            leases.append((site, meta, reply.lease_id))
        while not self.stop.is_set():
            now = int(time.time() * 1000)
            for i, (site, meta, lease) in enumerate(leases):
                links = [pb.LinkMeasurement(peer_site=f"s{j}", bandwidth_gbps=10 + i + j,
                                            rtt_ms=20, measured_at_unix_ms=now)
                         for j in range(SITES) if j != i]  # fmt: skip
                stub.Heartbeat(pb.HeartbeatRequest(site=site, agent_id=f"{site}-a",
                               lease_id=lease, health=pb.HEALTH_OK, links=links),
                               metadata=meta, timeout=10)  # fmt: skip
            self.ready.set()
            self.stop.wait(1.0)
        channel.close()


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run_backend(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="cpn-bench-api-"))
    pg_name = None
    if backend == "sqlite":
        url = f"sqlite:///{tmp}/bench.db"
    else:
        pg_name = f"cpn_bench_{secrets.token_hex(4)}"
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{pg_name}"')
        url = PG_ADMIN.rsplit("/", 1)[0] + f"/{pg_name}"
    tokens = tmp / "tokens.yaml"
    tokens.write_text("".join(f"s{i}: token-s{i}\n" for i in range(SITES)))
    grpc_port, http_port = _free_port(), _free_port()
    log = (tmp / "serve.log").open("w")
    serve = subprocess.Popen(
        [*CPN, "serve", "--database-url", url, "--site-tokens", str(tokens), "--host",
         "127.0.0.1", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
         "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "CPN_LEASE_TTL_S": "30", "CPN_PLAN_TIME_LIMIT_S": "2"},
    )  # fmt: skip
    base = f"http://127.0.0.1:{http_port}"
    agents = Agents(grpc_port)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"cpn serve did not start: see {tmp}/serve.log")
            time.sleep(0.2)
        key = subprocess.run(
            [*CPN, "keys", "create", "--tenant", "bench", "--database-url", url, "--admin"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        headers = {"Authorization": f"Bearer {key}"}
        agents.start()
        agents.ready.wait(60)
        time.sleep(1.5)
        submissions = _submissions(base, headers, args)
        # Idle the cluster: cancel everything, wait for the GPUs to be freed.
        with httpx.Client(base_url=base, headers=headers, timeout=30) as http:
            for state in ("pending", "scheduled", "running"):
                while True:
                    page = http.get("/v1/jobs", params={"state": state, "limit": 500}).json()
                    if not page["data"]:
                        break
                    for job in page["data"]:
                        http.post(f"/v1/jobs/{job['id']}/cancel")
            deadline = time.monotonic() + 60
            while http.get("/v1/topology/reservations").json()["gpus"]:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            scheduling = _scheduling(http, args)
    finally:
        agents.stop.set()
        serve.terminate()
        serve.wait(30)
        log.close()
        if pg_name is not None:
            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{pg_name}" WITH (FORCE)')
    return {"backend": backend, **submissions, **scheduling}


def _submissions(base: str, headers: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    latencies: list[list[float]] = [[] for _ in range(args.clients)]
    errors = [0] * args.clients
    start_at = time.monotonic() + 0.5
    measure_from = start_at + args.warmup
    end_at = measure_from + args.seconds

    def client(i: int) -> None:
        with httpx.Client(base_url=base, headers=headers, timeout=30) as http:
            while time.monotonic() < start_at:
                time.sleep(0.01)
            n = 0
            while (now := time.monotonic()) < end_at:
                n += 1
                reply = http.post("/v1/jobs", json=_job(f"c{i}-{n}", dp=2),
                                  headers={"Idempotency-Key": f"{i}-{n}"})  # fmt: skip
                took = time.monotonic() - now
                if reply.status_code != 201:
                    errors[i] += 1
                elif now >= measure_from:
                    latencies[i].append(took)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [x for xs in latencies for x in xs]
    return {
        "clients": args.clients,
        "submissions_per_s": len(flat) / args.seconds,
        "submit_p50_ms": _percentile(flat, 0.5) * 1000,
        "submit_p99_ms": _percentile(flat, 0.99) * 1000,
        "submit_errors": sum(errors),
    }


def _scheduling(http: httpx.Client, args: argparse.Namespace) -> dict[str, Any]:
    from datetime import datetime  # noqa: PLC0415

    waits = []
    for n in range(args.jobs):
        job = http.post("/v1/jobs", json=_job(f"sched-{n}", dp=8)).json()
        while True:
            got = http.get(f"/v1/jobs/{job['id']}").json()
            if got["scheduled_at"]:
                created = datetime.fromisoformat(got["created_at"])
                waits.append(
                    (datetime.fromisoformat(got["scheduled_at"]) - created).total_seconds()
                )
                break
            time.sleep(0.005)
        http.post(f"/v1/jobs/{job['id']}/cancel")
        while http.get("/v1/topology/reservations").json()["gpus"]:
            time.sleep(0.05)
    return {
        "schedule_jobs": len(waits),
        "schedule_p50_ms": _percentile(waits, 0.5) * 1000,
        "schedule_p99_ms": _percentile(waits, 0.99) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--jobs", type=int, default=20, help="submit-to-SCHEDULED samples")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    results = [run_backend(b, args) for b in backends]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    table = Table(title=f"job service: {SITES} sites × {GPUS} GPUs, {args.clients} clients")
    for col in ("backend", "submissions/s", "p50 ms", "p99 ms", "errors", "to SCHEDULED p50 ms",
                "p99 ms"):  # fmt: skip
        table.add_column(col)
    for r in results:
        table.add_row(r["backend"], f"{r['submissions_per_s']:.0f}", f"{r['submit_p50_ms']:.1f}",
                      f"{r['submit_p99_ms']:.1f}", str(r["submit_errors"]),
                      f"{r['schedule_p50_ms']:.0f}", f"{r['schedule_p99_ms']:.0f}")  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
