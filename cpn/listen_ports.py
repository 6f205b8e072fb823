"""Ports for servers whose port is chosen before they start (`cpn demo` names the ports of
the `cpn serve` it starts; the tests and benches do the same; a Slurm launch's head node
names its rendezvous port): drawn at random outside the kernel's ephemeral range.

A port the kernel hands out (`bind((host, 0))`) is in that range, where any outgoing
connection of any process may take it in the seconds before the server binds it (seen in
CI: a `cpn serve` that spent 8 s migrating its database, then "--grpc-port: cannot listen
... in use"). Outside the range only a listener can take it; a random draw makes two
programs choosing at once unlikely to meet, and a process never hands out the same port
twice (a cluster's gRPC and HTTP ports and its rendezvous block are drawn one after the
other, before any is bound). Written by hand: the standard library and the libraries cpn
uses offer only the kernel's choice.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: The lowest port drawn: above the well-known and most registered services' ports.
LOWEST = 20000
HIGHEST = 65535

#: Ports this process handed out already (none is drawn twice).
_handed_out: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _starts(n: int) -> list[range]:
    """Where a block of `n` may start: below the ephemeral range, then above it."""
    low, high = ephemeral_range()
    spans = [range(LOWEST, low - n + 1), range(max(LOWEST, high + 1), HIGHEST - n + 2)]
    return [span for span in spans if len(span) > 0]


def _bindable(host: str, ports: range) -> bool:
    try:
        for port in ports:
            with socket.socket() as s:
                s.bind((host, port))
    except OSError:
        return False
    return True


def free_port_block(n: int, host: str = "0.0.0.0") -> int:
    """The first of `n` consecutive ports that are each free on `host` now and were not
    handed out before by this process. Where the ephemeral range leaves no room (a host
    tuned to `1024 65535`), the kernel's choice, one port at a time."""
    spans = _starts(n)
    for _ in range(200 if spans else 0):
        span = random.choices(spans, weights=[len(s) for s in spans])[0]
        base = random.choice(span)
        block = range(base, base + n)
        if _handed_out.isdisjoint(block) and _bindable(host, block):
            _handed_out.update(block)
            return base
    if n == 1:
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no {n} free ports in a row on {host} outside the ephemeral range")


def free_port(host: str = "0.0.0.0") -> int:
    """One port free on `host` now, for a server to listen on."""
    return free_port_block(1, host)
