"""The WAN probe: every agent serves a tiny TCP endpoint; peers measure RTT with a few
one-byte round trips and throughput with one short bulk transfer.

Wire format (one connection may carry several requests):

    client → server: op (1 byte) + argument (8 bytes, big-endian)
    op b"P": the server answers one byte b"P"           (round trip)
    op b"T": the server sends `argument` bytes of zeros (bulk; at most MAX_TRANSFER_BYTES)

Probes are cheap by design: a handful of pings, a few MiB per transfer, at most
`MAX_CONCURRENT_TRANSFERS` transfers served at once, and the caller decides how often
(`cpn agent --probe-interval`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import struct
import time
from dataclasses import dataclass

log = logging.getLogger("cpn.agent")

MAX_TRANSFER_BYTES = 64 * 1024 * 1024
MAX_CONCURRENT_TRANSFERS = 2
_HEADER = struct.Struct(">cQ")
_CHUNK = b"\0" * (256 * 1024)


@dataclass(frozen=True)
class ProbeResult:
    rtt_ms: float
    bandwidth_gbps: float
    measured_at: float  # unix seconds


class ProbeServer:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._transfers = asyncio.Semaphore(MAX_CONCURRENT_TRANSFERS)

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                op, arg = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                if op == b"P":
                    writer.write(b"P")
                elif op == b"T" and arg <= MAX_TRANSFER_BYTES:
                    async with self._transfers:
                        left = arg
                        while left > 0:
                            chunk = _CHUNK[: min(left, len(_CHUNK))]
                            writer.write(chunk)
                            left -= len(chunk)
                            await writer.drain()
                else:
                    return  # unknown op or oversized request: hang up
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        except asyncio.CancelledError:
            # The agent is ending (asyncio.run cancels what is left, a peer's connection
            # among it). Ending normally: Python 3.11's start_server callback calls
            # task.exception() on the handler and logs a cancelled one as a traceback.
            return
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def measure(
    address: str, *, pings: int = 5, transfer_bytes: int = 4 * 1024 * 1024, timeout: float = 10.0
) -> ProbeResult:
    """RTT (median of `pings`) and throughput (one transfer) to a peer's probe endpoint."""
    host, _, port = address.rpartition(":")
    async with asyncio.timeout(timeout):  # not wait_for: see agents/events.py
        reader, writer = await asyncio.open_connection(host, int(port))
    try:
        rtts = []
        for _ in range(pings):
            start = time.perf_counter()
            writer.write(_HEADER.pack(b"P", 0))
            await writer.drain()
            async with asyncio.timeout(timeout):
                await reader.readexactly(1)
            rtts.append((time.perf_counter() - start) * 1000)
        size = min(transfer_bytes, MAX_TRANSFER_BYTES)
        start = time.perf_counter()
        writer.write(_HEADER.pack(b"T", size))
        await writer.drain()
        received = 0
        while received < size:
            async with asyncio.timeout(timeout):
                data = await reader.read(min(1 << 20, size - received))
            if not data:
                raise ConnectionError("probe peer closed the connection mid-transfer")
            received += len(data)
        elapsed = max(time.perf_counter() - start, 1e-9)
        return ProbeResult(
            rtt_ms=statistics.median(rtts),
            bandwidth_gbps=size * 8 / elapsed / 1e9,
            measured_at=time.time(),
        )
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
