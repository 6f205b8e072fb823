"""Wait until a control plane has N live sites with their WAN links measured.

    .venv/bin/python scripts/wait_for_sites.py http://127.0.0.1:8080 3 [--timeout 120]

Used by the README's tour after starting `cpn serve` and the agents: it reads the open
`GET /v1/sites` (no key needed), prints one line per site when they are all there, and
exits 1 with what is missing if they are not there in time.
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx


def missing(server: str, sites: int) -> str | None:
    """Why the control plane is not ready yet, or None when it is."""
    try:
        reply = httpx.get(f"{server.rstrip('/')}/v1/sites", timeout=5)
        reply.raise_for_status()
    except httpx.HTTPError as exc:
        return f"cannot read {server}/v1/sites: {exc}"
    live = [s for s in reply.json() if s["agents_alive"] > 0]
    if len(live) < sites:
        return f"{len(live)} of {sites} sites live"
    unmeasured = [s["name"] for s in live if len(s["links"]) < sites - 1]
    if unmeasured:
        return f"WAN links not yet measured from {', '.join(unmeasured)}"
    for s in live:
        links = ", ".join(
            f"{link['peer']} {link['bandwidth_gbps'] * 1000:,.0f} Mbit/s" for link in s["links"]
        )
        print(f"{s['name']}: {s['gpus_free']} of {s['gpus_total']} GPUs free; links: {links}")
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("server", help="the control plane's HTTP address, http://HOST:PORT")
    ap.add_argument("sites", type=int, help="how many sites to wait for")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds (default 120)")
    args = ap.parse_args()
    deadline = time.monotonic() + args.timeout
    why = missing(args.server, args.sites)
    while why is not None:
        if time.monotonic() > deadline:
            print(f"error: not ready after {args.timeout:.0f} s: {why}", file=sys.stderr)
            sys.exit(1)
        time.sleep(0.5)
        why = missing(args.server, args.sites)


if __name__ == "__main__":
    main()
