"""Emulated sites on this host: one network namespace per site, uplinks shaped with tc tbf.

Used by `cpn demo` and by the benchmarks (`bench/wan_sync.py`, `bench/wan_emulation.py`).

Layout (everything lives in namespaces this module creates, apart from the optional host
link below; only 198.18.0.0/15 addresses are used, the range set aside for network
benchmarks by RFC 2544; each user takes its own /24 with `subnet`):

    <prefix>-hub:  bridge br0 ── s0 ── s1 ── s2 … (── hub0)   (hub ends of the veth pairs)
                                 │     │     │       │
    <prefix>-s0:   wan0 198.18.0.10/24, lo           │  (site 0: its processes run here)
    <prefix>-s1:   wan0 198.18.0.11/24, lo           │
    …                                                │
    root namespace, only with `host_link=True`:  host 198.18.0.1/24 (a control plane
    that every site reaches runs there)

Interface names are `ifprefix` + the names above (`cpn demo` uses `c12`: c12wan0, c12br0,
c12s0, c12host), so that no interface this module makes can be taken for another's.
Every site namespace has the same uplink name, so GLOO_SOCKET_IFNAME=<uplink> works for
every rank. Processes in one site namespace reach each other through the namespace's
local routing (loopback, unshaped: the datacenter LAN); only traffic to other sites
leaves through the uplink, whose egress is shaped with

    tc qdisc add dev wan0 root tbf rate <R>mbit burst <B> latency <L>ms

The burst is the larger of 10 ms at the rate (the token bucket is refilled at timer ticks:
it must hold at least rate/HZ, and HZ ≥ 100 on any kernel) and 64 KiB (one GSO
super-packet on a veth, so tbf never has to split one), and the queue holds `latency_ms`
of traffic at the rate before it drops. There is no netem here, so no propagation delay
is added: the emulated WAN is narrow, not long.

`available()` says whether this can run (root, `ip` and `tc`, a tbf qdisc accepted in a
throwaway namespace) and why not when it cannot. `leftovers()` lists what of a prefix
still exists (namespaces, the host link): empty after every exit of `EmulatedWan`.
"""

from __future__ import annotations

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
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

#: Every namespace this module creates is named "<prefix>-…".
DEFAULT_PREFIX = "cpnwan"
INTERFACE = "wan0"
BRIDGE = "br0"
HOST_LINK = "host"  # the root namespace's end of the host link
SUBNET = "198.18.0"  # /24 inside 198.18.0.0/15
HOST_ADDRESS = 1  # the host link's address in the /24
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


def _link_exists(name: str) -> bool:
    return bool(_run(["ip", "-o", "link", "show", "dev", name], check=False).strip())


def remove_stale(prefix: str = DEFAULT_PREFIX, ifprefix: str = "") -> list[str]:
    """Delete namespaces (and the host link) left by an earlier run that did not clean up;
    returns their names."""
    stale = namespaces(prefix)
    for name in stale:
        _delete_namespace(name)
    host = ifprefix + HOST_LINK
    if ifprefix and _link_exists(host):
        _run(["ip", "link", "del", host], check=False)
        stale.append(host)
    return stale


def leftovers(prefix: str = DEFAULT_PREFIX, ifprefix: str = "") -> list[str]:
    """What of `prefix` exists now: its namespaces and, with `ifprefix`, any root-namespace
    interface whose name starts with it. Empty when everything was cleaned up (the
    bridges, veths and qdiscs live inside the namespaces and go with them)."""
    found = namespaces(prefix)
    if ifprefix:
        out = _run(["ip", "-j", "link", "show"], check=False).strip()
        links = [entry["ifname"] for entry in json.loads(out)] if out else []
        found += [name for name in links if name.startswith(ifprefix)]
    return found


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


class EmulationBusyError(RuntimeError):
    """Another emulation with the same prefix holds its lock (a run in progress)."""


class EmulatedWan:
    """`sites` network namespaces joined by a bridge, each uplink shaped to `uplink_mbit`.

    `uplink_mbit=None` leaves the links unlimited (veth speed); a sequence gives each site
    its own rate. Use as a context manager; everything is removed on exit, whatever the
    exit, and what a crashed run with the same prefix left is removed before building.
    `host_link=True` also joins the root namespace to the bridge (`host_address`).
    """

    def __init__(
        self,
        sites: int = 3,
        uplink_mbit: float | Sequence[float | None] | None = 100.0,
        latency_ms: float = DEFAULT_LATENCY_MS,
        prefix: str = DEFAULT_PREFIX,
        *,
        subnet: str = SUBNET,
        ifprefix: str = "",
        host_link: bool = False,
    ) -> None:
        if not 1 <= sites <= 200:
            raise ValueError(f"sites: must be in 1..200, got {sites}")
        parts = subnet.split(".")
        if len(parts) != 3 or (parts[:2] != ["198", "18"] and parts[:2] != ["198", "19"]):
            raise ValueError(f"subnet: {subnet!r} is not a /24 inside 198.18.0.0/15")
        if len(ifprefix) > 6:
            raise ValueError(f"ifprefix: {ifprefix!r} is longer than 6 characters")
        if host_link and not ifprefix:
            raise ValueError("host_link: needs an ifprefix (it names a root-namespace link)")
        self.sites, self.latency_ms, self.ns_prefix = sites, latency_ms, prefix
        self.subnet, self.ifprefix, self.host_link = subnet, ifprefix, host_link
        self.interface = ifprefix + INTERFACE
        self.bridge = ifprefix + BRIDGE
        self.host_interface = ifprefix + HOST_LINK
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
        return f"{self.subnet}.{FIRST_HOST + site}"

    @property
    def host_address(self) -> str:
        """The root namespace's address on the bridge (with `host_link=True`)."""
        return f"{self.subnet}.{HOST_ADDRESS}"

    def _check(self, site: int) -> None:
        if not 0 <= site < self.sites:
            raise IndexError(f"site {site}: there are {self.sites} sites")

    # -- building -------------------------------------------------------------------------
    def __enter__(self) -> EmulatedWan:
        self._take_lock()
        self._trap_sigterm()
        try:
            remove_stale(self.ns_prefix, self.ifprefix)
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
        hub, bridge, uplink = self.hub, self.bridge, self.interface
        _run(["ip", "netns", "add", hub])
        _run(["ip", "-n", hub, "link", "add", bridge, "type", "bridge"])
        _run(["ip", "-n", hub, "link", "set", bridge, "up"])
        for i in range(self.sites):
            ns = self.namespace(i)
            end = f"{self.ifprefix}s{i}"
            _run(["ip", "netns", "add", ns])
            # Created inside the hub with its peer placed straight into the site: the
            # root namespace never sees either end.
            veth = ["ip", "-n", hub, "link", "add", end, "type", "veth"]
            _run([*veth, "peer", "name", uplink, "netns", ns])
            _run(["ip", "-n", hub, "link", "set", end, "master", bridge])
            _run(["ip", "-n", hub, "link", "set", end, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", uplink])
            _run(["ip", "-n", ns, "link", "set", uplink, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        if self.host_link:
            end = f"{self.ifprefix}hub0"
            # Made in the root namespace (its end keeps its name there), the peer moved
            # into the hub; the root gets one address and the /24's route, nothing more.
            host = self.host_interface
            _run(["ip", "link", "add", host, "type", "veth", "peer", "name", end, "netns", hub])
            _run(["ip", "-n", hub, "link", "set", end, "master", bridge])
            _run(["ip", "-n", hub, "link", "set", end, "up"])
            _run(["ip", "addr", "add", f"{self.host_address}/24", "dev", host])
            _run(["ip", "link", "set", host, "up"])
        self.set_uplink(self.uplink_mbit)

    def set_uplink(
        self, mbit: float | Sequence[float | None] | None, site: int | None = None
    ) -> None:
        """Shape one site's uplink (all when `site` is None; a sequence: one rate per
        site); None removes the limit."""
        chosen = range(self.sites) if site is None else [site]
        for i in chosen:
            rate = mbit[i] if isinstance(mbit, Sequence) else mbit
            tc = [*self.prefix(i), "tc", "qdisc"]
            if rate is None:
                _run([*tc, "del", "dev", self.interface, "root"], check=False)
            else:
                _run(
                    [
                        *tc,
                        "replace",
                        "dev",
                        self.interface,
                        "root",
                        *tbf_args(rate, self.latency_ms),
                    ]
                )
        if site is None:
            self.uplink_mbit = mbit

    def _teardown(self) -> None:
        for i in range(self.sites):
            _delete_namespace(f"{self.ns_prefix}-s{i}")
        _delete_namespace(self.hub)  # takes the host link's peer, hence the link, with it
        if self.host_link and _link_exists(self.host_interface):
            _run(["ip", "link", "del", self.host_interface], check=False)
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
            raise EmulationBusyError(
                f"another emulated WAN with prefix {self.ns_prefix!r} is running (it holds {path})"
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
        path = f"/sys/class/net/{self.interface}/statistics/tx_bytes"
        out = _run([*self.prefix(site), "cat", path])
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
