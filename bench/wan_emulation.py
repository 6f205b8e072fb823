"""Emulated sites on this host: one network namespace per site, uplinks shaped with tc tbf.

    sudo .venv/bin/python bench/wan_emulation.py               # build 3 sites, measure them
    sudo .venv/bin/python bench/wan_emulation.py --rate-mbit 50

Layout (everything lives in namespaces this module creates; the root namespace's
interfaces and routes are never touched, and only 198.18.0.0/15 addresses are used, the
range set aside for network benchmarks by RFC 2544):

    cpnwan-hub:  bridge br0 ── s0 ── s1 ── s2 …      (hub ends of the veth pairs)
                               │     │     │
    cpnwan-s0:   wan0 198.18.0.10/24, lo             (site 0: its ranks run here)
    cpnwan-s1:   wan0 198.18.0.11/24, lo
    …

Every site namespace has the same interface name (`wan0`), so GLOO_SOCKET_IFNAME=wan0
works for every rank. Processes in one site namespace reach each other through the
namespace's local routing (loopback, unshaped: the datacenter LAN); only traffic to other
sites leaves through `wan0`, whose egress is the site's uplink, shaped with

    tc qdisc add dev wan0 root tbf rate <R>mbit burst <B> latency <L>ms

The burst is the larger of 10 ms at the rate (the token bucket is refilled at timer ticks:
it must hold at least rate/HZ, and HZ ≥ 100 on any kernel) and 64 KiB (one GSO
super-packet on a veth, so tbf never has to split one), and the queue holds `latency_ms`
of traffic at the rate before it drops. There is no netem here, so no propagation delay
is added: the emulated WAN is narrow, not long.

`available()` says whether this can run (root, `ip` and `tc`, a tbf qdisc accepted in a
throwaway namespace) and why not when it cannot.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

#: Every namespace this module creates is named "<prefix>-…" (CPN_WAN_PREFIX overrides it,
#: so that two people on one host keep apart).
DEFAULT_PREFIX = os.environ.get("CPN_WAN_PREFIX", "cpnwan")
INTERFACE = "wan0"
BRIDGE = "br0"
#: A /24 inside 198.18.0.0/15 (CPN_WAN_SUBNET, e.g. "198.18.13", overrides it).
SUBNET = os.environ.get("CPN_WAN_SUBNET", "198.18.0")
if not SUBNET.startswith(("198.18.", "198.19.")) or SUBNET.count(".") != 2:
    raise SystemExit(f"CPN_WAN_SUBNET: {SUBNET!r} is not a /24 inside 198.18.0.0/15")
FIRST_HOST = 10
MIN_BURST_BYTES = 64 << 10
DEFAULT_LATENCY_MS = 50.0


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> str:
    done = subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def burst_bytes(rate_mbit: float) -> int:
    """tbf bucket size for `rate_mbit`: 10 ms at the rate, at least 64 KiB."""
    return max(MIN_BURST_BYTES, int(rate_mbit * 1e6 / 8 * 0.010))


def tbf_args(rate_mbit: float, latency_ms: float = DEFAULT_LATENCY_MS) -> list[str]:
    if rate_mbit <= 0:
        raise ValueError(f"rate_mbit: must be > 0, got {rate_mbit}")
    return [
        "tbf",
        "rate",
        f"{rate_mbit * 1000:.0f}kbit",
        "burst",
        str(burst_bytes(rate_mbit)),
        "latency",
        f"{latency_ms:g}ms",
    ]


def namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Names of the existing namespaces that belong to `prefix`."""
    out = _run(["ip", "-j", "netns", "list"], check=False).strip()
    names = [entry["name"] for entry in json.loads(out)] if out else []
    return [n for n in names if n.startswith(prefix + "-")]


def _delete_namespace(name: str) -> None:
    # Processes left in it (ranks of a crashed run) would keep it alive unnamed: end them.
    for pid in _run(["ip", "netns", "pids", name], check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _run(["ip", "netns", "del", name], check=False)


def remove_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete namespaces left by an earlier run that did not clean up; returns their names."""
    stale = namespaces(prefix)
    for name in stale:
        _delete_namespace(name)
    return stale


def available(prefix: str = DEFAULT_PREFIX) -> tuple[bool, str]:
    """Whether sites can be emulated here, and the reason when they cannot."""
    if not sys.platform.startswith("linux"):
        return False, "not Linux"
    if os.geteuid() != 0:
        return False, "not running as root (network namespaces and tc need it)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"{prefix}-probe{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _run(
            [
                "ip",
                "netns",
                "exec",
                probe,
                "tc",
                "qdisc",
                "add",
                "dev",
                "p0",
                "root",
                *tbf_args(100),
            ]
        )
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot build a shaped namespace: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return True, ""


class EmulatedWan:
    """`sites` network namespaces joined by a bridge, each uplink shaped to `uplink_mbit`.

    `uplink_mbit=None` leaves the links unlimited (veth speed). Use as a context manager;
    everything is removed on exit, whatever the exit, and namespaces with the same prefix
    left by a crashed run are removed before building.
    """

    interface = INTERFACE

    def __init__(
        self,
        sites: int = 3,
        uplink_mbit: float | None = 100.0,
        latency_ms: float = DEFAULT_LATENCY_MS,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        if not 1 <= sites <= 200:
            raise ValueError(f"sites: must be in 1..200, got {sites}")
        self.sites, self.latency_ms, self.ns_prefix = sites, latency_ms, prefix
        self.uplink_mbit = uplink_mbit
        self.hub = f"{prefix}-hub"
        self._previous_sigterm: Any = None
        self._lock: int | None = None

    # -- naming ---------------------------------------------------------------------------
    def namespace(self, site: int) -> str:
        self._check(site)
        return f"{self.ns_prefix}-s{site}"

    def prefix(self, site: int) -> list[str]:
        """Command prefix that runs a program inside `site`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(site)]

    def address(self, site: int) -> str:
        self._check(site)
        return f"{SUBNET}.{FIRST_HOST + site}"

    def _check(self, site: int) -> None:
        if not 0 <= site < self.sites:
            raise IndexError(f"site {site}: there are {self.sites} sites")

    # -- building -------------------------------------------------------------------------
    def __enter__(self) -> EmulatedWan:
        self._take_lock()
        self._trap_sigterm()
        try:
            remove_stale(self.ns_prefix)
            self._build()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._teardown()

    def _build(self) -> None:
        hub = self.hub
        _run(["ip", "netns", "add", hub])
        _run(["ip", "-n", hub, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", hub, "link", "set", BRIDGE, "up"])
        for i in range(self.sites):
            ns = self.namespace(i)
            _run(["ip", "netns", "add", ns])
            # Created inside the hub with its peer placed straight into the site: the
            # root namespace never sees either end.
            veth = ["ip", "-n", hub, "link", "add", f"s{i}", "type", "veth"]
            _run([*veth, "peer", "name", INTERFACE, "netns", ns])
            _run(["ip", "-n", hub, "link", "set", f"s{i}", "master", BRIDGE])
            _run(["ip", "-n", hub, "link", "set", f"s{i}", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", INTERFACE])
            _run(["ip", "-n", ns, "link", "set", INTERFACE, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        self.set_uplink(self.uplink_mbit)

    def set_uplink(self, mbit: float | None, site: int | None = None) -> None:
        """Shape one site's uplink (all when `site` is None); None removes the limit."""
        for i in range(self.sites) if site is None else [site]:
            tc = [*self.prefix(i), "tc", "qdisc"]
            if mbit is None:
                _run([*tc, "del", "dev", INTERFACE, "root"], check=False)
            else:
                _run([*tc, "replace", "dev", INTERFACE, "root", *tbf_args(mbit, self.latency_ms)])
        if site is None:
            self.uplink_mbit = mbit

    def _teardown(self) -> None:
        for i in range(self.sites):
            _delete_namespace(f"{self.ns_prefix}-s{i}")
        _delete_namespace(self.hub)
        self._restore_sigterm()
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None

    def _take_lock(self) -> None:
        # One emulation per prefix at a time: the stale-namespace sweep of a second one
        # would otherwise tear down the namespaces of a run in progress.
        path = Path(tempfile.gettempdir()) / f"{self.ns_prefix}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(
                f"another emulated WAN with prefix {self.ns_prefix!r} is running "
                f"(it holds {path}); use another prefix"
            ) from None
        self._lock = fd

    def _trap_sigterm(self) -> None:
        # SIGTERM would end the process without unwinding `with`; make it an exception.
        def raise_exit(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)

        with contextlib.suppress(ValueError):  # not the main thread: leave it alone
            self._previous_sigterm = signal.signal(signal.SIGTERM, raise_exit)

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    # -- counters -------------------------------------------------------------------------
    def tx_bytes(self, site: int) -> int:
        """Bytes `site` has sent on its uplink so far (Ethernet frames, headers included)."""
        out = _run([*self.prefix(site), "cat", f"/sys/class/net/{INTERFACE}/statistics/tx_bytes"])
        return int(out.strip())

    def total_tx_bytes(self) -> int:
        return sum(self.tx_bytes(i) for i in range(self.sites))


# ------------------------------------------------------------------------- throughput check

_RECEIVER = textwrap.dedent(
    """
    import socket, sys, time
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept(); total = 0; first = None
    while True:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        if first is None:
            first = time.perf_counter()
        total += len(chunk)
    print(total, time.perf_counter() - (first or time.perf_counter()), flush=True)
    """
)

_SENDER = textwrap.dedent(
    """
    import socket, sys, time
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
    block = b"x" * (1 << 16); end = time.perf_counter() + float(sys.argv[3])
    while time.perf_counter() < end:
        s.sendall(block)
    s.close()
    """
)


def throughput_mbit(wan: EmulatedWan, src: int, dst: int, seconds: float = 2.0) -> float:
    """Goodput of one TCP stream from `src` to `dst` (the same site: the unshaped LAN)."""
    port = 47_000 + src * 17 + dst
    receiver = subprocess.Popen(
        [*wan.prefix(dst), sys.executable, "-c", _RECEIVER, wan.address(dst), str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        if receiver.stdout.readline().strip() != "ready":
            raise RuntimeError("throughput receiver did not start")
        sender = [sys.executable, "-c", _SENDER, wan.address(dst), str(port), str(seconds)]
        subprocess.run(
            [*wan.prefix(src), *sender],
            check=True,
            timeout=seconds + 30,
        )
        out, _ = receiver.communicate(timeout=30)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    total, elapsed = out.split()
    return int(total) * 8 / max(float(elapsed), 1e-9) / 1e6


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
