"""Control-plane benchmark: agent heartbeats per second and their latency, SQLite and
PostgreSQL, against a real `cpn serve` process over real gRPC channels.

    .venv/bin/python bench/control_plane.py                     # both backends, defaults
    .venv/bin/python bench/control_plane.py --backend sqlite --agents 500 --rate 3000
    .venv/bin/python bench/control_plane.py --mode unary        # one unary call per beat
    .venv/bin/python bench/control_plane.py --json              # JSON instead of a table

For each backend it starts `cpn serve` on a fresh database (a temporary SQLite file, or a
new PostgreSQL database dropped afterwards), then `--clients` processes that simulate
`--agents` agents between them. Every simulated agent has its own gRPC channel, registers
an inventory (one node, 8 GPUs) with its site's token, then heartbeats open-loop at its
share of `--rate` (staggered; per-GPU utilisation in every heartbeat) for `--seconds`
after `--warmup`. `--mode stream` (default) sends heartbeats on one HeartbeatStream per
agent, as `cpn agent` does; `--mode unary` makes one Heartbeat call per beat.

Latency is measured per heartbeat on the client, send to reply; the rate counts replies
inside the window. CPU is measured too (server: /proc over the window; clients: their own
process time), per heartbeat, because on a shared machine the latency depends on what
else runs, and the CPU cost does much less. Target (issue 3): ≥ 2000 heartbeats/s with p99
< 50 ms on a 2-core machine, clients included.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import psycopg
from grpc import aio
from rich.console import Console
from rich.table import Table

from cpn.listen_ports import free_port  # the one probe for a free port
from proto.cpn.v1 import agent_pb2 as pb
from proto.cpn.v1 import agent_pb2_grpc

PG_ADMIN = os.environ.get("CPN_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
SITES = 8
GPUS = 8
CHANNEL_OPTIONS = [("grpc.http2.bdp_probe", 0)]


def _token(site: int) -> str:
    return f"bench-token-site-{site:03d}"


@dataclass
class Result:
    backend: str
    mode: str
    agents: int
    clients: int
    target_rate: float
    seconds: float
    heartbeats: int
    errors: int
    rate: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    register_p50_ms: float
    server_cpu_us_per_heartbeat: float
    client_cpu_us_per_heartbeat: float


@dataclass
class Window:
    """One client process's measurements."""

    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    register_ms: list[float] = field(default_factory=list)
    cpu_s: float = 0.0


# ---------------------------------------------------------------------------- client side


@dataclass
class SimAgent:
    stub: Any
    site: int
    index: int

    @property
    def metadata(self) -> tuple[tuple[str, str]]:
        return (("authorization", f"Bearer {_token(self.site)}"),)

    async def register(self, out: Window) -> pb.HeartbeatRequest:
        node = f"node-{self.index}"
        inventory = pb.Inventory(
            nodes=[
                pb.Node(
                    name=node,
                    gpu_count=GPUS,
                    gpus=[
                        pb.Gpu(index=i, model="H100", memory_gb=80, source=pb.GPU_SOURCE_VIRTUAL)
                        for i in range(GPUS)
                    ],
                )
            ]
        )
        request = pb.RegisterRequest(
            site=f"s{self.site}",
            agent_id=f"agent-{self.index}",
            version="bench",
            inventory=inventory,
        )
        started = time.perf_counter()
        reply = await self.stub.Register(request, metadata=self.metadata, timeout=120)
        out.register_ms.append((time.perf_counter() - started) * 1000)
        usage = [
            pb.GpuUsage(node=node, index=i, utilisation=0.9, memory_used_gb=40) for i in range(GPUS)
        ]
        return pb.HeartbeatRequest(
            site=f"s{self.site}",
            agent_id=f"agent-{self.index}",
            lease_id=reply.lease_id,
            health=pb.HEALTH_OK,
            gpus=usage,
            peers_version=reply.peers_version,
        )

    async def heartbeats(
        self,
        request: pb.HeartbeatRequest,
        mode: str,
        interval: float,
        start: float,
        measure_from: float,
        stop: float,
        out: Window,
    ) -> None:
        loop = asyncio.get_running_loop()
        stream = self.stub.HeartbeatStream(metadata=self.metadata) if mode == "stream" else None
        # Open loop: beat n is due at start + offset + n·interval, whether or not late.
        due = start + (self.index % 997) / 997 * interval
        try:
            while True:
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if loop.time() >= stop:
                    return
                sent = time.perf_counter()
                counted = loop.time() >= measure_from
                try:
                    if stream is not None:
                        await stream.write(request)
                        reply = await stream.read()
                    else:
                        reply = await self.stub.Heartbeat(
                            request, metadata=self.metadata, timeout=10
                        )
                    request.peers_version = reply.peers_version
                    if counted and loop.time() < stop:
                        out.latencies_ms.append((time.perf_counter() - sent) * 1000)
                except grpc.RpcError:
                    out.errors += counted
                    return
                due += interval
        finally:
            if stream is not None:
                await stream.done_writing()


async def _client(
    address: str, indices: list[int], mode: str, interval: float, warmup: float, seconds: float,
    q: Any,
) -> Window:  # fmt: skip
    out = Window()
    channels = [aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in indices]
    agents = [
        SimAgent(agent_pb2_grpc.AgentServiceStub(c), i % SITES, i)
        for c, i in zip(channels, indices, strict=True)
    ]
    # Everyone registers first (all at once, so that figure is mostly queueing), then the
    # heartbeat schedule starts.
    requests = await asyncio.gather(*(a.register(out) for a in agents))
    gc.freeze()  # the long-lived set-up objects: out of the collector's way while measuring
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.5
    measure_from = start + warmup
    stop = measure_from + seconds
    tasks = [
        asyncio.create_task(a.heartbeats(r, mode, interval, start, measure_from, stop, out))
        for a, r in zip(agents, requests, strict=True)
    ]
    await asyncio.sleep(max(0.0, measure_from - loop.time()))
    q.put(("window", None))  # the parent samples the server's CPU time now...
    cpu0 = time.process_time()
    await asyncio.gather(*tasks)
    out.cpu_s = time.process_time() - cpu0
    q.put(("window-end", None))  # ...and when every client has said this
    for c in channels:
        await c.close()
    return out


def _client_process(
    address: str, indices: list[int], mode: str, interval: float, warmup: float, seconds: float,
    q: Any,
) -> None:  # fmt: skip
    window = asyncio.run(_client(address, indices, mode, interval, warmup, seconds, q))
    q.put(("result", window))


# ---------------------------------------------------------------------------- server side


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pg_create() -> tuple[str, str]:
    name = f"cpn_bench_{secrets.token_hex(4)}"
    with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name, PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"


def _pg_drop(name: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _start_server(url: str, tokens: Path, port: int, interval: float) -> subprocess.Popen[str]:
    argv = [
        sys.executable, "-m", "cpn", "serve", "--database-url", url, "--site-tokens", str(tokens),
        "--grpc-port", str(port), "--http-port", "0", "--host", "127.0.0.1",
        "--log-level", "warning", "--lease-ttl", str(max(10.0, 4 * interval)),
        "--heartbeat-interval", str(interval),
    ]  # fmt: skip
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert server.stdout is not None
    line = server.stdout.readline()
    if "gRPC on" not in line:
        err = server.stderr.read() if server.stderr else ""
        raise SystemExit(f"cpn serve did not start: {line}{err}")
    return server


def run(args: argparse.Namespace, backend: str) -> Result:
    tmp = Path(tempfile.mkdtemp(prefix="cpn-bench-"))
    tokens = tmp / "tokens.yaml"
    tokens.write_text("".join(f"s{i}: {_token(i)}\n" for i in range(SITES)))
    pg_name = None
    if backend == "sqlite":
        url = f"sqlite:///{tmp}/bench.db"
    else:
        pg_name, url = _pg_create()
    port = free_port()
    interval = args.agents / args.rate
    server = _start_server(url, tokens, port, interval)
    windows: list[Window] = []
    cpu_start = cpu_end = 0.0
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        shares = [list(range(args.agents))[i :: args.clients] for i in range(args.clients)]
        procs = [
            ctx.Process(
                target=_client_process,
                args=(
                    f"127.0.0.1:{port}",
                    share,
                    args.mode,
                    interval,
                    args.warmup,
                    args.seconds,
                    q,
                ),
            )
            for share in shares
        ]
        for p in procs:
            p.start()
        # Server CPU over the window: from the first client's start to the last one's end.
        starts = ends = 0
        while len(windows) < len(procs):
            kind, payload = q.get(timeout=args.seconds + args.warmup + 600)
            if kind == "window":
                starts += 1
                if starts == 1:
                    cpu_start = _process_cpu_s(server.pid)
            elif kind == "window-end":
                ends += 1
                if ends == len(procs):
                    cpu_end = _process_cpu_s(server.pid)
            else:
                windows.append(payload)
        for p in procs:
            p.join(30)
    finally:
        server.terminate()
        server.wait(30)
        if pg_name is not None:
            _pg_drop(pg_name)
    lat = sorted(x for w in windows for x in w.latencies_ms)
    reg = [x for w in windows for x in w.register_ms]

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else float("nan")

    beats = max(1, len(lat))
    return Result(
        backend=backend,
        mode=args.mode,
        agents=args.agents,
        clients=args.clients,
        target_rate=args.rate,
        seconds=args.seconds,
        heartbeats=len(lat),
        errors=sum(w.errors for w in windows),
        rate=len(lat) / args.seconds,
        p50_ms=pct(0.50),
        p99_ms=pct(0.99),
        p999_ms=pct(0.999),
        max_ms=lat[-1] if lat else float("nan"),
        register_p50_ms=statistics.median(reg) if reg else float("nan"),
        server_cpu_us_per_heartbeat=1e6 * (cpu_end - cpu_start) / beats,
        client_cpu_us_per_heartbeat=1e6 * sum(w.cpu_s for w in windows) / beats,
    )


def _table(results: list[Result], args: argparse.Namespace) -> Table:
    table = Table(
        title=f"heartbeats ({args.mode}): {args.agents} agents, {args.clients} client "
        f"processes, {args.seconds:g} s, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    columns = ["backend", "offered/s", "achieved/s", "p50 ms", "p99 ms", "p99.9 ms", "max ms",
               "errors", "server CPU µs/hb", "client CPU µs/hb", "target met"]  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    for r in results:
        met = r.rate >= 2000 and r.p99_ms < 50 and r.errors == 0
        table.add_row(
            r.backend,
            f"{r.target_rate:.0f}",
            f"{r.rate:.0f}",
            f"{r.p50_ms:.2f}",
            f"{r.p99_ms:.2f}",
            f"{r.p999_ms:.2f}",
            f"{r.max_ms:.1f}",
            str(r.errors),
            f"{r.server_cpu_us_per_heartbeat:.0f}",
            f"{r.client_cpu_us_per_heartbeat:.0f}",
            "yes" if met else "no",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--mode", choices=["stream", "unary"], default="stream")
    parser.add_argument("--agents", type=int, default=400, help="simulated agents (400)")
    parser.add_argument("--rate", type=float, default=2500, help="heartbeats/s offered (2500)")
    parser.add_argument("--seconds", type=float, default=10, help="measuring window (10)")
    parser.add_argument("--warmup", type=float, default=3, help="seconds before measuring (3)")
    parser.add_argument("--clients", type=int, default=2, help="client processes (2)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    console = Console(stderr=True)
    results = []
    for backend in backends:
        what = f"{backend}: {args.agents} agents, {args.rate:g} heartbeats/s ({args.mode})"
        with console.status(f"{what}, {args.warmup + args.seconds:g} s…"):
            results.append(run(args, backend))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
        return
    Console(width=max(Console().width, 160)).print(_table(results, args))


if __name__ == "__main__":
    main()
