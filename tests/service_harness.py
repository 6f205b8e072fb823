"""`cpn serve` and agents as real processes, with API keys, for the job service's tests."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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
    #: How each agent was started, to start it again (restart_agent).
    agent_argvs: dict[str, list[str]] = field(default_factory=dict)
    agent_envs: dict[str, dict[str, str]] = field(default_factory=dict)

    def restart_agent(self, site: str, sig: signal.Signals = signal.SIGKILL) -> Proc:
        """Kill a site's agent (SIGKILL: no goodbye) and start it again, same flags."""
        old = self.agents[site]
        old.stop(sig)
        self.agents[site] = Proc(self.agent_argvs[site], old.log, env=self.agent_envs.get(site))
        return self.agents[site]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def client(self, key: str) -> CpnClient:
        return CpnClient(self.url, key)


@contextmanager
def cluster(
    tmp: Path,
    gpus: dict[str, int],
    *serve_extra: str,
    env: dict[str, str] | None = None,
    agent_extra: dict[str, list[str]] | None = None,
    agent_env: dict[str, dict[str, str]] | None = None,
) -> Iterator[Cluster]:
    """`cpn serve` on SQLite and one agent per site with that many virtual GPUs; returns
    once every site is in the live topology with its WAN links measured. `agent_extra`:
    more flags for a site's agent (`--backend slurm ...`), `agent_env` its environment."""
    db_url = f"sqlite:///{tmp}/cpn.db"
    grpc_port, http_port = free_port(), free_port()
    tokens = write_tokens(tmp / "tokens.yaml")
    serve = Proc(
        serve_argv(db_url, tokens, grpc_port, http_port, "--lease-ttl", "10", *serve_extra),
        tmp / "serve.log",
        env={"CPN_SCHEDULE_INTERVAL_S": "0.2", "CPN_STOP_GRACE_S": "8", **(env or {})},
    )
    agents: dict[str, Proc] = {}
    argvs: dict[str, list[str]] = {}
    try:
        wait_until(
            lambda: httpx.get(f"http://127.0.0.1:{http_port}/readyz", timeout=2).status_code == 200,
            60,
            "cpn serve to be ready",
            serve,
        )
        for site, n in gpus.items():
            argvs[site] = agent_argv(
                site, grpc_port, tmp, "--virtual-gpus", str(n), "--gpu-memory-gb", "16",
                "--gpu-tflops", "10", "--probe-interval", "1",
                "--probe-bytes", "65536", *(agent_extra or {}).get(site, []),
            )  # fmt: skip
            agents[site] = Proc(
                argvs[site], tmp / f"agent-{site}.log", env=(agent_env or {}).get(site)
            )
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
        yield Cluster(db_url, http_port, serve, agents, argvs, dict(agent_env or {}))
    finally:
        for proc in agents.values():
            proc.stop()
        serve.stop()
