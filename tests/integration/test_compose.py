"""docker-compose.yml and the Dockerfile, checked without a Docker engine: the structure,
that the image holds what the commands need, and the very same commands run as plain
processes (service names replaced by loopback, the postgres service by the local server)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cpn.control import SiteTokens
from tests.databases import PostgresDatabases
from tests.processes import CPN, Proc, free_port, sites, wait_until

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ("agent-beijing", "agent-shanghai", "agent-guiyang")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return doc


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_services_and_their_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"postgres", "control", *AGENTS}
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["control"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in AGENTS:
        agent = services[name]
        assert agent["command"][0] == "agent" and agent["build"] == "."
        assert agent["depends_on"]["control"]["condition"] == "service_healthy"
        assert _flag(agent["command"], "--control") == "control:50051"
        assert int(_flag(agent["command"], "--virtual-gpus")) > 0


def test_tokens_and_mounts_agree(compose: dict[str, Any]) -> None:
    services = compose["services"]
    control = services["control"]["command"]
    mount = next(v for v in services["control"]["volumes"] if "site-tokens" in v)
    host_path, container_path, _ = mount.split(":")
    assert _flag(control, "--site-tokens") == container_path
    tokens = SiteTokens.load(ROOT / host_path)
    for name in AGENTS:
        agent = services[name]
        site = _flag(agent["command"], "--site")
        assert tokens.site_for(agent["environment"]["CPN_AGENT_TOKEN"]) == site
    published = {p.split(":")[1] for p in services["control"]["ports"]}
    assert published == {_flag(control, "--grpc-port"), _flag(control, "--http-port")}


def test_the_image_holds_what_the_commands_need() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (\S+)", dockerfile, flags=re.M)
    for source in copied:
        assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is missing"
    packages = {"cpn", "api", "agents", "proto", "migrations"}
    assert packages <= set(copied), "every package cpn installs must be copied"
    assert re.search(r'^ENTRYPOINT \["cpn"\]', dockerfile, flags=re.M)
    assert "torch==2.13.0" in dockerfile  # pinned, as in pyproject.toml


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


def test_the_compose_commands_run_as_plain_processes(
    compose: dict[str, Any], postgres: PostgresDatabases, tmp_path: Path, procs: list[Proc]
) -> None:
    services = compose["services"]
    grpc_port, http = free_port(), free_port()
    mount = next(v for v in services["control"]["volumes"] if "site-tokens" in v)
    host_tokens, container_tokens, _ = mount.split(":")

    def local(command: list[str]) -> list[str]:
        out = []
        for original in command:
            arg = original.replace(container_tokens, str(ROOT / host_tokens))
            arg = arg.replace("control:50051", f"127.0.0.1:{grpc_port}")
            if arg.startswith("postgresql://"):
                arg = postgres.create()  # the local server stands in for the postgres service
            out.append(arg)
        for flag, value in (("--grpc-port", grpc_port), ("--http-port", http), ("--probe-port", 0)):
            if flag in out:
                out[out.index(flag) + 1] = str(value)
        return out

    control = local(services["control"]["command"])
    serve = Proc([*CPN, *control, "--host", "127.0.0.1"], tmp_path / "control.log")
    procs.append(serve)
    wait_until(lambda: "gRPC on" in serve.text(), 60, "the control service", serve)
    expected = {}
    for name in AGENTS:
        command = local(services[name]["command"])
        env = {k: str(v) for k, v in services[name]["environment"].items()}
        argv = [*CPN, *command, "--probe-host", "127.0.0.1", "--work-dir", str(tmp_path / name)]
        procs.append(Proc(argv, tmp_path / f"{name}.log", env=env))
        expected[_flag(command, "--site")] = int(_flag(command, "--virtual-gpus"))

    def all_alive() -> bool:
        got = sites(http)
        return set(got) == set(expected) and all(s["agents"][0]["alive"] for s in got.values())

    wait_until(all_alive, 90, "the three sites of docker-compose.yml", serve)
    view = sites(http)
    assert {name: len(s["nodes"][0]["gpus"]) for name, s in view.items()} == expected
    assert view["beijing"]["gpu_price_per_hour"] == 2.2  # the operator's setting, from the file
