"""Wide-area gradient sync: hierarchical all-reduce with top-k on the long links.

Two entry points (DESIGN.md §6):
  - for any PyTorch DDP job::

        state = WanSyncState(site_of_rank=[...], compression="topk", density=0.001)
        ddp.register_comm_hook(state, wan_sync_hook)

  - for the 3D runtime, per stage: `sync_gradients(state, grads)`;
  - outer-step sync (DiLoCo): `WanSyncState(..., compression="outer")` averages inside each
    site every step, `OuterStep(state, params, every=H, values="int8")` exchanges the
    pseudo-gradient across sites every H steps (`outer.after_step()` after each
    optimizer step).
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
from cpn.comm.outer import OUTER_VALUES, OuterStep
from cpn.comm.schedule import SparseSchedule, choose_wan_compression
from cpn.comm.state import WanSyncState
from cpn.comm.sync import compress, sync_flat, sync_gradients
from cpn.comm.traffic import LINK_CLASSES, LinkClass, Traffic

__all__ = [
    "LINK_CLASSES",
    "OUTER_VALUES",
    "CommError",
    "LinkClass",
    "Member",
    "OuterStep",
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
