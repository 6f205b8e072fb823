"""cpn/emulated_wan.py: tbf settings, and (as root) namespaces built, shaped, removed."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from cpn import emulated_wan as wan_emulation

# Not the benchmark's prefix, so a test never sweeps away the namespaces of a running bench.
PREFIX = "cpnwantest"


def test_burst_covers_a_tick_and_a_gso_packet() -> None:
    assert wan_emulation.burst_bytes(10) == 64 << 10  # small rates: one GSO packet
    assert wan_emulation.burst_bytes(1000) == 1_250_000  # 10 ms at 1 Gbit/s
    args = wan_emulation.tbf_args(50, latency_ms=20)
    assert args == ["tbf", "rate", "50000kbit", "burst", str(64 << 10), "latency", "20ms"]
    with pytest.raises(ValueError, match="rate_mbit"):
        wan_emulation.tbf_args(0)


needs_netns = pytest.mark.skipif(
    not wan_emulation.available(PREFIX)[0],
    reason=f"no emulated sites here: {wan_emulation.available(PREFIX)[1]}",
)


@needs_netns
def test_sites_are_shaped_counted_and_removed() -> None:
    with wan_emulation.EmulatedWan(2, uplink_mbit=40, prefix=PREFIX) as wan:
        assert set(wan_emulation.namespaces(PREFIX)) == {
            f"{PREFIX}-hub",
            f"{PREFIX}-s0",
            f"{PREFIX}-s1",
        }
        assert wan.address(1) == "198.18.0.11"
        assert wan.prefix(0) == ["ip", "netns", "exec", f"{PREFIX}-s0"]
        before = wan.tx_bytes(0)
        mbit = wan_emulation.throughput_mbit(wan, 0, 1, seconds=1.0)
        assert 25 < mbit < 48, mbit  # the 40 Mbit/s uplink, give or take the burst
        assert wan.tx_bytes(0) - before > mbit * 1e6 / 8 * 0.8
        with pytest.raises(RuntimeError, match="another emulated WAN"):
            wan_emulation.EmulatedWan(1, prefix=PREFIX).__enter__()
    assert wan_emulation.namespaces(PREFIX) == []


@needs_netns
def test_removed_on_error_and_stale_namespaces_swept() -> None:
    with pytest.raises(KeyboardInterrupt), wan_emulation.EmulatedWan(1, None, prefix=PREFIX):
        raise KeyboardInterrupt
    assert wan_emulation.namespaces(PREFIX) == []
    # A crashed run's leftovers are swept by the next one.
    wan_emulation._run(["ip", "netns", "add", f"{PREFIX}-s7"])
    with wan_emulation.EmulatedWan(1, None, prefix=PREFIX):
        assert f"{PREFIX}-s7" not in wan_emulation.namespaces(PREFIX)
    assert wan_emulation.namespaces(PREFIX) == []


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="subnet"):
        wan_emulation.EmulatedWan(2, subnet="10.0.0")
    with pytest.raises(ValueError, match="host_link"):
        wan_emulation.EmulatedWan(2, host_link=True)
    with pytest.raises(ValueError, match="ifprefix"):
        wan_emulation.EmulatedWan(2, ifprefix="toolong7")


def _echo_from_root(wan: wan_emulation.EmulatedWan, site: int) -> bytes:
    """Connect from this (root) namespace to a listener inside `site`'s namespace."""
    server = (
        "import socket,sys; s=socket.create_server((sys.argv[1], 47999)); print(1, flush=True);"
        " c,_=s.accept(); c.sendall(b'site'); c.close()"
    )
    argv = [*wan.prefix(site), sys.executable, "-c", server, wan.address(site)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"1"
        with socket.create_connection((wan.address(site), 47999), timeout=5) as conn:
            return conn.recv(16)
    finally:
        proc.wait(10)


# Issue 12's names and /24: a host link in the root namespace, per-site rates.
HOSTED, IFPREFIX, SUBNET = "c12u", "c12u", "198.18.12"


@needs_netns
def test_host_link_reaches_every_site_and_goes_with_the_rest() -> None:
    with wan_emulation.EmulatedWan(
        2, [30, None], prefix=HOSTED, subnet=SUBNET, ifprefix=IFPREFIX, host_link=True
    ) as wan:
        assert wan.interface == "c12uwan0" and wan.host_address == "198.18.12.1"
        assert sorted(wan_emulation.leftovers(HOSTED, IFPREFIX)) == [
            "c12u-hub", "c12u-s0", "c12u-s1", "c12uhost",
        ]  # fmt: skip
        for site in range(2):  # the root namespace reaches each site over the bridge
            assert _echo_from_root(wan, site) == b"site"
        qdiscs = [wan_emulation._run([*wan.prefix(i), "tc", "qdisc", "show"]) for i in range(2)]
        assert "tbf" in qdiscs[0] and "rate 30Mbit" in qdiscs[0]
        assert "tbf" not in qdiscs[1]
    assert wan_emulation.leftovers(HOSTED, IFPREFIX) == []
