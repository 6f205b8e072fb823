"""`cpn db`, `cpn serve` and `cpn agent` as an operator meets them: real processes, one
clear line and exit status 2 for every mistake, never a traceback."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cpn.control.validation import is_host_port
from cpn.registry.migrate import head_revision
from tests.control_harness import control_server
from tests.processes import TOKENS, write_tokens

CPN = [sys.executable, "-m", "cpn"]


def cpn(
    *args: str | Path, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CPN, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )


def _one_line_error(out: subprocess.CompletedProcess[str], words: str) -> None:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and words in errors[0], out.stderr


def test_db_upgrade_current_downgrade(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/reg.db"
    head = head_revision()  # the newest migration in migrations/versions
    versions = Path(__file__).resolve().parents[2] / "migrations" / "versions"
    assert head == max(p.name[:4] for p in versions.glob("0*.py"))
    out = cpn("db", "upgrade", "--database-url", url)
    assert out.returncode == 0 and f"database at revision {head}" in out.stdout, out.stderr
    assert cpn("db", "current", "--database-url", url).stdout.strip() == f"{head}: up to date"
    out = cpn("db", "downgrade", "base", "--database-url", url)
    assert out.returncode == 0 and "base (empty)" in out.stdout
    assert f"behind (newest is {head})" in cpn("db", "current", "--database-url", url).stdout


def test_db_url_from_the_environment(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/env.db"
    env = {**os.environ, "CPN_DATABASE_URL": url}
    out = subprocess.run(
        [*CPN, "db", "upgrade"], capture_output=True, text=True, timeout=120, check=False, env=env
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "env.db").exists()


@pytest.mark.parametrize(
    ("url", "words"),
    [
        (
            "postgresql://postgres@127.0.0.1:1/nowhere",
            "database postgresql+psycopg://postgres@127.0.0.1:1/nowhere:",
        ),
        ("mysql://root@localhost/x", "'mysql' is not supported"),
        ("not a url", "cannot parse"),
        ("sqlite:////nonexistent-dir/x/y.db", "unable to open database file"),
    ],
)
def test_db_bad_urls(url: str, words: str) -> None:
    _one_line_error(cpn("db", "upgrade", "--database-url", url), words)


def test_a_file_that_is_no_database_and_an_unknown_revision(tmp_path: Path) -> None:
    """Every database error the driver raises is one line (outside review: "file is not a
    database" and Alembic's unknown revision were tracebacks)."""
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"\xff\xfe" * 64)
    url = f"sqlite:///{junk}"
    for args in (("db", "upgrade"), ("keys", "list"), ("db", "current")):
        _one_line_error(
            cpn(*args, "--database-url", url), f"database {url}: file is not a database"
        )
    fresh = f"sqlite:///{tmp_path}/fresh.db"
    out = cpn("db", "downgrade", "bogus", "--database-url", fresh)
    _one_line_error(out, "revision 'bogus': Can't locate revision identified by 'bogus'")
    out = cpn("keys", "create", "--tenant", "t", "--gpu-quota", str(2**64), "--database-url", fresh)
    assert out.returncode == 2 and "--gpu-quota" in out.stderr and "Traceback" not in out.stderr


def test_serve_refuses_bad_input(tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "tokens.yaml")
    db = ["--database-url", f"sqlite:///{tmp_path}/s.db", "--host", "127.0.0.1"]
    _one_line_error(cpn("serve", "--site-tokens", tmp_path / "missing.yaml", *db), "no such file")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: same-token\nb: same-token\n")
    _one_line_error(cpn("serve", "--site-tokens", bad, *db), "same token as site 'a'")
    out = cpn(
        "serve", "--site-tokens", tokens, *db, "--lease-ttl", "2", "--heartbeat-interval", "5"
    )
    _one_line_error(out, "heartbeat interval (5 s) must be shorter than the lease TTL (2 s)")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = cpn("serve", "--site-tokens", tokens, *db, "--http-port", port, "--grpc-port", "0")
        _one_line_error(out, f"--http-port: cannot listen on 127.0.0.1:{port}")
        out = cpn("serve", "--site-tokens", tokens, *db, "--grpc-port", port, "--http-port", "0")
        _one_line_error(out, f"--grpc-port: cannot listen on 127.0.0.1:{port}")


def test_agent_refuses_bad_flags() -> None:
    _one_line_error(
        cpn("agent", "--site", "a", "--control", "nowhere", "--token", "t"), "--control"
    )
    _one_line_error(cpn("agent", "--site", "a b", "--control", "h:1", "--token", "t"), "--site")
    out = cpn("agent", "--site", "a", "--control", "h:1,127.0.0.1:99999", "--token", "t")
    _one_line_error(
        out, "--control: '127.0.0.1:99999': expected HOST:PORT[,HOST:PORT…], port 1–65535"
    )
    out = cpn(
        "agent", "--site", "a", "--control", "h:1", "--token", "t", "--worker-command", "run {gpu}"
    )
    _one_line_error(out, "unknown placeholder {gpu}")


@pytest.mark.parametrize(
    ("address", "ok"),
    [
        ("127.0.0.1:50051", True),
        ("control.example:1", True),
        ("[2001:db8::1]:65535", True),
        ("127.0.0.1:99999", False),  # gRPC would dial port 99999 mod 65536
        ("127.0.0.1:0", False),
        ("h:", False),
        (":50051", False),
        ("h:+1", False),
        ("h:\u0661", False),  # a non-ASCII digit
        ("[fe80::1%eth0]:1", False),
        ("a b:1", False),
    ],
)
def test_the_one_address_check(address: str, ok: bool) -> None:
    assert is_host_port(address) is ok


def test_an_agent_with_a_wrong_token_stops_with_the_reason(tmp_path: Path) -> None:
    with control_server(f"sqlite:///{tmp_path}/c.db") as srv:
        common = ["--control", f"127.0.0.1:{srv.server.port}", "--virtual-gpus", "1",
                  "--probe-host", "127.0.0.1", "--work-dir", str(tmp_path)]  # fmt: skip
        out = cpn("agent", "--site", "a", "--token", "not-a-token", *common, timeout=60)
        _one_line_error(out, "refused the agent: UNAUTHENTICATED: invalid token")
        out = cpn("agent", "--site", "a", "--token", TOKENS["b"], *common, timeout=60)
        _one_line_error(out, "PERMISSION_DENIED: site: this token is for site 'b', not 'a'")


def test_help_describes_the_flags() -> None:
    serve = cpn("serve", "--help").stdout
    for flag in ("--database-url", "--grpc-port", "--http-port", "--site-tokens", "--lease-ttl"):
        assert flag in serve
    agent = cpn("agent", "--help").stdout
    for flag in ("--site", "--control", "--token", "--virtual-gpus", "--gpu-model", "--sysfs-root"):
        assert flag in agent


def test_agent_with_its_probe_port_taken(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = cpn(
            "agent", "--site", "a", "--control", "127.0.0.1:1", "--token", "t", "--virtual-gpus",
            "1", "--probe-host", "127.0.0.1", "--probe-port", port, "--work-dir", str(tmp_path),
        )  # fmt: skip
    _one_line_error(out, f"--probe-port: cannot listen on 127.0.0.1:{port}")


def test_serve_takes_its_settings_from_the_environment(tmp_path: Path) -> None:
    """`CPN_LEASE_TTL_S=20 cpn serve …` gives agents a 20 s lease; a flag beats the
    variable; a bad variable is one line naming it."""
    import grpc  # noqa: PLC0415

    from cpn.listen_ports import free_port  # noqa: PLC0415
    from proto.cpn.v1 import agent_pb2 as pb  # noqa: PLC0415
    from proto.cpn.v1 import agent_pb2_grpc  # noqa: PLC0415
    from tests.control_harness import inventory  # noqa: PLC0415
    from tests.processes import Proc, serve_argv, wait_until  # noqa: PLC0415

    tokens = write_tokens(tmp_path / "tokens.yaml")
    grpc_port, http_port = free_port(), free_port()
    argv = serve_argv(f"sqlite:///{tmp_path}/env.db", tokens, grpc_port, http_port)
    serve = Proc(argv, tmp_path / "serve.log", env={"CPN_LEASE_TTL_S": "20"})
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        request = pb.RegisterRequest(site="a", agent_id="a-1", inventory=inventory())
        meta = (("authorization", "Bearer token-site-a"),)

        def register() -> pb.RegisterResponse | None:
            try:
                return stub.Register(request, metadata=meta, timeout=2)
            except grpc.RpcError:
                return None

        reply = wait_until(register, 60, "cpn serve to answer", serve)
        assert reply.lease_ttl_ms == 20_000
        channel.close()
    finally:
        serve.stop()
    shown = cpn("serve", "--print-settings", "--lease-ttl", "30", env={"CPN_LEASE_TTL_S": "20"})
    assert '"lease_ttl_s": 30.0' in shown.stdout
    _one_line_error(cpn("serve", "--print-settings", env={"CPN_GRPC_PORT": "x"}), "$CPN_GRPC_PORT")


def test_help_wraps_to_the_terminal() -> None:
    """Command summaries are reflowed to the terminal's width: a docstring's own line breaks
    made ragged lines of one or two words at 80 columns ("… torch.cuda," / "else virtual")."""
    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run(
        [*CPN, "--help"], capture_output=True, text=True, timeout=60, check=True, env=env
    )
    panel = done.stdout.split("Commands")[1].splitlines()[1:]
    body = [line.strip("│").rstrip() for line in panel if line.startswith("│")]
    assert len(body) > 10, done.stdout
    # A summary's line other than its last fills most of the width.
    for line, following in itertools.pairwise(body):
        if following.startswith(" " * 6):  # the next line continues this summary
            assert len(line) > 50, (line, done.stdout)
