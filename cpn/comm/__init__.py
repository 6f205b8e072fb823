"""Wide-area gradient sync: hierarchical all-reduce with top-k on the long links.

Two entry points (DESIGN.md §6):
  - for any PyTorch DDP job::

        state = WanSyncState(site_of_rank=[...], compression="topk", density=0.001)
        ddp.register_comm_hook(state, wan_sync_hook)

  - for the 3D runtime, per stage: `sync_gradients(state, grads)`.
`state.bytes_sent` gives the bytes this rank sent, by link class ("intra_site", "wan").
"""

from cpn.comm.collectives import WanSyncError
from cpn.comm.groups import SiteGroups, build_site_groups
from cpn.comm.hook import wan_sync_hook
from cpn.comm.schedule import SparseSchedule, choose_wan_compression
from cpn.comm.state import WanSyncState
from cpn.comm.sync import compress, sync_flat, sync_gradients

__all__ = [
    "SiteGroups",
    "SparseSchedule",
    "WanSyncError",
    "WanSyncState",
    "build_site_groups",
    "choose_wan_compression",
    "compress",
    "sync_flat",
    "sync_gradients",
    "wan_sync_hook",
]
