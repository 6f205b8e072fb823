"""The DDP entry point: `ddp.register_comm_hook(state, wan_sync_hook)`.

DDP hands the hook one fused bucket of gradients at a time, in the order they become
ready, and expects a future of the averaged bucket (DDP does not divide by the world size
when a hook is registered). The sync here is blocking, so the future is already complete
when it is returned; DDP still overlaps the remaining backward pass with buckets that are
not ready yet. A bucket whose average is not finite comes back as it is (an AMP
GradScaler sees the inf and skips the step) and leaves the error-feedback state alone;
`state.skipped_steps` counts such steps.
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
    averaged = sync_flat(state, buf, slots, sizes).to(buf.dtype)
    if bucket.is_last():
        state.end_step()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(averaged)
    return fut
