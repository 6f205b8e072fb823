"""Wide-area gradient sync: hierarchical all-reduce with top-k on the long links.

Two entry points (DESIGN.md §6):
  - for any PyTorch DDP job::

        state = WanSyncState(site_of_rank=[...], compression="topk", density=0.001)
        ddp.register_comm_hook(state, wan_sync_hook)

  - for the 3D runtime, per stage: `sync_gradients(state, grads)`.
`state.bytes_sent` gives the bytes this rank sent, by link class ("intra_node",
"intra_site", "wan").

It is also the only place where the 3D runtime moves tensors between ranks
(`cpn.comm.collectives`: tensor-parallel all-reduces, pipeline sends, the flat ring), so
every worker counts its bytes in one `Traffic` and every failed collective is a
`CommError` naming the step, the operation and the ranks.
"""

from cpn.comm.errors import CommError
from cpn.comm.groups import Member, SiteGroups, build_site_groups, new_groups
from cpn.comm.hook import wan_sync_hook
from cpn.comm.schedule import SparseSchedule, choose_wan_compression
from cpn.comm.state import WanSyncState
from cpn.comm.sync import compress, sync_flat, sync_gradients
from cpn.comm.traffic import LINK_CLASSES, LinkClass, Traffic

__all__ = [
    "LINK_CLASSES",
    "CommError",
    "LinkClass",
    "Member",
    "SiteGroups",
    "SparseSchedule",
    "Traffic",
    "WanSyncState",
    "build_site_groups",
    "choose_wan_compression",
    "compress",
    "new_groups",
    "sync_flat",
    "sync_gradients",
    "wan_sync_hook",
]
