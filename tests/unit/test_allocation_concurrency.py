"""Two real processes allocating from one free pool at the same time never hand out the
same GPU — on PostgreSQL and on SQLite.

Two races: (1) both take "any free GPU" one at a time until the pool is dry; (2) both ask
for the very same GPUs round after round, where exactly one may win each round.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import Counter
from typing import Any

from sqlalchemy import select

from cpn.registry import (
    AllocationConflict,
    NoCapacity,
    Registry,
    allocate_free,
    allocate_gpus,
    create_job,
)
from cpn.registry.models import Allocation
from tests.registry_factories import node, register

POOL_NODES = 6
GPUS_PER_NODE = 8  # 48 GPUs in the pool
ROUNDS = 20


def _grab_until_dry(url: str, who: str, start: Any, out: Any) -> None:
    reg = Registry(url)
    got: list[tuple[str, str, int]] = []
    conflicts = 0
    start.wait(30)
    for i in range(10_000):
        job = f"{who}-{i}"
        try:
            with reg.write() as s:
                create_job(s, job, job)
                got += allocate_free(s, job, 1)
        except AllocationConflict:
            conflicts += 1  # the other process won that GPU: try again
        except NoCapacity:
            break
    reg.dispose()
    out.put((who, got, conflicts))


def _same_gpus_each_round(url: str, who: str, start: Any, out: Any) -> None:
    reg = Registry(url)
    won: list[int] = []
    start.wait(30)
    for r in range(ROUNDS):
        job = f"{who}-round-{r}"
        try:
            with reg.write() as s:
                create_job(s, job, job)
                allocate_gpus(
                    s,
                    job,
                    {
                        "pool": {
                            f"n{r % POOL_NODES}": [2 * (r // POOL_NODES), 2 * (r // POOL_NODES) + 1]
                        }
                    },
                )
            won.append(r)
        except AllocationConflict:
            pass
    reg.dispose()
    out.put((who, won, 0))


def _race(registry: Registry, target: Any) -> list[tuple[str, list[Any], int]]:
    register(
        registry, "pool", nodes=tuple(node(f"n{i}", gpus=GPUS_PER_NODE) for i in range(POOL_NODES))
    )
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(registry.url, who, start, out)) for who in ("p1", "p2")
    ]
    for p in procs:
        p.start()
    time.sleep(1.0)  # let both import and connect, then fire together
    start.set()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


def test_two_processes_draining_one_pool_never_share_a_gpu(registry: Registry) -> None:
    results = _race(registry, _grab_until_dry)
    taken = [gpu for _, got, _ in results for gpu in got]
    duplicates = [gpu for gpu, n in Counter(taken).items() if n > 1]
    assert duplicates == []
    assert len(taken) == POOL_NODES * GPUS_PER_NODE  # and the pool was drained completely
    with registry.read() as s:
        rows = s.scalars(select(Allocation.gpu_id)).all()
    assert len(rows) == len(set(rows)) == len(taken)


def test_two_processes_asking_for_the_same_gpus_one_wins_each_round(registry: Registry) -> None:
    results = _race(registry, _same_gpus_each_round)
    wins = Counter(r for _, won, _ in results for r in won)
    assert sorted(wins) == list(range(ROUNDS))  # every round had a winner...
    assert set(wins.values()) == {1}  # ...and only one
    with registry.read() as s:
        rows = s.scalars(select(Allocation.gpu_id)).all()
    assert len(rows) == len(set(rows)) == 2 * ROUNDS
