"""Data-parallel gradient sync for one (stage, tensor-parallel index) group.

Two implementations behind one small interface:
  - `FlatAllReduce`: one ring all-reduce over all replicas, as PyTorch DDP does. It ignores
    sites, so every ring link between sites carries 2·(n−1)/n of the gradient: the
    baseline that cpn's wide-area sync is measured against;
  - the hierarchical, compressed sync of `cpn.comm` (reduce in each site, exchange between
    sites, top-k on the WAN), selected by the job's `compression`.
Gradients are fused into the buckets `cpn.wire.fuse` defines (the cost model predicts
bytes from the same buckets) and averaged over the replicas in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from cpn import wire
from cpn.train.comms import ByteCounters, Group, all_reduce
from cpn.train.layout import Layout


class GradientSync(Protocol):
    def sync(self, grads: Sequence[torch.Tensor]) -> None:
        """Average `grads` (module parameter order) over the replicas, in place."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FlatAllReduce:
    """Ring all-reduce over the data-parallel group, sites ignored (the DDP baseline)."""

    def __init__(
        self,
        group: Group,
        layout: Layout,
        counters: ByteCounters,
        wire_dtype: torch.dtype,
        bucket_elements: int = wire.DEFAULT_BUCKET_ELEMENTS,
    ) -> None:
        self.group, self.counters, self.wire_dtype = group, counters, wire_dtype
        self.bucket_elements = bucket_elements
        # In a ring each member sends to the next one: that link decides the class.
        following = group.ranks[(group.position + 1) % group.size]
        self.link_class = layout.pipeline_class(following)

    def sync(self, grads: Sequence[torch.Tensor]) -> None:
        if self.group.size == 1:
            return
        numels = [g.numel() for g in grads]
        for bucket in wire.fuse(numels, self.bucket_elements):
            flat = torch.cat([grads[i].reshape(-1) for i in bucket])
            total = all_reduce(flat, self.group, self.counters, self.link_class, self.wire_dtype)
            total /= self.group.size
            offset = 0
            for i in bucket:
                n = numels[i]
                grads[i].copy_(total[offset : offset + n].view_as(grads[i]))
                offset += n

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state  # stateless
