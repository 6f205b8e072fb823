"""The HTTP socket `cpn serve` binds itself: connections accepted on it have Nagle's
algorithm off. With it on, a response written in two parts waited for the client's
delayed ACK, and every request took 40 ms more than it needed."""

from __future__ import annotations

import asyncio
import socket

from cpn.cli.serve import bind_http


def test_accepted_connections_have_tcp_nodelay() -> None:
    sock = bind_http("127.0.0.1", 0)

    async def main() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_connection(_r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connection, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            async with asyncio.timeout(10):
                nodelay = await accepted
            writer.close()
        return nodelay

    assert asyncio.run(main()) != 0
