"""`WanSyncState`: the configuration and the memory of site-aware gradient sync.

One object per data-parallel group on each rank. It holds the groups (built from the
rank → site map), what to send across sites (dense in the training dtype, fp16 or bf16;
or top-k with error feedback), the per-parameter error-feedback residuals and DGC
momentum of the ranks that exchange across sites, the step (for warm-up), the steps it
refused to fold into that memory because a gradient was not finite, and the bytes this
rank sent by link class (a `Traffic`, which the 3D runtime shares with its other
collectives). Residuals and momentum are kept per parameter, not per bucket, so that DDP
rebuilding its buckets after the first iteration, or a checkpoint restored into
differently fused buckets, keeps them; they live on the gradients' device.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import torch

from cpn import wire
from cpn.comm.codec import VALUE_DTYPES
from cpn.comm.groups import SiteGroups, build_site_groups
from cpn.comm.schedule import SparseSchedule
from cpn.comm.traffic import Traffic

Compression = Literal["none", "fp16", "bf16", "topk", "auto", "int8", "int4", "outer"]
Hierarchy = Literal["leader", "sharded", "flat"]

COMPRESSIONS: tuple[str, ...] = ("none", "fp16", "bf16", "topk", "auto", "int8", "int4", "outer")
#: Modes whose exchanging ranks keep an error-feedback residual.
FEEDBACK: tuple[str, ...] = ("topk", "auto", "int8", "int4")
HIERARCHIES: tuple[str, ...] = ("leader", "sharded", "flat")
WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: `compression="auto"` starts with this many dense fp16 steps unless told otherwise.
AUTO_DENSE_STEPS = 50
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


class WanSyncState:
    """Site-aware gradient sync for one data-parallel group (see `cpn.comm`).

    Construct it on every rank after `torch.distributed.init_process_group`: unless
    `site_groups` is given it creates process groups, which is collective.

    Arguments:
      site_of_rank: the site of every global rank (must cover the world).
      groups: the data-parallel groups (disjoint rank lists); default: the whole world.
      site_groups: groups already built by `build_site_groups` (shared between states).
      compression: across sites, "none" (dense, in `wire_dtype`), "fp16", "bf16", "topk"
        (top-k with error feedback at `density`), "auto" (dense fp16 for `dense_steps`,
        default 50, then top-k), "int8"/"int4" (every value, quantised with one scale per
        `quant_block` values, error feedback) or "outer" (gradients are averaged inside
        each site only; an `OuterStep` exchanges pseudo-gradients across sites every H
        steps: `cpn.comm.outer`).
      density: fraction of each bucket's entries a site sends under top-k, in (0, 1].
      hierarchy: "leader" (reduce to a site leader, leaders exchange, broadcast back),
        "sharded" (reduce-scatter in the site, each local rank exchanges its shard across
        sites, all-gather; needs equal ranks per site) or "flat" (one ring over every rank,
        sites ignored: the DDP baseline; dense only).
      wire_dtype: dtype inside the site and of dense "none" exchanges; default fp32.
      value_dtype: dtype of top-k values on the WAN ("fp16", "bf16" or "fp32").
      bucket_elements: tensor fusion cap for `sync_gradients` (DDP hooks use DDP's buckets).
      quant_block: values sharing one scale under "int8"/"int4".
      warmup_steps, warmup_density: top-k density ramps geometrically from warmup_density
        to density over this many steps (DGC's warm-up).
      dense_steps: dense fp16 steps before top-k starts (residuals carried through).
      momentum: DGC momentum correction (use it with an optimizer *without* momentum);
        0 disables it. Momentum factor masking clears it where entries were sent.
      clip_norm: local clipping of the site's mean gradient per bucket before it enters
        the accumulator (DGC's local gradient clipping); None disables it.
      timeout: how long a collective waits for a peer before failing with CommError.
      seed: seeds the sampled top-k threshold (the same on every rank, so runs repeat).
      parameters: the model's parameters, so that DDP-hook state is keyed by position
        (needed for `state_dict` to load into a new process); default: first-seen order.
      traffic: the byte counter to add to (the runtime passes the worker's own, shared by
        all its collectives); default: a fresh one, read through `bytes_sent`.
      overlap: the DDP hook syncs each bucket on a comm thread of its own and returns a
        future that completes when the bucket's exchange is done, so backward goes on
        meanwhile (`cpn.comm.hook`); False: the hook blocks.
    """

    def __init__(
        self,
        site_of_rank: Sequence[str],
        *,
        groups: Sequence[Sequence[int]] | None = None,
        site_groups: SiteGroups | None = None,
        compression: Compression = "topk",
        density: float = 0.001,
        hierarchy: Hierarchy = "leader",
        wire_dtype: torch.dtype = torch.float32,
        value_dtype: str = "fp16",
        bucket_elements: int = wire.DEFAULT_BUCKET_ELEMENTS,
        quant_block: int = wire.QUANT_BLOCK_ELEMENTS,
        warmup_steps: int = 0,
        warmup_density: float = 0.25,
        dense_steps: int | None = None,
        momentum: float = 0.0,
        clip_norm: float | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        seed: int = 0,
        parameters: Iterable[torch.nn.Parameter] | None = None,
        traffic: Traffic | None = None,
        overlap: bool = True,
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(
                f"compression: must be one of {', '.join(COMPRESSIONS)}, got {compression!r}"
            )
        if hierarchy not in HIERARCHIES:
            raise ValueError(
                f"hierarchy: must be one of {', '.join(HIERARCHIES)}, got {hierarchy!r}"
            )
        if isinstance(density, bool) or not 0.0 < float(density) <= 1.0:
            raise ValueError(f"density: must be in (0, 1], got {density!r}")
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype: must be float32, float16 or bfloat16, got {wire_dtype}")
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(
                f"value_dtype: must be one of {', '.join(VALUE_DTYPES)}, got {value_dtype!r}"
            )
        if quant_block < 1:
            raise ValueError(f"quant_block: must be ≥ 1, got {quant_block}")
        if bucket_elements < 1:
            raise ValueError(f"bucket_elements: must be ≥ 1, got {bucket_elements}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum: must be in [0, 1), got {momentum}")
        if clip_norm is not None and not 0 < clip_norm < math.inf:  # NaN fails too
            raise ValueError(f"clip_norm: must be a finite number > 0 or None, got {clip_norm}")
        if not isinstance(timeout, datetime.timedelta):
            raise ValueError(f"timeout: must be a datetime.timedelta, got {timeout!r}")
        if timeout.total_seconds() <= 0:
            raise ValueError(f"timeout: must be positive, got {timeout}")
        sparse = compression in ("topk", "auto")
        if hierarchy == "flat" and compression in (*FEEDBACK, "outer"):
            raise ValueError(
                "hierarchy: 'flat' is the dense baseline; use 'leader' or 'sharded' with "
                f"compression {compression!r}"
            )
        if hierarchy == "sharded" and compression == "outer":
            raise ValueError("hierarchy: 'outer' syncs through site leaders; use 'leader'")
        if dense_steps is None:
            dense_steps = AUTO_DENSE_STEPS if compression == "auto" else 0
        self.schedule = SparseSchedule(
            density=float(density),
            warmup_steps=warmup_steps if sparse else 0,
            warmup_density=warmup_density,
            dense_steps=dense_steps if sparse else 0,
        )
        self.groups = site_groups or build_site_groups(site_of_rank, groups, timeout=timeout)
        if hierarchy == "sharded" and not self.groups.even:
            raise ValueError(
                "hierarchy: 'sharded' needs the same number of ranks at every site; "
                "use 'leader' for uneven sites"
            )
        self.compression: Compression = compression
        self.hierarchy: Hierarchy = hierarchy
        self.wire_dtype = wire_dtype
        self.value_dtype = VALUE_DTYPES[value_dtype]
        self.bucket_elements = bucket_elements
        self.quant_block = quant_block
        self.momentum = float(momentum)
        self.clip_norm = clip_norm
        self.timeout = timeout
        self.seed = seed
        self.step = 0
        #: Steps whose gradient (somewhere in the group) was not finite: their sync returned
        #: a non-finite result and left the residuals and velocities as they were, so the
        #: caller can skip the optimizer step, as AMP's GradScaler does.
        self.skipped_steps = 0
        self._skip_this_step = False
        #: Send the next step dense whatever the schedule says (a resumed run flushing error
        #: feedback it could not map onto its layout).
        self.flush_next = False
        self.traffic = traffic if traffic is not None else Traffic()
        self.overlap = bool(overlap)
        self._comm_thread: ThreadPoolExecutor | None = None
        #: The first error of the overlapped hook's exchanges this step: later buckets of
        #: the step fail with it at once, and the step's last hook raises it.
        self.hook_failure: Exception | None = None
        #: Error-feedback residual and DGC velocity per parameter slot (exchanging ranks).
        self.residuals: dict[int, torch.Tensor] = {}
        self.velocities: dict[int, torch.Tensor] = {}
        self._slot_of: dict[int, int] = {}
        if parameters is not None:
            for p in parameters:
                self._slot_of.setdefault(id(p), len(self._slot_of))

    # -- what this rank does -----------------------------------------------------------
    @property
    def sparse(self) -> bool:
        return self.compression in ("topk", "auto")

    @property
    def feedback(self) -> bool:
        """Whether the exchanging ranks keep error-feedback residuals (top-k, int8, int4)."""
        return self.compression in FEEDBACK

    @property
    def quant_bits(self) -> int | None:
        """Bits per WAN value under "int8"/"int4", else None."""
        return wire.QUANT_BITS.get(self.compression)

    @property
    def in_site_only(self) -> bool:
        """Under "outer" the per-step sync stays inside the site (sites drift apart until
        the next outer step)."""
        return self.compression == "outer"

    @property
    def density(self) -> float:
        return self.schedule.density

    @property
    def prescaled(self) -> bool:
        """Whether buckets are divided by the group size before they travel: when some hop
        is narrow (fp16/bf16), so that sums that the mean would fit do not overflow."""
        return self.wire_dtype != torch.float32 or self.compression in ("fp16", "bf16")

    @property
    def averaged_over(self) -> int:
        """How many ranks one step's gradient is averaged over: the group, or the site."""
        return self.groups.local.size if self.in_site_only else self.groups.world

    @property
    def feedback_scale(self) -> float:
        """Residuals and velocities × this = sums of gradients (checkpoints store them so,
        whatever the group size of the run that reads them)."""
        return float(self.averaged_over) if self.prescaled else 1.0

    @property
    def bytes_sent(self) -> dict[str, int]:
        """Bytes this rank sent so far, by link class (its `traffic`'s totals)."""
        return self.traffic.snapshot()

    def slots_of(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Stable slots for DDP-bucket parameters (first-seen order unless given)."""
        return [self._slot_of.setdefault(id(p), len(self._slot_of)) for p in params]

    def buffer(
        self, store: dict[int, torch.Tensor], slot: int, numel: int, device: torch.device
    ) -> torch.Tensor:
        buf = store.get(slot)
        if buf is None or buf.numel() != numel or buf.device != device:
            buf = store[slot] = torch.zeros(numel, device=device)
        return buf

    def comm_thread(self) -> ThreadPoolExecutor:
        """The one thread that runs this state's overlapped bucket syncs, in order."""
        if self._comm_thread is None:
            self._comm_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpn-comm")
        return self._comm_thread

    def end_step(self) -> bool:
        """Close a step: advance the schedule; True if the step's gradient was not finite."""
        skipped = self._skip_this_step
        if skipped:
            self.skipped_steps += 1
        self._skip_this_step = False
        self.flush_next = False
        self.step += 1
        return skipped

    def mark_not_finite(self) -> None:
        self._skip_this_step = True

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "residuals": {k: v.clone() for k, v in self.residuals.items()},
            "velocities": {k: v.clone() for k, v in self.velocities.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.residuals = {int(k): v.clone() for k, v in state["residuals"].items()}
        self.velocities = {int(k): v.clone() for k, v in state["velocities"].items()}

    def __repr__(self) -> str:
        return (
            f"WanSyncState(site={self.groups.site!r}, compression={self.compression!r}, "
            f"density={self.density}, hierarchy={self.hierarchy!r}, step={self.step})"
        )
