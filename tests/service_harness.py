"""`cpn serve` and agents as real processes, with API keys, for the job service's tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from cpn.client import ApiError, CpnClient
from tests.processes import CPN, Proc, agent_argv, free_port, serve_argv, wait_until, write_tokens


def tiny_job(name: str = "tiny", *, dp: int = 2, pp: int = 2, steps: int = 6, **extra: object):
    return {
        "name": name,
        "model": {"layers": 2, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 128},
        "train": {"global_batch": 4, "micro_batch": 1, "dtype": "fp32", "steps": steps,
                  "lr": 0.001},
        "parallel": {"dp": dp, "tp": 1, "pp": pp},
        "compression": {"wan": "none"},
        **extra,
    }  # fmt: skip


def make_key(db_url: str, tenant: str, *extra: str) -> str:
    out = subprocess.run(
        [*CPN, "keys", "create", "--tenant", tenant, "--database-url", db_url, *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip()


@dataclass
class Cluster:
    db_url: str
    http_port: int
    serve: Proc
    agents: dict[str, Proc]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def client(self, key: str) -> CpnClient:
        return CpnClient(self.url, key)


@contextmanager
def cluster(
    tmp: Path, gpus: dict[str, int], *serve_extra: str, env: dict[str, str] | None = None
) -> Iterator[Cluster]:
    """`cpn serve` on SQLite and one agent per site with that many virtual GPUs; returns
    once every site is in the live topology with its WAN links measured."""
    db_url = f"sqlite:///{tmp}/cpn.db"
    grpc_port, http_port = free_port(), free_port()
    tokens = write_tokens(tmp / "tokens.yaml")
    serve = Proc(
        serve_argv(db_url, tokens, grpc_port, http_port, "--lease-ttl", "10", *serve_extra),
        tmp / "serve.log",
        env={"CPN_SCHEDULE_INTERVAL_S": "0.2", "CPN_STOP_GRACE_S": "8", **(env or {})},
    )
    agents: dict[str, Proc] = {}
    try:
        wait_until(
            lambda: httpx.get(f"http://127.0.0.1:{http_port}/readyz", timeout=2).status_code == 200,
            60,
            "cpn serve to be ready",
            serve,
        )
        for site, n in gpus.items():
            agents[site] = Proc(
                agent_argv(
                    site, grpc_port, tmp, "--virtual-gpus", str(n), "--gpu-memory-gb", "16",
                    "--gpu-tflops", "10", "--probe-interval", "1",
                    "--probe-bytes", "65536",
                ),
                tmp / f"agent-{site}.log",
            )  # fmt: skip
        key = make_key(db_url, "ops", "--admin")
        with CpnClient(f"http://127.0.0.1:{http_port}", key) as admin:

            def ready() -> bool:
                try:
                    topo = admin.topology()
                except ApiError:  # no live site yet
                    return False
                pairs = len(gpus) * (len(gpus) - 1) // 2
                return len(topo.sites) == len(gpus) and len(topo.links) == pairs

            wait_until(ready, 90, "every site live with its WAN links measured", serve)
        yield Cluster(db_url, http_port, serve, agents)
    finally:
        for proc in agents.values():
            proc.stop()
        serve.stop()
