"""gRPC over TLS: `cpn serve --tls-cert/--tls-key`, `cpn agent --tls-ca`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from proto.cpn.v1 import agent_pb2 as pb
from proto.cpn.v1 import agent_pb2_grpc
from tests.control_harness import auth, control_server, inventory
from tests.processes import Proc, agent_argv, wait_until
from tests.unit.test_cli_control import _one_line_error, cpn


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made with the openssl command."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def test_tls_clients_get_in_and_plaintext_ones_do_not(
    tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    with control_server(f"sqlite:///{tmp_path}/c.db", tls_cert=cert, tls_key=key) as srv:
        target = f"127.0.0.1:{srv.server.port}"
        request = pb.RegisterRequest(site="a", agent_id="x", inventory=inventory())
        secure = grpc.secure_channel(target, grpc.ssl_channel_credentials(cert.read_bytes()))
        reply = agent_pb2_grpc.AgentServiceStub(secure).Register(
            request, metadata=auth("a"), timeout=10
        )
        assert reply.lease_id
        plain = grpc.insecure_channel(target)
        with pytest.raises(grpc.RpcError) as err:
            agent_pb2_grpc.AgentServiceStub(plain).Register(request, metadata=auth("a"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        secure.close()
        plain.close()
        agent = Proc(
            agent_argv(
                "b", srv.server.port, tmp_path, "--virtual-gpus", "1", "--tls-ca", str(cert)
            ),
            tmp_path / "agent.log",
        )
        try:
            leases = srv.server.leases
            wait_until(lambda: srv.on_loop(lambda: leases.for_agent("b", "b-b-node")), 60,
                       "the TLS agent to register", agent)  # fmt: skip
        finally:
            agent.stop()


def test_half_a_tls_configuration_is_refused(
    tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    cert, _ = certificate
    tokens = tmp_path / "t.yaml"
    tokens.write_text("a: aaaaaaaaaaaa\n")
    out = cpn("serve", "--site-tokens", tokens, "--database-url", f"sqlite:///{tmp_path}/x.db",
              "--tls-cert", cert)  # fmt: skip
    _one_line_error(out, "--tls-cert and --tls-key go together")
    out = cpn("agent", "--site", "a", "--control", "127.0.0.1:1", "--token", "t",
              "--tls-ca", tmp_path / "missing.pem", "--work-dir", tmp_path)  # fmt: skip
    _one_line_error(out, "--tls-ca")
