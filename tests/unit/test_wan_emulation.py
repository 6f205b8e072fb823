"""bench/wan_emulation.py: tbf settings, and (as root) namespaces built, shaped, removed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# bench/ is not a package: load the script by its path, without putting bench/ on sys.path.
_spec = importlib.util.spec_from_file_location(
    "wan_emulation", Path(__file__).resolve().parents[2] / "bench" / "wan_emulation.py"
)
assert _spec is not None and _spec.loader is not None
wan_emulation = importlib.util.module_from_spec(_spec)
sys.modules["wan_emulation"] = wan_emulation
_spec.loader.exec_module(wan_emulation)

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
