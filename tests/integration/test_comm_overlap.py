"""The overlapping DDP hook: futures that complete when their bucket's exchange is done.

- Overlapped and blocking hooks give the same losses, parameters and byte counts, bit for
  bit, for dense, fp16, int8, top-k and outer-step sync (one comm thread keeps the order).
- The hook really returns before the bucket is synced: with the comm thread held until
  the last bucket's hook is called, every earlier future is still pending when DDP gets
  it, and backward still completes.
- A peer that stalls past the timeout or dies during an overlapped exchange fails the
  bucket's future: DDP's backward raises the CommError (bounded time, no hang).
"""

# No `from __future__ import annotations`: DDP compares a hook's annotations with
# dist.GradBucket as objects.
import datetime
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.nn.parallel import DistributedDataParallel as DDP

from cpn.comm import OuterStep, WanSyncState, wan_sync_hook
from tests.integration.ranks import run_ranks

LAYOUT = ["a", "a", "b", "c"]
MODES: list[dict[str, Any]] = [
    {"compression": "none"},
    {"compression": "fp16"},
    {"compression": "int8"},
    {"compression": "topk", "density": 0.05, "warmup_steps": 2},
    {"compression": "outer"},
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
    )


def _run(rank: int, mode: dict[str, Any], overlap: bool) -> dict[str, Any]:
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.005)  # several buckets
    state = WanSyncState(LAYOUT, parameters=model.parameters(), overlap=overlap, **mode)
    ddp.register_comm_hook(state, wan_sync_hook)
    outer = (
        OuterStep(state, model.parameters(), every=2, values="int4")
        if mode["compression"] == "outer"
        else None
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(4):
        x = torch.randn(32, 16, generator=g)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if outer is not None:
            outer.after_step()
        losses.append(float(loss))
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
        "bytes": state.bytes_sent,
    }


def _pending_futures(rank: int) -> list[bool]:
    """Hold the comm thread until the last bucket's hook is called: every earlier future
    DDP got must be pending then."""
    torch.manual_seed(0)
    # DDP's first bucket holds 1 MB whatever the cap: 1 MB layers make several buckets.
    layers = [torch.nn.Linear(16, 512), *(torch.nn.Linear(512, 512) for _ in range(3))]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(512, 4))
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = WanSyncState(LAYOUT, compression="none", parameters=model.parameters())
    gate = threading.Event()
    done_at_return: list[bool] = []

    def hook(st: WanSyncState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        if bucket.is_last():
            # The last bucket's hook waits for the step's exchanges (nothing is left to
            # overlap with): open the gate first.
            gate.set()
            return wan_sync_hook(st, bucket)
        fut = wan_sync_hook(st, bucket)
        done_at_return.append(fut.done())
        return fut

    ddp.register_comm_hook(state, hook)
    for _ in range(2):  # the first iteration, then DDP's rebuilt buckets
        state.comm_thread().submit(gate.wait)
        ddp(torch.randn(8, 16)).sum().backward()
        gate.clear()
    return done_at_return


def _all(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"equal": {}, "pending": _pending_futures(rank)}
    for mode in MODES:
        a, b = _run(rank, mode, True), _run(rank, mode, False)
        out["equal"][mode["compression"]] = (
            a["losses"] == b["losses"]
            and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
            and a["bytes"] == b["bytes"]
            and a["losses"][-1] < a["losses"][0]
        )
    dist.barrier()
    return out


def test_overlapped_hook_equals_the_blocking_one_and_really_overlaps() -> None:
    for r in run_ranks(_all, len(LAYOUT)):
        assert r["equal"] == {m["compression"]: True for m in MODES}
        assert len(r["pending"]) >= 4 and not any(r["pending"]), r["pending"]


# -- failure paths: a stuck or dead peer during an overlapped exchange ------------------
def _failing_peer(rank: int, world: int, how: str) -> dict[str, Any] | None:
    """Rank 0 (site a's leader) stalls past the timeout or dies after two good steps; the
    other ranks' backward must raise CommError, within a bounded time, never hang."""
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.005)  # several buckets queued on the comm thread
    state = WanSyncState(
        ["a", "b", "b"],
        compression="none",
        parameters=model.parameters(),
        timeout=datetime.timedelta(seconds=3),
    )
    assert state.overlap
    ddp.register_comm_hook(state, wan_sync_hook)
    for _ in range(2):  # good steps: the first, then the one where DDP rebuilds its
        ddp(torch.randn(8, 16)).sum().backward()  # buckets (its own collective, on forward)
    if rank == 0:
        if how == "dead":
            # Its connections close, as a dead process's would.
            dist.destroy_process_group()
        else:
            time.sleep(8)  # past the others' timeout
        return None
    t0 = time.monotonic()
    try:
        ddp(torch.randn(8, 16)).sum().backward()
        error, kind = "", ""
    except Exception as exc:  # what DDP's backward raised
        error, kind = str(exc), type(exc).__name__
    return {"error": error, "type": kind, "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("how", ["stuck", "dead"])
def test_a_failing_peer_during_an_overlapped_exchange_is_a_comm_error(how: str) -> None:
    results = run_ranks(_failing_peer, 3, how)
    assert results[0] is None
    # Rank 1 leads site b and exchanges with site a's leader: its backward must fail with
    # the CommError of the bucket's exchange, in bounded time (timeout 3 s).
    assert results[1]["type"] == "CommError", results[1]
    assert "failed at step" in results[1]["error"]
    assert results[1]["seconds"] < 30
    # Rank 2 waits for rank 1's broadcast in the site: it fails too, never hangs.
    assert results[2]["type"] == "CommError", results[2]
    assert results[2]["seconds"] < 30
