"""Data-parallel sync of one stage slice through `cpn.comm`: reduce in the site, exchange
across sites with the job's WAN compression, broadcast back.

What goes where follows the cost model (`cpn.costmodel`), so that the bytes this worker
counts equal the plan's prediction:
  - in the site: the whole gradient in the training dtype;
  - across sites, `none` / `fp16`: a dense ring all-reduce among site leaders;
  - across sites, `topk`: each leader's top-k payload, all-gathered. With tp > 1 the
    parameters every tensor-parallel worker holds whole (LayerNorms, row-parallel biases)
    are synced dense instead: compressing each worker's copy separately would let the
    copies drift apart, and they are small.
Gradients are fused into `cpn.wire.fuse` buckets over the parameters each exchange covers,
the buckets the cost model predicts from.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from cpn import wire
from cpn.comm import WanSyncState, build_site_groups, sync_gradients
from cpn.contracts.job import JobSpec, WanCompression
from cpn.gpt_shapes import stage_parameters
from cpn.train.comms import ByteCounters
from cpn.train.layout import Layout

#: Density warm-up when the job does not say: a tenth of the run, at most this many steps.
MAX_DEFAULT_WARMUP_STEPS = 200


def default_warmup_steps(job: JobSpec) -> int:
    given = job.compression.warmup_steps
    if given is not None:
        return given
    return min(MAX_DEFAULT_WARMUP_STEPS, job.train.steps // 10)


class HierarchicalSync:
    """`GradientSync` for this worker's (stage, tp index) slice of every replica."""

    def __init__(
        self,
        layout: Layout,
        job: JobSpec,
        counters: ByteCounters,
        wire_dtype: torch.dtype,
        timeout: timedelta,
        bucket_elements: int = wire.DEFAULT_BUCKET_ELEMENTS,
    ) -> None:
        par = layout.plan.parallel
        # Collective: every worker builds the groups of every data-parallel group.
        groups = build_site_groups(layout.site_of_rank, layout.dp_groups, timeout=timeout)
        self.counters = counters
        wan = job.compression.wan
        shapes = stage_parameters(job.model, par.pp, par.tp, layout.me.stage)
        whole_dense = wan is WanCompression.TOPK and par.tp > 1
        self.sparse_positions = [i for i, p in enumerate(shapes) if not whole_dense or p.sharded]
        self.dense_positions = [i for i, p in enumerate(shapes) if whole_dense and not p.sharded]
        self.numels = [p.numel for p in shapes]
        common: dict[str, Any] = {
            "site_groups": groups,
            "wire_dtype": wire_dtype,
            "bucket_elements": bucket_elements,
            "timeout": timeout,
        }
        self.main = WanSyncState(
            layout.site_of_rank,
            compression=wan.value,  # none | fp16 | topk: the library's names
            density=job.compression.effective_density,
            warmup_steps=default_warmup_steps(job),
            seed=job.train.seed,
            **common,
        )
        self.whole = (
            WanSyncState(layout.site_of_rank, compression="none", **common)
            if self.dense_positions
            else None
        )
        self._seen = self._totals()

    def sync(self, grads: Sequence[torch.Tensor]) -> None:
        numels = [g.numel() for g in grads]
        if numels != self.numels:
            raise RuntimeError(
                "dp sync: the stage's gradients do not match the parameter shapes the cost "
                f"model uses ({len(numels)} tensors vs {len(self.numels)})"
            )
        sync_gradients(self.main, [grads[i] for i in self.sparse_positions])
        if self.whole is not None:
            sync_gradients(self.whole, [grads[i] for i in self.dense_positions])
        self._count()

    def _totals(self) -> dict[str, int]:
        """Bytes both states have sent so far, by link class."""
        states = [self.main] if self.whole is None else [self.main, self.whole]
        return {link: sum(s.bytes_sent[link] for s in states) for link in ("intra_site", "wan")}

    def _count(self) -> None:
        totals = self._totals()
        for link, total in totals.items():
            self.counters.add(link, total - self._seen[link])
        self._seen = totals

    def state_dict(self) -> dict[str, Any]:
        return {
            "main": self.main.state_dict(),
            "whole": self.whole.state_dict() if self.whole is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.main.load_state_dict(state["main"])
        if self.whole is not None and state.get("whole") is not None:
            self.whole.load_state_dict(state["whole"])
        self._seen = self._totals()
