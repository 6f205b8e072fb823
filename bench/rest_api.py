"""Job service benchmark: submissions per second with p50/p99 latency under concurrent
clients, and submit-to-SCHEDULED latency for a job on 8 sites, SQLite and PostgreSQL in
one run, against a real `cpn serve` process over HTTP.

    .venv/bin/python bench/rest_api.py                       # both backends, defaults
    .venv/bin/python bench/rest_api.py --backend sqlite --clients 16 --seconds 10
    .venv/bin/python bench/rest_api.py --json
    .venv/bin/python bench/rest_api.py --profile /tmp/api    # py-spy of the server, per backend

For each backend: `cpn serve` on a fresh database (a temporary SQLite file, or a new
PostgreSQL database dropped afterwards); 8 sites of 8 virtual GPUs registered over gRPC
and kept alive with heartbeats (with WAN measurements) by a helper thread; an API key
from `cpn keys create`. Then, in this order:

1. scheduling, on the idle cluster: one job of 16 GPUs at a time, the time from its
   submission to its `scheduled_at` (the server's clock at both ends, planning
   included), cancelled and its GPUs freed before the next, `--jobs` times;
2. baseline: `--clients` connections asking GET /healthz as fast as answered — what the
   same server, HTTP stack and clients do with no authentication and no database;
3. submissions: `--clients` connections each POSTing jobs (each with its own
   Idempotency-Key) as fast as answered. After the first 16 the cluster is full, so the
   orchestration loop keeps working — admitting, then keeping the queue's reasons — while
   the API answers, as it would in production.

Each load phase runs `--warmup` seconds, then `--seconds` measured (steady state); the
whole-run figures count the warm-up too. CPU is measured as well (server: /proc over the
measured window; clients: this process's time, the agents' thread included), per request,
because on a shared machine the latency depends on what else runs and the CPU cost much
less. The clients speak HTTP/1.1 over asyncio streams with keep-alive and pre-encoded
requests (as wrk does): a general-purpose client such as httpx spends more CPU per
request than the server, on the same 2 cores.

Goal (issue 10): ≥ 300 submissions/s with p99 < 100 ms on a 2-core machine, clients
included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import httpx
import psycopg
from rich.console import Console
from rich.table import Table

from cpn.listen_ports import free_port  # the one probe for a free port
from proto.cpn.v1 import agent_pb2 as pb
from proto.cpn.v1 import agent_pb2_grpc

PG_ADMIN = os.environ.get("CPN_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
CPN = [sys.executable, "-m", "cpn"]
SITES = 8
GPUS = 8
GOAL_RATE = 300.0
GOAL_P99_MS = 100.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _job(name: str, dp: int) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"layers": 4, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 256},
        "train": {"global_batch": 16, "micro_batch": 1, "dtype": "fp32", "steps": 10},
        "parallel": {"dp": dp, "tp": 1, "pp": 2},
        "compression": {"wan": "topk", "density": 0.01},
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


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


# ---------------------------------------------------------------------------- load phases


@dataclass
class Phase:
    """One load phase: steady state (the measured window) beside the whole run."""

    requests: int  # answered as expected inside the measured window
    errors: int  # any other answer, whole run
    rate: float  # per second, measured window
    p50_ms: float
    p99_ms: float
    max_ms: float
    whole_rate: float  # per second from the first request to the last answer, warm-up in
    whole_p99_ms: float
    server_cpu_ms: float  # per request answered in the window
    client_cpu_ms: float


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bytes) -> int:
    """Send one request, read its whole answer; its status code."""
    writer.write(raw)
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    if length:
        await reader.readexactly(length)
    return int(head[9:12])


async def _load(
    port: int,
    request: Callable[[int, int], bytes],
    expect: int,
    args: argparse.Namespace,
    server_pid: int,
    on_window: Callable[[bool], None] = lambda start: None,
) -> Phase:
    """`--clients` keep-alive connections, each sending `request(client, n)` as fast as
    answered for `--warmup` + `--seconds`."""
    loop = asyncio.get_running_loop()
    start_at = loop.time() + 0.2
    measure_from = start_at + args.warmup
    end_at = measure_from + args.seconds
    samples: list[tuple[float, float, bool]] = []  # (sent at, seconds, as expected)
    cpu: dict[str, float] = {}

    async def client(i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(start_at - loop.time())
        n = 0
        while (sent := loop.time()) < end_at:
            n += 1
            status = await _exchange(reader, writer, request(i, n))
            samples.append((sent, loop.time() - sent, status == expect))
        writer.close()

    async def window() -> None:
        await asyncio.sleep(measure_from - loop.time())
        on_window(True)
        cpu["server"], cpu["client"] = _cpu_seconds(server_pid), time.process_time()
        await asyncio.sleep(end_at - loop.time())
        cpu["server"] = _cpu_seconds(server_pid) - cpu["server"]
        cpu["client"] = time.process_time() - cpu["client"]
        on_window(False)

    await asyncio.gather(window(), *(client(i) for i in range(args.clients)))
    ok = [(t, d) for t, d, good in samples if good]
    steady = [d for t, d in ok if measure_from <= t < end_at]
    last = max((t + d for t, d in ok), default=start_at)
    n = max(1, len(steady))
    return Phase(
        requests=len(steady),
        errors=sum(1 for _, _, good in samples if not good),
        rate=len(steady) / args.seconds,
        p50_ms=_percentile(steady, 0.5) * 1000,
        p99_ms=_percentile(steady, 0.99) * 1000,
        max_ms=max(steady, default=float("nan")) * 1000,
        whole_rate=len(ok) / max(1e-9, last - start_at),
        whole_p99_ms=_percentile([d for _, d in ok], 0.99) * 1000,
        server_cpu_ms=1000 * cpu["server"] / n,
        client_cpu_ms=1000 * cpu["client"] / n,
    )


def _get(path: str) -> Callable[[int, int], bytes]:
    raw = f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode()
    return lambda i, n: raw


def _submit(key: str) -> Callable[[int, int], bytes]:
    head = f"POST /v1/jobs HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {key}\r\n"
    head += "Content-Type: application/json\r\n"
    body = json.dumps(_job("NAME", dp=2), separators=(",", ":"))

    def request(i: int, n: int) -> bytes:
        content = body.replace("NAME", f"c{i}-{n}").encode()
        return (
            f"{head}Idempotency-Key: {i}-{n}\r\nContent-Length: {len(content)}\r\n\r\n".encode()
            + content
        )

    return request


# ---------------------------------------------------------------------------- one backend


@dataclass
class Result:
    backend: str
    clients: int
    seconds: float
    baseline: Phase  # GET /healthz
    submit: Phase  # POST /v1/jobs
    schedule_jobs: int
    schedule_p50_ms: float
    schedule_p99_ms: float

    @property
    def goal_met(self) -> bool:
        s = self.submit
        return s.rate >= GOAL_RATE and s.p99_ms < GOAL_P99_MS and s.errors == 0


def run_backend(backend: str, args: argparse.Namespace) -> Result:
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
    grpc_port, http_port = free_port(), free_port()
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
            if time.monotonic() > deadline or serve.poll() is not None:
                raise SystemExit(f"cpn serve did not start: see {tmp}/serve.log")
            time.sleep(0.2)
        key = subprocess.run(
            [*CPN, "keys", "create", "--tenant", "bench", "--database-url", url],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        agents.start()
        agents.ready.wait(60)
        time.sleep(1.5)  # the orchestration loop sees every site
        with httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as http:
            waits = _scheduling(http, args.jobs)
        baseline = asyncio.run(_load(http_port, _get("/healthz"), 200, args, serve.pid))
        profiler: list[subprocess.Popen[bytes]] = []

        def on_window(start: bool) -> None:
            if args.profile and start:
                spy = str(Path(sys.executable).with_name("py-spy"))
                out = f"{args.profile}-{backend}.txt"
                profiler.append(subprocess.Popen(
                    [spy, "record", "--pid", str(serve.pid), "--gil", "--threads", "--format",
                     "raw", "--rate", "250", "--duration", str(int(args.seconds)), "-o", out],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                ))  # fmt: skip

        submit = asyncio.run(_load(http_port, _submit(key), 201, args, serve.pid, on_window))
        for p in profiler:
            p.wait(60)
    finally:
        agents.stop.set()
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()
        log.close()
        if pg_name is not None:
            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{pg_name}" WITH (FORCE)')
    shutil.rmtree(tmp, ignore_errors=True)  # kept (with serve.log) only when the run failed
    return Result(
        backend=backend,
        clients=args.clients,
        seconds=args.seconds,
        baseline=baseline,
        submit=submit,
        schedule_jobs=len(waits),
        schedule_p50_ms=_percentile(waits, 0.5) * 1000,
        schedule_p99_ms=_percentile(waits, 0.99) * 1000,
    )


def _scheduling(http: httpx.Client, jobs: int) -> list[float]:
    """Submit-to-SCHEDULED of a 16-GPU job on the idle cluster, one job at a time."""
    waits = []
    for n in range(jobs):
        reply = http.post("/v1/jobs", json=_job(f"sched-{n}", dp=8))
        reply.raise_for_status()
        job_id = reply.json()["id"]
        deadline = time.monotonic() + 60
        while True:
            got = http.get(f"/v1/jobs/{job_id}").json()
            if got["scheduled_at"]:
                created = datetime.fromisoformat(got["created_at"])
                scheduled = datetime.fromisoformat(got["scheduled_at"])
                waits.append((scheduled - created).total_seconds())
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"job {job_id} was not scheduled in 60 s: {got['reason']}")
            time.sleep(0.005)
        http.post(f"/v1/jobs/{job_id}/cancel")
        while http.get("/v1/topology/reservations").json()["gpus"]:
            time.sleep(0.02)
    return waits


# ---------------------------------------------------------------------------- report


def _table(results: list[Result], args: argparse.Namespace, load: tuple[float, float]) -> Table:
    table = Table(
        title=f"job service: {SITES} sites × {GPUS} GPUs, {args.clients} clients, "
        f"{args.warmup:g} s warm-up + {args.seconds:g} s, {os.cpu_count()} cores, "
        f"load average {load[0]:.1f} before, {load[1]:.1f} after"
    )
    columns = ["backend", "/healthz req/s", "submissions/s", "÷ /healthz", "p50 ms", "p99 ms",
               "max ms", "whole run /s", "whole run p99 ms", "errors", "server CPU ms/sub",
               "client CPU ms/sub", "to SCHEDULED p50 ms", "p99 ms", "goal met"]  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    for r in results:
        s = r.submit
        table.add_row(
            r.backend,
            f"{r.baseline.rate:.0f}",
            f"{s.rate:.0f}",
            f"{s.rate / r.baseline.rate:.2f}" if r.baseline.rate else "-",
            f"{s.p50_ms:.1f}",
            f"{s.p99_ms:.1f}",
            f"{s.max_ms:.0f}",
            f"{s.whole_rate:.0f}",
            f"{s.whole_p99_ms:.1f}",
            str(s.errors + r.baseline.errors),
            f"{s.server_cpu_ms:.2f}",
            f"{s.client_cpu_ms:.2f}",
            f"{r.schedule_p50_ms:.0f}",
            f"{r.schedule_p99_ms:.0f}",
            "yes" if r.goal_met else "no",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--clients", type=int, default=16, help="connections (16)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window (10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before it (2)")
    parser.add_argument("--jobs", type=int, default=20, help="submit-to-SCHEDULED samples (20)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--profile", help="record the server with py-spy while submissions are measured, "
        "into PROFILE-<backend>.txt (collapsed stacks, threads holding the GIL)"
    )  # fmt: skip
    args = parser.parse_args()
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    load_before = os.getloadavg()[0]
    console = Console(stderr=True)
    results = []
    for backend in backends:
        with console.status(f"{backend}…"):
            results.append(run_backend(backend, args))
    load = (load_before, os.getloadavg()[0])
    if args.json:
        print(json.dumps([{**asdict(r), "goal_met": r.goal_met} for r in results], indent=2))
        return
    Console(width=max(Console().width, 200)).print(_table(results, args, load))
    if len(results) == 2 and results[0].submit.rate:
        sqlite, pg = results
        print(
            f"PostgreSQL ÷ SQLite: submissions/s {pg.submit.rate / sqlite.submit.rate:.2f}, "
            f"server CPU per submission {pg.submit.server_cpu_ms / sqlite.submit.server_cpu_ms:.2f}"
        )


if __name__ == "__main__":
    main()
