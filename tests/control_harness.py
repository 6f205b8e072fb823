"""A real control server on a real port, run on its own event loop thread, for tests that
talk to it with ordinary (synchronous) gRPC clients or real agent processes."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
from sqlalchemy import select

from cpn.control import ControlServer, ControlSettings, SiteTokens
from cpn.registry import Registry, upgrade
from cpn.registry.models import Base
from proto.cpn.v1 import agent_pb2 as pb
from proto.cpn.v1 import agent_pb2_grpc

T = TypeVar("T")
TOKENS = {"a": "token-site-a", "b": "token-site-b", "c": "token-site-c"}


class ServerThread:
    def __init__(self, url: str, **settings: Any) -> None:
        defaults: dict[str, Any] = dict(
            database_url=url,
            host="127.0.0.1",
            grpc_port=0,
            lease_ttl_s=5.0,
            heartbeat_interval_s=0.5,
            reaper_interval_s=0.1,
            flush_interval_s=0.1,
        )
        defaults.update(settings)
        self.settings = ControlSettings(**defaults)
        self.registry = Registry(url)
        self.server = ControlServer(self.settings, self.registry, SiteTokens.from_mapping(TOKENS))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> int:
        self._thread.start()
        return self.run(self.server.start())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def on_loop(self, fn: Callable[[], T]) -> T:
        async def call() -> T:
            return fn()

        return self.run(call())

    def stop(self) -> None:
        self.run(self.server.stop(grace=0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.registry.dispose()


@contextmanager
def control_server(url: str, migrate: bool = True, **settings: Any) -> Iterator[ServerThread]:
    if migrate:
        upgrade(url)
    server = ServerThread(url, **settings)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def stub(port: int) -> tuple[grpc.Channel, agent_pb2_grpc.AgentServiceStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, agent_pb2_grpc.AgentServiceStub(channel)


def auth(site: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {TOKENS[site]}"),)


def inventory(nodes: int = 1, gpus: int = 2) -> pb.Inventory:
    return pb.Inventory(
        nodes=[
            pb.Node(
                name=f"n{i}",
                gpu_count=gpus,
                gpus=[
                    pb.Gpu(index=j, model="A100", memory_gb=80, source=pb.GPU_SOURCE_VIRTUAL)
                    for j in range(gpus)
                ],
                rdma_nics=[
                    pb.RdmaNic(
                        device="mlx5_0",
                        port=1,
                        transport=pb.RDMA_TRANSPORT_INFINIBAND,
                        rate_gbps=200,
                        state=pb.PORT_STATE_ACTIVE,
                    )
                ],
            )
            for i in range(nodes)
        ]
    )


def wait_for(condition: Callable[[], T], timeout: float = 30.0, what: str = "condition") -> T:
    """Poll until `condition()` is truthy (generous timeouts: the machine is shared)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def registry_digest(registry: Registry) -> str:
    """A digest of every row of every table: equal digests, nothing was stored."""
    digest = hashlib.sha256()
    with registry.read() as session:
        for table in Base.metadata.sorted_tables:
            rows = session.execute(select(table).order_by(*table.primary_key.columns)).all()
            digest.update(f"{table.name}:{rows!r}".encode())
    return digest.hexdigest()
