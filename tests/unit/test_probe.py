"""The WAN probe endpoint and its measurements, on loopback."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from agents.backends import Handle
from agents.launches import LaunchManager, _Launch, _Rank
from agents.links import LinkBook
from agents.probe import MAX_TRANSFER_BYTES, ProbeResult, ProbeServer, measure
from agents.tasks import TaskUpdate
from cpn.contracts.limits import MIN_GBPS
from cpn.train.links_file import read_narrowest
from cpn.train.run_files import RunFiles
from cpn.train.tail import FileTail
from proto.cpn.v1 import agent_pb2 as pb

T = TypeVar("T")


async def _with_server(body: Callable[[str], Awaitable[T]]) -> T:
    server = ProbeServer("127.0.0.1", 0)
    port = await server.start()
    try:
        return await body(f"127.0.0.1:{port}")
    finally:
        await server.stop()


def test_measures_rtt_and_throughput() -> None:
    result = asyncio.run(_with_server(lambda addr: measure(addr, pings=3, transfer_bytes=1 << 20)))
    assert 0 < result.rtt_ms < 1000
    assert result.bandwidth_gbps > 0.01  # loopback moves a MiB in well under a second
    assert result.measured_at > 0


def test_an_oversized_transfer_request_is_hung_up_on() -> None:
    async def ask_too_much(addr: str) -> bytes:
        host, _, port = addr.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(struct.pack(">cQ", b"T", MAX_TRANSFER_BYTES + 1))
        await writer.drain()
        async with asyncio.timeout(10):
            data = await reader.read()
        writer.close()
        return data

    assert asyncio.run(_with_server(ask_too_much)) == b""


def test_an_unreachable_peer_raises() -> None:
    with pytest.raises(OSError):
        asyncio.run(measure("127.0.0.1:1", pings=1, timeout=5))


def test_a_link_slower_than_the_protocol_floor_is_reported_down() -> None:
    """The control plane refuses 0 < bandwidth < MIN_GBPS; the agent sends 0 (down)."""
    book = LinkBook()
    book.record("b", ProbeResult(bandwidth_gbps=1e-6, rtt_ms=900.0, measured_at=1.0))
    book.record("c", ProbeResult(bandwidth_gbps=MIN_GBPS, rtt_ms=10.0, measured_at=1.0))
    assert [(m.peer_site, m.bandwidth_gbps) for m in book.pending()] == [
        ("b", 0.0),
        ("c", MIN_GBPS),
    ]


def test_measurements_reach_the_run_directories_of_running_launches(tmp_path: Path) -> None:
    """What `wan: auto` workers follow: the agent writes its newest measurement per peer
    site into every running launch's run directory after each probe."""
    book = LinkBook()
    launches = LaunchManager("a", "a0", tmp_path, report=lambda _: None, links=book.latest)
    book.on_record = launches.publish_links
    files = RunFiles(tmp_path / "job-1")
    files.root.mkdir()
    update = TaskUpdate(job_id="job-1", rank=0, state=pb.TASK_STATE_RUNNING)
    rank = _Rank(
        0, "a0", 0, files, FileTail(files.metrics(0)), FileTail(tmp_path / "s"),
        FileTail(files.log(0)), update,
    )  # fmt: skip
    handle = Handle("job-1", 0, "1", files.root)
    launches._launches["job-1"] = _Launch("job-1", handle, [rank])
    ended = RunFiles(tmp_path / "job-0")
    ended.root.mkdir()
    book.record("b", ProbeResult(bandwidth_gbps=10.0, rtt_ms=2.0, measured_at=1.0))
    assert read_narrowest(files.wan_links, {"b", "c"}) == 10.0
    book.record("c", ProbeResult(bandwidth_gbps=0.05, rtt_ms=40.0, measured_at=2.0))
    assert read_narrowest(files.wan_links, {"b", "c"}) == 0.05
    assert read_narrowest(files.wan_links, {"b"}) == 10.0  # only the job's sites count
    assert read_narrowest(files.wan_links, {"d"}) is None
    assert not ended.wan_links.exists()  # not a running launch's


def test_an_agent_ending_with_a_peer_connected_logs_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer's probe connection is open when the agent ends: asyncio.run cancels its
    handler, which must end quietly (Python 3.11 logged it as 'Exception in callback')."""
    peer = socket.socket()

    async def agent() -> None:
        server = ProbeServer("127.0.0.1", 0)
        port = await server.start()
        await asyncio.to_thread(peer.connect, ("127.0.0.1", port))
        await asyncio.sleep(0.2)  # the server has taken the connection: its handler waits
        await server.stop()

    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        asyncio.run(agent())
    peer.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
