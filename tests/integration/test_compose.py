"""docker-compose.yml and the Dockerfile, checked without a Docker engine (none runs here):
the structure, that every `cpn` command and flag they use exists in the CLI, that the
image holds what the commands need, that the sites are `cpn demo`'s, and the very same
commands run as plain processes — service names replaced by loopback, the postgres
service by the local server — from the migration to the demo profile's job."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from cpn.control import SiteTokens
from cpn.demo.run import SITES, demo_job
from cpn.listen_ports import free_port
from tests.databases import PostgresDatabases
from tests.processes import CPN, Proc, sites, wait_until

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ("agent-beijing", "agent-shanghai", "agent-guiyang")
PG_URL = "postgresql://cpn:cpn@postgres:5432/cpn"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return doc


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def _cpn_commands(service: dict[str, Any]) -> list[list[str]]:
    """The `cpn` command lines a service runs: its command (the image's entrypoint is
    `cpn`), or each `cpn …` inside an `sh -c` script."""
    if service.get("entrypoint") == ["sh", "-c"]:
        script = service["command"][0].replace("$$", "$")
        parts = re.split(r"&&|\$\(|\)", script)
        return [shlex.split(p.strip())[1:] for p in parts if p.strip().startswith("cpn ")]
    return [[str(a) for a in service["command"]]]


def test_services_and_their_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"postgres", "migrate", "control", "demo", *AGENTS}
    assert services["postgres"]["image"].startswith("postgres:")
    # One image for every cpn service, with torch's CPU build (the sites' GPUs are
    # virtual; PyPI's Linux torch is the CUDA one, gigabytes).
    built = {name: svc for name, svc in services.items() if "build" in svc}
    assert set(built) == {"migrate", "control", "demo", *AGENTS}
    assert {svc["image"] for svc in built.values()} == {"cpn:local"}
    for svc in built.values():
        assert svc["build"]["context"] == "."
        assert "download.pytorch.org/whl/cpu" in svc["build"]["args"]["PIP_TORCH_ARGS"]
    # Migrations first, once; the control plane after them; agents after the control plane.
    assert services["migrate"]["command"][:2] == ["db", "upgrade"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    control = services["control"]
    assert control["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert control["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert "/readyz" in " ".join(control["healthcheck"]["test"])
    for name in AGENTS:
        agent = services[name]
        assert agent["command"][0] == "agent" and agent["build"]["context"] == "."
        assert agent["depends_on"]["control"]["condition"] == "service_healthy"
        assert _flag(agent["command"], "--control") == "control:50051"
        assert int(_flag(agent["command"], "--virtual-gpus")) > 0
        assert _flag(agent["command"], "--probe-port") in " ".join(agent["healthcheck"]["test"])
        volume, path = agent["volumes"][0].split(":")
        assert _flag(agent["command"], "--work-dir") == path and volume in compose["volumes"]
    # The demo job only with `--profile demo`, once every agent is healthy.
    demo = services["demo"]
    assert demo["profiles"] == ["demo"]
    assert {n: d["condition"] for n, d in demo["depends_on"].items()} == {
        n: "service_healthy" for n in AGENTS
    }
    assert all("profiles" not in s for n, s in services.items() if n != "demo")
    assert "pgdata" in compose["volumes"]


def test_the_sites_are_cpn_demos(compose: dict[str, Any]) -> None:
    """`cpn demo` (tests/integration/test_demo.py) runs this set-up as plain processes."""
    services = compose["services"]
    got = {}
    for name in AGENTS:
        cmd = services[name]["command"]
        got[_flag(cmd, "--site")] = (
            int(_flag(cmd, "--virtual-gpus")),
            _flag(cmd, "--gpu-model"),
            float(_flag(cmd, "--gpu-memory-gb")),
        )
    assert got == {s.name: (s.gpus, s.gpu_model, s.memory_gb) for s in SITES}
    job_file = services["demo"]["volumes"][0].split(":")[0]
    job = yaml.safe_load((ROOT / job_file).read_text())
    assert job == demo_job(job["train"]["steps"])


@cache
def _help(*sub: str) -> str:
    return subprocess.run(
        [*CPN, *sub, "--help"], capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout  # fmt: skip


def test_every_command_and_flag_exists(compose: dict[str, Any]) -> None:
    seen = set()
    for name, service in compose["services"].items():
        if "build" not in service:
            continue
        for command in _cpn_commands(service):
            words = [w for w in command if not w.startswith("-")]
            # The sub-command (and its own sub-command: db upgrade, keys create).
            sub = words[:2] if words[0] in ("db", "keys") else words[:1]
            helptext = _help(*sub)
            for flag in (w for w in command if w.startswith("--")):
                assert re.search(rf"{re.escape(flag)}\b", helptext), f"{name}: cpn {sub} {flag}"
            seen.add(" ".join(sub))
    assert seen == {"db upgrade", "serve", "agent", "keys create", "submit"}
    # A healthcheck's program exists in the image (python:3.11-slim has python, not curl).
    for name, service in compose["services"].items():
        if "build" in service and "healthcheck" in service:
            assert service["healthcheck"]["test"][:2] == ["CMD", "python"], name


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
    for mount in services["demo"]["volumes"]:
        assert (ROOT / mount.split(":")[0]).exists(), mount


def test_the_image_holds_what_the_commands_need() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (?!--from)(\S+)", dockerfile, flags=re.M)
    for source in copied:
        assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is missing"
    packages = {"cpn", "api", "agents", "proto", "migrations"}
    assert packages <= set(copied), "every package cpn installs must be copied"
    assert re.search(r'^ENTRYPOINT \["cpn"\]', dockerfile, flags=re.M)
    assert "torch==2.13.0" in dockerfile  # pinned, as in pyproject.toml
    # The dashboard's uPlot: the same version scripts/setup.sh vendors, from npm.
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    version = re.search(r"^UPLOT=(\S+)", setup, flags=re.M)
    assert version and f"ARG UPLOT={version.group(1)}" in dockerfile
    assert "COPY --from=ui /ui/vendor ./api/ui/vendor" in dockerfile
    assert "/var/lib/cpn" in dockerfile  # the agents' work volume, owned by their user


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


@pytest.mark.slow
def test_the_compose_commands_run_as_plain_processes(
    compose: dict[str, Any], postgres: PostgresDatabases, tmp_path: Path, procs: list[Proc]
) -> None:
    services = compose["services"]
    grpc_port, http = free_port(), free_port()
    db_url = postgres.create()  # the local server stands in for the postgres service
    mount = next(v for v in services["control"]["volumes"] if "site-tokens" in v)
    host_tokens, container_tokens, _ = mount.split(":")

    def local(command: list[str], work: Path | None = None) -> list[str]:
        out = []
        for original in command:
            arg = original.replace(container_tokens, str(ROOT / host_tokens))
            arg = arg.replace("control:50051", f"127.0.0.1:{grpc_port}")
            arg = db_url if arg == PG_URL else arg
            out.append(str(work) if work is not None and arg == "/var/lib/cpn" else arg)
        for flag, value in (("--grpc-port", grpc_port), ("--http-port", http), ("--probe-port", 0)):
            if flag in out:
                out[out.index(flag) + 1] = str(value)
        return out

    migrate = subprocess.run(
        [*CPN, *local(services["migrate"]["command"])], capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert migrate.returncode == 0 and "database at revision" in migrate.stdout, migrate.stderr
    control = local(services["control"]["command"])
    serve = Proc([*CPN, *control, "--host", "127.0.0.1"], tmp_path / "control.log")
    procs.append(serve)
    wait_until(lambda: "gRPC on" in serve.text(), 60, "the control service", serve)
    expected = {}
    for name in AGENTS:
        command = local(services[name]["command"], tmp_path / name)
        env = {k: str(v) for k, v in services[name]["environment"].items()}
        argv = [*CPN, *command, "--probe-host", "127.0.0.1", "--probe-interval", "1"]
        procs.append(Proc(argv, tmp_path / f"{name}.log", env=env))
        expected[_flag(command, "--site")] = int(_flag(command, "--virtual-gpus"))

    def all_measured() -> bool:
        got = sites(http)
        return set(got) == set(expected) and all(
            s["agents"][0]["alive"] and len(s["links"]) == len(expected) - 1 for s in got.values()
        )

    wait_until(all_measured, 90, "the three sites of docker-compose.yml, links measured", serve)
    view = sites(http)
    assert {name: len(s["nodes"][0]["gpus"]) for name, s in view.items()} == expected
    assert view["beijing"]["gpu_price_per_hour"] == 2.2  # the operator's setting, from the file
    # The demo profile: its script, with the service names and the mounted job made local,
    # a few steps only (the job's own 60 are for the real thing).
    script = services["demo"]["command"][0].replace("$$", "$")
    job_file = tmp_path / "gpt-demo.yaml"
    job = yaml.safe_load((ROOT / "examples" / "jobs" / "gpt-demo.yaml").read_text())
    job["train"]["steps"] = 4
    job_file.write_text(yaml.safe_dump(job))
    script = (
        script.replace(PG_URL, shlex.quote(db_url))
        .replace("http://control:8080", f"http://127.0.0.1:{http}")
        .replace("/etc/cpn/gpt-demo.yaml", str(job_file))
        .replace("/opt/cpn/scripts/", f"{ROOT}/scripts/")
    )
    venv_bin = str(Path(sys.executable).parent)
    done = subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}", "COLUMNS": "120"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "succeeded" in done.stdout, done.stdout[-3000:]
