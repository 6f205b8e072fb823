"""Starting `cpn serve` and `cpn agent` as real processes, and reading what they serve."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

CPN = [sys.executable, "-m", "cpn"]
TOKENS = {"a": "token-site-a", "b": "token-site-b", "c": "token-site-c"}


def write_tokens(path: Path) -> Path:
    path.write_text("".join(f"{site}: {token}\n" for site, token in TOKENS.items()))
    return path


class Proc:
    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.log = log
        self._out = log.open("ab")
        self.popen = subprocess.Popen(
            argv, stdout=self._out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 20) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._out.close()
        return int(self.popen.returncode)


def worker_pids(*marks: str) -> list[int]:
    """Live worker processes (a `worker` in their command line: `cpn worker`, a test's
    worker script) whose command line holds every one of `marks` somewhere (a job id, an
    agent's work directory, a cluster's temporary directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if state == "Z" or not any(b"worker" in c for c in cmd):
            continue
        if all(any(m.encode() in c for c in cmd) for m in marks):
            found.append(int(entry.name))
    return sorted(found)


def serve_argv(db_url: str, tokens: Path, grpc_port: int, http_port: int, *extra: str) -> list[str]:
    return [
        *CPN, "serve", "--database-url", db_url, "--site-tokens", str(tokens),
        "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--host", "127.0.0.1",
        *extra,
    ]  # fmt: skip


def agent_argv(site: str, grpc_port: int, work: Path, *extra: str) -> list[str]:
    return [
        *CPN, "agent", "--site", site, "--control", f"127.0.0.1:{grpc_port}",
        "--token", TOKENS[site], "--node-name", f"{site}-node", "--probe-host", "127.0.0.1",
        "--work-dir", str(work / f"work-{site}"), *extra,
    ]  # fmt: skip


def wait_until(condition: Any, timeout: float, what: str, proc: Proc | None = None) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = condition()
        except (httpx.HTTPError, OSError, KeyError, json.JSONDecodeError) as exc:
            last = exc
        else:
            if last:
                return last
        if proc is not None and not proc.alive():
            raise AssertionError(
                f"{proc.argv[3]} exited while waiting for {what}:\n{proc.text()[-3000:]}"
            )
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def pages(url: str) -> list[Any]:
    """Every item of a paginated list, following its `Link: <…>; rel="next"` headers."""
    items: list[Any] = []
    next_url: str | None = url
    while next_url is not None:
        reply = httpx.get(next_url, timeout=10)
        reply.raise_for_status()
        items.extend(reply.json())
        next_url = reply.links.get("next", {}).get("url")
    return items


def sites(http_port: int) -> dict[str, dict[str, Any]]:
    """Every site by name, with its `agents` and `nodes` (each list fetched whole)."""
    base = f"http://127.0.0.1:{http_port}/v1/sites"
    out = {}
    for site in pages(base):
        site["agents"] = pages(f"{base}/{site['name']}/agents")
        site["nodes"] = pages(f"{base}/{site['name']}/nodes")
        out[site["name"]] = site
    return out


@contextmanager
def running(*procs: Proc) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            p.stop()
