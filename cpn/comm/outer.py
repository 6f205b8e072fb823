"""Outer-step sync (DiLoCo, Douillard et al. 2023): sites train apart for H steps, then
exchange how far they moved.

Every step each site averages its gradients inside the site (`WanSyncState` with
`compression="outer"`: reduce to the leader, broadcast back; nothing crosses the WAN) and
its inner optimizer (AdamW) steps. Every `every` (H) steps the sites exchange their
pseudo-gradient — how far the parameters moved since the last outer step,
`Δ = anchor − θ` — through the same hierarchy: the site leaders exchange, each
contributing its site's share of the mean (`Δ · ranks at the site / ranks`), then
broadcast the mean in the site. Across sites the values go as

  - `dense`: a ring all-reduce in the state's `wire_dtype`;
  - `fp16`: a ring all-reduce in fp16 (the mean's shares, so the sum cannot overflow);
  - `int8` / `int4`: every value quantised with one scale per block (`cpn.comm.quant`),
    all-gathered and summed; the rounding error stays in a residual (error feedback);
  - `topk`: the `density` largest entries (`cpn.comm.codec`), all-gathered; the rest
    stays in the residual.

Then every rank applies the outer optimizer to its copy of the anchor — SGD with
Nesterov momentum (DiLoCo's lr 0.7, momentum 0.9), torch's own `torch.optim.SGD` with
the mean pseudo-gradient as the anchor's gradient — and sets its parameters to the new
anchor. Every rank receives the same mean and holds the same anchor, so all replicas are
equal again after each outer step. With `every=1`, `lr=1`, `momentum=0`, dense values and
an inner optimizer that is linear in the gradient (plain SGD), this is per-step dense sync
(tested).

Bytes: one exchange per H steps, counted in the state's `Traffic` like every collective;
`cpn.costmodel.Workload` predicts them (`dp_wan_bytes_per_sync`) from `cpn.wire`.

A pseudo-gradient that is not finite somewhere (a site diverged) voids the outer step:
nobody commits residuals or steps the outer optimizer, every rank goes back to the anchor,
and `skipped` counts it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from cpn import wire
from cpn.comm.collectives import all_reduce, broadcast_from_first
from cpn.comm.state import WanSyncState
from cpn.comm.sync import _Window, saturate, send_with_feedback

OUTER_VALUES: tuple[str, ...] = ("dense", "fp16", "int8", "int4", "topk")
#: DiLoCo's outer optimizer: SGD, Nesterov momentum 0.9, learning rate 0.7.
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


class OuterStep:
    """The outer loop of one data-parallel group on this rank.

    Arguments:
      state: the group's `WanSyncState` with `compression="outer"` (its groups, byte
        counter, wire dtype, bucket size, seed and quantisation block are used here).
      params: the tensors the replicas keep equal (a model's parameters, in a fixed
        order: the position is the key of the residuals).
      every: H, inner steps between outer steps.
      values: how pseudo-gradients cross the WAN (`OUTER_VALUES`).
      density: fraction of entries sent under `values="topk"`, in (0, 1].
      lr, momentum: the outer optimizer (SGD; Nesterov when momentum > 0).
    """

    def __init__(
        self,
        state: WanSyncState,
        params: Iterable[torch.Tensor],
        *,
        every: int,
        values: str = "fp16",
        density: float = 0.01,
        lr: float = OUTER_LR,
        momentum: float = OUTER_MOMENTUM,
    ) -> None:
        if state.compression != "outer":
            raise ValueError(
                f"state: compression must be 'outer' (in-site sync only), got {state.compression!r}"
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every: must be an integer ≥ 1, got {every!r}")
        if values not in OUTER_VALUES:
            raise ValueError(f"values: must be one of {', '.join(OUTER_VALUES)}, got {values!r}")
        if isinstance(density, bool) or not 0.0 < float(density) <= 1.0:
            raise ValueError(f"density: must be in (0, 1], got {density!r}")
        if not lr > 0:
            raise ValueError(f"lr: must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum: must be in [0, 1), got {momentum}")
        self.state = state
        self.params = list(params)
        self.every, self.values, self.density = every, values, float(density)
        self.anchors = [p.detach().clone() for p in self.params]
        self.optimizer = torch.optim.SGD(
            self.anchors, lr=lr, momentum=momentum, nesterov=momentum > 0
        )
        #: Error feedback of the exchanging ranks (int8, int4, top-k), by position.
        self.residuals: dict[int, torch.Tensor] = {}
        self.inner_steps = 0  # since the last outer step
        self.outer_steps = 0
        #: Outer steps voided because the pseudo-gradient was not finite somewhere.
        self.skipped = 0

    @property
    def bits(self) -> int | None:
        return wire.QUANT_BITS.get(self.values)

    @property
    def feedback(self) -> bool:
        return self.values in ("int8", "int4", "topk")

    def after_step(self) -> bool:
        """Call after each inner optimizer step; runs the outer step every H calls.
        True when an outer step ran this call."""
        self.inner_steps += 1
        if self.inner_steps < self.every:
            return False
        self.sync()
        return True

    def sync(self) -> bool:
        """The outer step now (collective over the group). True if it was applied, False
        if the pseudo-gradient was not finite somewhere (then every rank is back at the
        anchor and nothing was committed)."""
        numels = [p.numel() for p in self.params]
        means: list[torch.Tensor | None] = [None] * len(self.params)
        commits: list[Callable[[], None]] = []
        finite = True
        for bucket in wire.fuse(numels, self.state.bucket_elements):
            sizes = [numels[i] for i in bucket]
            if sum(sizes) == 0:
                continue
            delta = torch.cat(
                [
                    (self.anchors[i] - self.params[i].detach()).reshape(-1).to(torch.float32)
                    for i in bucket
                ]
            )
            mean = self._mean(delta, bucket, sizes, commits)
            finite = finite and bool(torch.isfinite(mean).all())
            offset = 0
            for i, n in zip(bucket, sizes, strict=True):
                means[i] = mean[offset : offset + n]
                offset += n
        self.inner_steps = 0
        self.outer_steps += 1
        if not finite:
            self.skipped += 1
        else:
            for commit in commits:
                commit()
            for anchor, got in zip(self.anchors, means, strict=True):
                anchor.grad = (
                    torch.zeros_like(anchor)
                    if got is None
                    else got.view_as(anchor).to(anchor.dtype)
                )
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, anchor in zip(self.params, self.anchors, strict=True):
                p.copy_(anchor)
        return finite

    def _mean(
        self,
        delta: torch.Tensor,
        slots: Sequence[int],
        sizes: Sequence[int],
        commits: list[Callable[[], None]],
    ) -> torch.Tensor:
        """The group's mean pseudo-gradient of one bucket, on every rank."""
        state = self.state
        g = state.groups
        if g.world == 1:
            return delta
        if g.leaders is not None:  # this rank leads its site
            share = delta * (g.local.size / g.world)
            total = share
            if g.leaders.size > 1:
                total = self._exchange(share, slots, sizes, commits)
            out = saturate(total, state.wire_dtype)
        else:
            out = torch.empty(delta.numel(), dtype=state.wire_dtype, device=delta.device)
        result = broadcast_from_first(
            out, g.local, state.traffic, "intra_site", what="the broadcast of the outer step"
        )
        return result.to(torch.float32)

    def _exchange(
        self,
        share: torch.Tensor,
        slots: Sequence[int],
        sizes: Sequence[int],
        commits: list[Callable[[], None]],
    ) -> torch.Tensor:
        state = self.state
        leaders = state.groups.leaders
        assert leaders is not None
        if not self.feedback:
            dtype = torch.float16 if self.values == "fp16" else state.wire_dtype
            total = all_reduce(
                saturate(share, dtype), leaders, state.traffic, "wan", what="the outer step"
            )
            return total.to(torch.float32)
        window = _Window(state, slots, sizes, 0, share.numel())
        res_full, acc = window.load(self.residuals, share.device)
        acc += share
        total, _ = send_with_feedback(
            state,
            acc,
            leaders,
            finite=bool(torch.isfinite(share).all()),
            density=self.density,
            bits=self.bits,
            seed_step=self.outer_steps,
            what="the outer step",
        )
        commits.append(lambda: window.save(self.residuals, res_full))
        return total

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "skipped": self.skipped,
            "anchors": [a.detach().clone() for a in self.anchors],
            "residuals": {k: v.clone() for k, v in self.residuals.items()},
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.inner_steps = int(saved["inner_steps"])
        self.outer_steps = int(saved["outer_steps"])
        self.skipped = int(saved.get("skipped", 0))
        with torch.no_grad():
            for anchor, value in zip(self.anchors, saved["anchors"], strict=True):
                anchor.copy_(value)
        self.residuals = {int(k): v.clone() for k, v in saved["residuals"].items()}
        self.optimizer.load_state_dict(saved["optimizer"])

    def __repr__(self) -> str:
        return (
            f"OuterStep(every={self.every}, values={self.values!r}, "
            f"outer_steps={self.outer_steps}, inner_steps={self.inner_steps})"
        )
