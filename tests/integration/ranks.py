"""Run a function on N real gloo ranks in spawned processes and collect what each returns.

Each rank initialises a real `torch.distributed` process group (gloo, TCP store on a
free loopback port), calls `fn(rank, world, *args)` and saves its return value; a rank
that raises fails the call with its traceback. A run that outlives `timeout` is killed,
so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out) / f"{rank}.pt")
    finally:
        # A rank that left on purpose (dead-peer tests) must not wait for the others.
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """`fn(rank, world, *args)` on every rank; the list of results by rank."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _entry,
            args=(world, free_port(), out, fn, args),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks still running after {timeout:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [
            torch.load(Path(out) / f"{r}.pt", weights_only=False)
            if (Path(out) / f"{r}.pt").exists()
            else None
            for r in range(world)
        ]
