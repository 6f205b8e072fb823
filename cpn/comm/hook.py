"""The DDP entry point: `ddp.register_comm_hook(state, wan_sync_hook)`.

DDP hands the hook one fused bucket of gradients at a time, in the order they become
ready, and expects a future of the averaged bucket (DDP does not divide by the world size
when a hook is registered). With `state.overlap` (the default) the bucket's sync runs on
the state's one comm thread and the future completes when its exchange is done: the
backward pass of earlier layers goes on while later buckets cross the WAN, and DDP waits
for every future at the end of backward. One thread runs the buckets in the order they
came, so the collectives, the byte counts and the results are those of the blocking sync
(tested bit for bit). `overlap=False` syncs in the hook and returns a completed future.

A bucket whose average is not finite comes back as it is (an AMP GradScaler sees the inf
and skips the step) and leaves the error-feedback state alone; `state.skipped_steps`
counts such steps. A collective that fails fails its future and every later bucket's of
the step (without waiting for another timeout), and the step's last hook call raises the
`CommError` itself, so DDP's backward raises it with its type (tested: a stalled and a dead
peer during an overlapped exchange).
"""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket and Future[Tensor] as objects, not strings.

import torch
from torch._C._distributed_c10d import GradBucket  # what torch.distributed re-exports

from cpn.comm.state import WanSyncState
from cpn.comm.sync import sync_flat


def wan_sync_hook(state: WanSyncState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP bucket over the ranks with `state`'s site-aware sync."""
    buf = bucket.buffer()
    params = bucket.parameters()
    sizes = [p.numel() for p in params]
    if sum(sizes) != buf.numel():
        # Not a plain concatenation of its parameters (never seen with CPU/gloo DDP):
        # key the state by the bucket as a whole instead.
        slots, sizes = [-1 - bucket.index()], [buf.numel()]
    else:
        slots = state.slots_of(params)
    last = bucket.is_last()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def work() -> None:
        failed = state.hook_failure
        if failed is not None:  # an earlier bucket of this step failed: no more waiting
            fut.set_exception(failed)  # type: ignore[arg-type]
            return
        try:
            averaged = sync_flat(state, buf, slots, sizes).to(buf.dtype)
            if last:
                state.end_step()
        except Exception as exc:
            state.hook_failure = exc
            fut.set_exception(exc)  # type: ignore[arg-type]
        else:
            fut.set_result(averaged)

    if state.overlap:
        job = state.comm_thread().submit(work)
        if not last:
            return fut
        # DDP buckets are handed over in order, so the last one's hook is the step's last
        # call: nothing is left to overlap with, and waiting here lets the step's first
        # error be raised as itself (DDP turns a failed future into a RuntimeError
        # "Unable to cast …"; an exception raised by the hook keeps its type).
        job.result()
    else:
        work()
    failed, state.hook_failure = state.hook_failure, None
    if failed is not None:
        raise failed
    return fut
