"""Ports for servers whose port is chosen before they start (`cpn demo` names the ports of
the `cpn serve` it starts; the tests do the same): drawn at random below the kernel's
ephemeral range.

A port the kernel hands out (`bind((host, 0))`) is in that range, where any outgoing
connection of any process may take it in the seconds before the server binds it (seen in
CI: a `cpn serve` that spent 8 s migrating its database, then "--grpc-port: cannot listen
... in use"). Below the range only a listener can take it, and a random draw makes two
programs choosing at once unlikely to meet. Written by hand: the standard library and
the libraries cpn uses offer only the kernel's choice.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: The lowest port drawn: above the well-known and most registered services' ports.
LOWEST = 20000


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(n: int, host: str = "0.0.0.0") -> int:
    """The first of `n` consecutive ports that are each free on `host` now."""
    high = ephemeral_low() - n
    for _ in range(200):
        base = random.randrange(LOWEST, high)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} free ports in a row on {host} below {high + n}")


def free_port(host: str = "0.0.0.0") -> int:
    """One port free on `host` now, for a server to listen on."""
    return free_port_block(1, host)
