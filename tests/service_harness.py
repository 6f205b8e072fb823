"""`cpn serve` and agents as real processes, with API keys, for the job service's tests."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from api.job_schemas import EventPublic
from cpn.client import ApiError, CpnClient
from cpn.listen_ports import free_port, free_port_block
from tests.processes import (
    CPN,
    Proc,
    agent_argv,
    serve_argv,
    wait_until,
    write_tokens,
)


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
        timeout=180,  # importing cpn takes a minute at load 20 on 2 cores
        check=True,
    )
    return out.stdout.strip()


@dataclass
class Cluster:
    db_url: str
    http_port: int
    serve: Proc
    agents: dict[str, Proc]
    serve_argv: list[str]
    serve_env: dict[str, str]
    tmp: Path
    #: How each agent was started, to start it again (restart_agent).
    agent_argvs: dict[str, list[str]] = field(default_factory=dict)
    agent_envs: dict[str, dict[str, str]] = field(default_factory=dict)

    def restart_agent(
        self, site: str, sig: signal.Signals = signal.SIGKILL, down_s: float = 0.0
    ) -> Proc:
        """Kill a site's agent (SIGKILL: no goodbye) and start it again, same flags, after
        `down_s` seconds (a site that is down for a while)."""
        old = self.agents[site]
        old.stop(sig)
        time.sleep(down_s)
        self.agents[site] = Proc(self.agent_argvs[site], old.log, env=self.agent_envs.get(site))
        return self.agents[site]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def client(self, key: str) -> CpnClient:
        return CpnClient(self.url, key)

    def restart_serve(self) -> None:
        """Start `cpn serve` again (after it was stopped or killed), on the same ports and
        database; returns once it is ready."""
        assert not self.serve.alive()
        self.serve = Proc(self.serve_argv, self.tmp / "serve.log", env=self.serve_env)
        _wait_ready(self.http_port, self.serve)


def _wait_ready(http_port: int, serve: Proc) -> None:
    wait_until(
        lambda: httpx.get(f"http://127.0.0.1:{http_port}/readyz", timeout=2).status_code == 200,
        120,  # a loaded CI machine takes a minute to import and start it
        "cpn serve to be ready",
        serve,
    )


@contextmanager
def cluster(
    tmp: Path,
    gpus: dict[str, int],
    *serve_extra: str,
    env: dict[str, str] | None = None,
    db_url: str | None = None,
    lease_ttl: float = 10,
    agent_extra: dict[str, list[str]] | None = None,
    agent_env: dict[str, dict[str, str]] | None = None,
    every_agent: tuple[str, ...] = (),
    agent_prefix: dict[str, list[str]] | None = None,
    control_host: str | None = None,
) -> Iterator[Cluster]:
    """`cpn serve` (on SQLite unless `db_url` says otherwise) and one agent per site with
    that many virtual GPUs; returns once every site is in the live topology with its WAN
    links measured. `every_agent`: more flags for every agent; `agent_extra`: for one
    site's agent (`--backend slurm ...`), `agent_env` its environment, `agent_prefix` a
    command it runs under (`ip netns exec NS`: a site in a network namespace, which then
    reaches `cpn serve` at `control_host`; serve listens on every address then)."""
    db_url = db_url or f"sqlite:///{tmp}/cpn.db"
    grpc_port, http_port = free_port(), free_port()
    tokens = write_tokens(tmp / "tokens.yaml")
    heartbeat = min(3.0, lease_ttl / 4)
    argv = serve_argv(
        db_url, tokens, grpc_port, http_port, "--lease-ttl", f"{lease_ttl:g}",
        "--heartbeat-interval", f"{heartbeat:g}", *serve_extra,
        *(("--host", "0.0.0.0") if control_host else ()),
    )  # fmt: skip
    # Rendezvous ports of this cluster's own: other test runs on the machine use the
    # default range on 127.0.0.1 too.
    base = free_port_block(64)
    serve_env = {
        "CPN_SCHEDULE_INTERVAL_S": "0.2",
        "CPN_STOP_GRACE_S": "8",
        "CPN_RENDEZVOUS_PORT_MIN": str(base),
        "CPN_RENDEZVOUS_PORT_MAX": str(base + 63),
        **(env or {}),
    }
    serve = Proc(argv, tmp / "serve.log", env=serve_env)
    agents: dict[str, Proc] = {}
    made = Cluster(
        db_url, http_port, serve, agents, argv, serve_env, tmp, agent_envs=dict(agent_env or {})
    )
    try:
        _wait_ready(http_port, serve)
        for site, n in gpus.items():
            made.agent_argvs[site] = [*(agent_prefix or {}).get(site, []), *agent_argv(
                site, grpc_port, tmp, "--virtual-gpus", str(n), "--gpu-memory-gb", "16",
                "--gpu-tflops", "10", "--probe-interval", "1", "--probe-bytes", "65536",
                *every_agent, *(agent_extra or {}).get(site, []),
                *(("--control", f"{control_host}:{grpc_port}") if control_host else ()),
            )]  # fmt: skip
            agents[site] = Proc(
                made.agent_argvs[site], tmp / f"agent-{site}.log", env=(agent_env or {}).get(site)
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

            wait_until(ready, 180, "every site live with its WAN links measured", serve)
        yield made
    finally:
        for proc in agents.values():
            proc.stop()
        made.serve.stop()  # the one running now (a test may have restarted it)


def rescheduled(client: CpnClient, job_id: str, timeout: float) -> EventPublic:
    """The job's first move to RESCHEDULING, once it happened (from its events: it may be
    planned again within milliseconds, too fast to see in its state)."""

    def moved() -> EventPublic | None:
        return next(
            (
                e
                for e in client.events(job_id)
                if e.kind == "job_state" and e.data.get("to") == "rescheduling"
            ),
            None,
        )

    found: EventPublic = wait_until(moved, timeout, f"job {job_id} to go rescheduling")
    return found
