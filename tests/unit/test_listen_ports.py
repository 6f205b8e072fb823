"""Ports chosen before a server starts: outside the ephemeral range, free, never handed
out twice, a block free in a row; hosts whose ephemeral range leaves no room still get
a port."""

from __future__ import annotations

import random
import socket

import pytest

from cpn import listen_ports
from cpn.listen_ports import LOWEST, ephemeral_range, free_port, free_port_block


def test_ports_are_outside_the_ephemeral_range_listenable_and_never_repeated() -> None:
    low, high = ephemeral_range()
    ports = [free_port("127.0.0.1") for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert port >= LOWEST and not low <= port <= high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()


def test_a_block_that_meets_a_port_in_use_or_handed_out_is_drawn_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = free_port_block(12)  # handed out now: 12 ports free when drawn
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", base + 2))
        taken.listen()
        listen_ports._handed_out.difference_update(range(base, base + 12))
        listen_ports._handed_out.add(base + 9)
        # The first draw meets the port in use (its third), the second one handed out
        # before (its fourth), the third is clear.
        draws = iter([base, base + 6, base + 3])
        monkeypatch.setattr(random, "choice", lambda _: next(draws))
        assert free_port_block(4) == base + 3


def test_a_host_whose_ephemeral_range_leaves_no_room(monkeypatch: pytest.MonkeyPatch) -> None:
    # A range tuned to 1024-65535: the kernel's choice for one port, a clear error for a
    # block (never random.randrange's ValueError on an empty range).
    monkeypatch.setattr(listen_ports, "ephemeral_range", lambda: (1024, 65535))
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port("127.0.0.1")))
    with pytest.raises(RuntimeError, match="no 4 free ports in a row"):
        free_port_block(4)
    # A range from 20000: the ports above it.
    monkeypatch.setattr(listen_ports, "ephemeral_range", lambda: (20000, 60999))
    assert all(free_port() >= 61000 for _ in range(20))
