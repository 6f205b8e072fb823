"""Ports chosen before a server starts: below the ephemeral range, free, and a block is
free in a row."""

from __future__ import annotations

import random
import socket

import pytest

from cpn.listen_ports import LOWEST, ephemeral_low, free_port, free_port_block


def test_a_port_is_below_the_ephemeral_range_and_a_server_can_listen_on_it() -> None:
    for _ in range(20):
        port = free_port("127.0.0.1")
        assert LOWEST <= port < ephemeral_low()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()


def test_a_block_that_meets_a_port_in_use_is_drawn_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = free_port_block(8)
    assert base >= LOWEST and base + 8 <= ephemeral_low()
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", base + 2))
        taken.listen()
        # The first draw overlaps the port in use (its third port), the second is clear.
        draws = iter([base, base + 3])
        monkeypatch.setattr(random, "randrange", lambda *_: next(draws))
        assert free_port_block(4) == base + 3
