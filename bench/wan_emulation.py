"""Emulated sites on this host, checked: build them, measure a shaped and an unshaped link.

    sudo .venv/bin/python bench/wan_emulation.py               # build 3 sites, measure them
    sudo .venv/bin/python bench/wan_emulation.py --rate-mbit 50

The emulation itself (network namespaces joined by a bridge, uplinks shaped with tc tbf,
198.18.0.0/15 addresses only) lives in `cpn/emulated_wan.py`, shared with `cpn demo`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpn.emulated_wan import EmulatedWan, available, namespaces, throughput_mbit


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--rate-mbit", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    ok, why = available()
    if not ok:
        print(f"cannot emulate sites here: {why}")
        raise SystemExit(1)
    with EmulatedWan(args.sites, args.rate_mbit) as wan:
        before = wan.tx_bytes(0)
        t0 = time.perf_counter()
        shaped = throughput_mbit(wan, 0, 1, args.seconds)
        elapsed = time.perf_counter() - t0
        sent = wan.tx_bytes(0) - before
        lan = throughput_mbit(wan, 0, 0, args.seconds)
        wan.set_uplink(None)
        unlimited = throughput_mbit(wan, 0, 1, args.seconds)
    print(f"site 0 → site 1, uplink {args.rate_mbit:g} Mbit/s: {shaped:.1f} Mbit/s goodput")
    print(f"  wan0 tx on site 0: {sent * 8 / elapsed / 1e6:.1f} Mbit/s over the whole test")
    print(f"site 0 → site 0 (LAN, unshaped): {lan:.0f} Mbit/s")
    print(f"site 0 → site 1, no limit: {unlimited:.0f} Mbit/s")
    print(f"namespaces left: {namespaces() or 'none'}")


if __name__ == "__main__":
    main()
