"""Data-parallel sync of one (stage, tensor-parallel index) slice of every replica.

All of it is `cpn.comm`'s (`WanSyncState`, `sync_gradients`), counted in the worker's one
`Traffic`; what is decided here is what the runtime knows about its model:
  - `hierarchical` (the default): reduce in the site, exchange across sites with the
    job's WAN compression, broadcast back. Under top-k with tp > 1 the parameters every
    tensor-parallel worker holds whole (LayerNorms, row-parallel biases) are synced dense
    in a state of their own: compressing each worker's copy separately would let the
    copies drift apart, and they are small;
  - `flat`: one ring all-reduce over all replicas, sites ignored, as PyTorch DDP does —
    the baseline cpn's wide-area sync is measured against.
What goes where follows the cost model (`cpn.costmodel`), so that the bytes this worker
counts equal the plan's prediction: in the site the whole gradient in the training dtype;
across sites a dense ring among site leaders (`none`/`fp16`) or the leaders' top-k or
low-bit (`int8`/`int4`) payloads, all-gathered. Gradients are fused into `cpn.wire.fuse`
buckets over the parameters each exchange covers, the buckets the cost model predicts from.

Under `wan: outer` (DiLoCo) the per-step sync stays inside the site and `after_step`
runs a `cpn.comm.OuterStep` every H steps: the pseudo-gradients cross the WAN with the
job's `values` (tp > 1 with int8/int4/top-k values: the parameters held whole go dense, as
above). `finish` runs a last outer step at the end of training when steps since the last
one remain, so that a run always ends with one model.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import torch

from cpn import wire
from cpn.comm import OuterStep, Traffic, WanSyncState, build_site_groups, sync_gradients
from cpn.comm.outer import OUTER_LR, OUTER_MOMENTUM
from cpn.contracts.job import JobSpec, OuterValues, WanCompression
from cpn.gpt_shapes import stage_parameters
from cpn.train.layout import Layout

DpSync = Literal["hierarchical", "flat"]
DP_SYNCS: tuple[str, ...] = ("hierarchical", "flat")

#: Density warm-up when the job does not say: a tenth of the run, at most this many steps.
MAX_DEFAULT_WARMUP_STEPS = 200


def default_warmup_steps(job: JobSpec) -> int:
    given = job.compression.warmup_steps
    if given is not None:
        return given
    return min(MAX_DEFAULT_WARMUP_STEPS, job.train.steps // 10)


class DataParallelSync:
    """Averages this worker's stage gradients over the replicas, in place."""

    def __init__(
        self,
        layout: Layout,
        job: JobSpec,
        traffic: Traffic,
        wire_dtype: torch.dtype,
        timeout: timedelta,
        mode: DpSync = "hierarchical",
        bucket_elements: int = wire.DEFAULT_BUCKET_ELEMENTS,
    ) -> None:
        # Collective: every worker builds the groups of every data-parallel group (once:
        # a `switch` of `wan: auto` reuses them).
        self._groups = build_site_groups(layout.site_of_rank, layout.dp_groups, timeout=timeout)
        self._layout, self._mode = layout, mode
        self._common: dict[str, Any] = {
            "site_groups": self._groups,
            "wire_dtype": wire_dtype,
            "bucket_elements": bucket_elements,
            "timeout": timeout,
            "traffic": traffic,
        }
        self._params: list[torch.Tensor] = []
        self._configure(job)

    def _configure(self, job: JobSpec) -> None:
        layout, mode, common = self._layout, self._mode, self._common
        par = layout.plan.parallel
        comp = job.compression
        wan = comp.wan
        self.outer = mode == "hierarchical" and wan is WanCompression.OUTER
        feedback = wan in (WanCompression.TOPK, WanCompression.INT8, WanCompression.INT4) or (
            self.outer and comp.outer_values.feedback
        )
        shapes = stage_parameters(job.model, par.pp, par.tp, layout.me.stage)
        whole_dense = mode == "hierarchical" and feedback and par.tp > 1
        self.sparse_positions = [i for i, p in enumerate(shapes) if not whole_dense or p.sharded]
        self.dense_positions = [i for i, p in enumerate(shapes) if whole_dense and not p.sharded]
        self.numels = [p.numel for p in shapes]
        if mode == "flat":
            self.main = WanSyncState(
                layout.site_of_rank, compression="none", hierarchy="flat", **common
            )
        else:
            self.main = WanSyncState(
                layout.site_of_rank,
                compression=wan.value,  # none | fp16 | topk | int8 | int4 | outer
                density=comp.effective_density,
                warmup_steps=default_warmup_steps(job),
                seed=job.train.seed,
                **common,
            )
        self.whole = (
            WanSyncState(
                layout.site_of_rank, compression="outer" if self.outer else "none", **common
            )
            if self.dense_positions
            else None
        )
        self._pending: dict[int, torch.Tensor] = {}
        self._job = job
        #: Under `wan: outer`, the outer steps of `main` and `whole` (`attach`).
        self.outer_steps: list[OuterStep] = []

    def switch(self, job: JobSpec) -> None:
        """Run `job`'s compression from the next step on (`wan: auto` moving its rung).
        Only at an outer boundary, where every replica holds the same parameters: a new
        outer step takes them as its anchor. The outer error feedback is carried over
        when both syncs keep one over the same parameters; the step counters of the
        per-step state start again (they only drive top-k's density warm-up)."""
        if not self.at_outer_boundary:
            raise RuntimeError("dp sync: a switch of the WAN sync between outer steps")
        old = self.outer_steps
        self._configure(job)
        self.attach(self._params)
        for before, after in zip(old, self.outer_steps, strict=False):
            if before.feedback and after.feedback and len(before.params) == len(after.params):
                after.residuals = before.residuals

    def attach(self, params: Sequence[torch.Tensor]) -> None:
        """Give the outer steps the stage's parameters (module order), once, before the
        first step; nothing to do unless `wan: outer`."""
        self._params = list(params)
        if not self.outer:
            return
        comp = self._job.compression
        kw: dict[str, Any] = {
            "every": comp.outer_every,
            "lr": comp.outer_lr if comp.outer_lr is not None else OUTER_LR,
            "momentum": comp.outer_momentum if comp.outer_momentum is not None else OUTER_MOMENTUM,
        }
        self.outer_steps = [
            OuterStep(
                self.main,
                [params[i] for i in self.sparse_positions],
                values=comp.outer_values.value,
                density=comp.effective_density,
                **kw,
            )
        ]
        if self.whole is not None:
            dense = [params[i] for i in self.dense_positions]
            self.outer_steps.append(
                OuterStep(self.whole, dense, values=OuterValues.DENSE.value, **kw)
            )

    def after_step(self) -> bool:
        """After each optimizer step: the outer step when H steps have passed (True)."""
        ran = [outer.after_step() for outer in self.outer_steps]
        return any(ran)

    def finish(self) -> bool:
        """At the end of training: a last outer step if inner steps remain since one."""
        if not self.outer_steps or self.outer_steps[0].inner_steps == 0:
            return False
        for outer in self.outer_steps:
            outer.sync()
        return True

    @property
    def at_outer_boundary(self) -> bool:
        """Whether every replica holds the same parameters (always, unless `wan: outer`
        is between two outer steps): when a checkpoint may be written."""
        return all(outer.inner_steps == 0 for outer in self.outer_steps)

    def flush(self, mass: dict[int, torch.Tensor]) -> None:
        """Sync the next step dense, adding `mass` (by parameter position, in sums of
        gradients) to this worker's gradients first: error feedback a resumed run could
        not map onto its layout reaches the model instead of being lost."""
        self._pending = dict(mass)
        self.main.flush_next = True

    def sync(self, grads: Sequence[torch.Tensor]) -> bool:
        """Average `grads` (module parameter order) in place; True if they were not finite
        somewhere in the group (skip the optimizer step: nothing entered the residuals)."""
        numels = [g.numel() for g in grads]
        if numels != self.numels:
            raise RuntimeError(
                "dp sync: the stage's gradients do not match the parameter shapes the cost "
                f"model uses ({len(numels)} tensors vs {len(self.numels)})"
            )
        for position, extra in self._pending.items():
            grads[position].add_(extra.view_as(grads[position]))
        self._pending = {}
        sparse = [grads[i] for i in self.sparse_positions]
        if self.whole is not None and sync_gradients(
            self.whole, [grads[i] for i in self.dense_positions]
        ):
            # Every rank of the group saw the same non-finite dense result: void the
            # sparse exchange too, so that no residual takes in a step that is skipped.
            for g in sparse:
                g.fill_(float("nan"))
        return sync_gradients(self.main, sparse)

    @property
    def skipped_steps(self) -> int:
        return self.main.skipped_steps

    def state_dict(self) -> dict[str, Any]:
        return {
            "main": self.main.state_dict(),
            "whole": self.whole.state_dict() if self.whole is not None else None,
            "outer": [outer.state_dict() for outer in self.outer_steps],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.main.load_state_dict(state["main"])
        if self.whole is not None and state.get("whole") is not None:
            self.whole.load_state_dict(state["whole"])
        for outer, saved in zip(self.outer_steps, state.get("outer", []), strict=False):
            outer.load_state_dict(saved)
