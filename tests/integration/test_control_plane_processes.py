"""The issue's end-to-end scenario with real processes on loopback: `cpn serve` and three
`cpn agent`s with virtual GPUs; an agent killed is declared lost within its lease TTL plus
a grace, comes back with the same identity, and all agents re-register by themselves when
the control plane restarts."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpn.listen_ports import free_port
from tests.processes import Proc, agent_argv, serve_argv, sites, wait_until, write_tokens

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TTL = 3.0
GRACE = 4.0  # reaper pass, HTTP poll, and a busy 2-core machine


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


def _agent_extra(site: str) -> list[str]:
    # A long probe interval on purpose: agents must probe a new peer site when they learn
    # of it, not wait for the next round.
    extra = ["--virtual-gpus", "4", "--gpu-model", "A100-80G", "--gpu-memory-gb", "80",
             "--probe-interval", "60", "--probe-bytes", "262144"]  # fmt: skip
    if site == "a":
        extra += ["--sysfs-root", str(FIXTURES / "sysfs-infiniband")]
    return extra


def _alive(http: int, site: str) -> bool:
    return bool(sites(http)[site]["agents"][0]["alive"])


def test_three_sites_loss_comeback_and_control_plane_restart(
    tmp_path: Path, procs: list[Proc]
) -> None:
    tokens = write_tokens(tmp_path / "tokens.yaml")
    db = f"sqlite:///{tmp_path}/cpn.db"
    grpc_port, http = free_port(), free_port()
    serve_cmd = serve_argv(
        db, tokens, grpc_port, http, "--lease-ttl", str(TTL), "--heartbeat-interval", "0.5"
    )

    def start(argv: list[str], name: str) -> Proc:
        proc = Proc(argv, tmp_path / f"{name}.log")
        procs.append(proc)
        return proc

    serve = start(serve_cmd, "serve")
    wait_until(lambda: "gRPC on" in serve.text(), 60, "cpn serve to be ready", serve)
    agents = {
        s: start(agent_argv(s, grpc_port, tmp_path, *_agent_extra(s)), f"agent-{s}") for s in "abc"
    }

    def all_measured() -> bool:
        got = sites(http)
        return len(got) == 3 and all(
            s["agents"] and s["agents"][0]["alive"] and len(s["links"]) == 2 for s in got.values()
        )

    wait_until(all_measured, 120, "3 live sites, each with 2 measured links", serve)
    view = sites(http)
    for name, site in view.items():
        [node] = site["nodes"]
        assert node["name"] == f"{name}-node" and node["agent_id"] == f"{name}-{name}-node"
        assert [
            (g["index"], g["model"], g["memory_gb"], g["source"], g["status"]) for g in node["gpus"]
        ] == [(i, "A100-80G", 80.0, "virtual", "available") for i in range(4)]
        assert {link["peer"] for link in site["links"]} == set("abc") - {name}
        assert all(link["bandwidth_gbps"] > 0 and link["rtt_ms"] > 0 for link in site["links"])
    nics = [
        (n["device"], n["transport"], n["rate_gbps"], n["state"])
        for n in view["a"]["nodes"][0]["rdma_nics"]
    ]
    assert nics == [
        ("mlx5_0", "infiniband", 200.0, "active"),
        ("mlx5_1", "infiniband", 10.0, "down"),
    ]

    # Kill one agent without warning: lost within the lease TTL plus a grace.
    agents["b"].stop(signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: not _alive(http, "b"), TTL + GRACE + 10, "site b's agent to be lost")
    assert time.monotonic() - killed <= TTL + GRACE
    wait_until(
        lambda: {g["status"] for g in sites(http)["b"]["nodes"][0]["gpus"]} == {"lost"},
        10,
        "b's GPUs lost",
    )
    assert sites(http)["b"]["agents"][0]["status"] == "lost"
    assert _alive(http, "a") and _alive(http, "c")

    # Restart it: alive again, same identity, its GPUs back.
    agents["b"] = start(agent_argv("b", grpc_port, tmp_path, *_agent_extra("b")), "agent-b-again")
    wait_until(lambda: _alive(http, "b"), 60, "site b's agent to come back", agents["b"])
    [agent_b] = sites(http)["b"]["agents"]
    assert (agent_b["agent_id"], agent_b["registrations"]) == ("b-b-node", 2)
    assert {g["status"] for g in sites(http)["b"]["nodes"][0]["gpus"]} == {"available"}

    # Restart the control plane: every agent registers again by itself.
    before = {name: s["agents"][0]["registrations"] for name, s in sites(http).items()}
    assert serve.stop() == 0
    serve = start(serve_cmd, "serve-again")
    wait_until(lambda: "gRPC on" in serve.text(), 60, "cpn serve to be ready again", serve)

    def reregistered() -> bool:
        now = sites(http)
        return all(
            now[n]["agents"][0]["alive"] and now[n]["agents"][0]["registrations"] == before[n] + 1
            for n in "abc"
        )

    wait_until(reregistered, 60, "all agents to register again", serve)
    assert all(a.alive() for a in agents.values())
    assert (
        "register again" in agents["a"].text() or "registered as a/a-a-node" in agents["a"].text()
    )
