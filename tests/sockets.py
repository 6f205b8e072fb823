"""What this process really wrote to its TCP sockets, per connection.

The kernel counts the bytes each TCP socket sent (`tcpi_bytes_sent` in `struct tcp_info`,
Linux ≥ 4.19). Reading it with getsockopt on this process's own descriptors
(`/proc/self/fd`) is exact: a `ss` dump over netlink is not a snapshot and, on a busy
machine, can skip a socket. Tests compare these counts with what cpn's collectives say
they sent.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

#: Offsets of tcpi_bytes_received and tcpi_bytes_sent (__u64) in struct tcp_info
#: (include/uapi/linux/tcp.h).
_BYTES_RECEIVED_OFFSET = 128
_BYTES_SENT_OFFSET = 200
_TCP_INFO_SIZE = 256


@dataclass(frozen=True)
class Connection:
    local: str  # address:port of this end
    peer: str  # address:port of the other end
    bytes_sent: int
    bytes_received: int


def _address(addr: tuple[str, int] | tuple[str, int, int, int]) -> str:
    return f"{addr[0]}:{addr[1]}"


def own_connections() -> list[Connection]:
    """This process's connected TCP sockets and what each has sent so far."""
    found = []
    for entry in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError, ValueError):
            if not os.readlink(entry).startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(entry.name)))
            with sock:
                if sock.type != socket.SOCK_STREAM or sock.family not in (
                    socket.AF_INET,
                    socket.AF_INET6,
                ):
                    continue
                peer = sock.getpeername()  # OSError: not connected (a listening socket)
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
                if len(info) < _BYTES_SENT_OFFSET + 8:
                    raise RuntimeError("this kernel's tcp_info has no bytes_sent (Linux < 4.19)")
                (sent,) = struct.unpack_from("Q", info, _BYTES_SENT_OFFSET)
                (received,) = struct.unpack_from("Q", info, _BYTES_RECEIVED_OFFSET)
                local = _address(sock.getsockname())
                found.append(Connection(local, _address(peer), sent, received))
    return found
