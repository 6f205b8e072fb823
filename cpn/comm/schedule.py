"""When to send what over the WAN: dense early, sparse later, density warmed up.

Top-k with error feedback converges like dense training once the model has settled, but
the first steps move every weight a lot: sending 0.1 % of a gradient that is large
everywhere delays most of it by hundreds of steps. Deep Gradient Compression warms the
density up (25 % → 6.25 % → … → the target over the first epochs); cpn does the same with
an exponential ramp over `warmup_steps`, optionally after `dense_steps` of dense fp16.
With a WAN fast enough for dense fp16 there is nothing to gain from sparsity at all:
`choose_wan_compression` makes that call from a measured bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

WanMode = Literal["none", "fp16", "topk"]


@dataclass(frozen=True)
class SparseSchedule:
    """Density of the WAN exchange at each step (None: a dense fp16 step)."""

    density: float
    warmup_steps: int = 0
    warmup_density: float = 0.25
    dense_steps: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density: must be in (0, 1], got {self.density}")
        if not 0.0 < self.warmup_density <= 1.0:
            raise ValueError(f"warmup_density: must be in (0, 1], got {self.warmup_density}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be ≥ 0, got {self.warmup_steps}")
        if self.dense_steps < 0:
            raise ValueError(f"dense_steps: must be ≥ 0, got {self.dense_steps}")

    def at(self, step: int) -> float | None:
        if step < self.dense_steps:
            return None
        t = step - self.dense_steps
        start = max(self.warmup_density, self.density)
        if t >= self.warmup_steps or start == self.density:
            return self.density
        # Geometric interpolation: equal ratios per step, as DGC's 25 % → 6.25 % → … ramp.
        return float(start * (self.density / start) ** (t / self.warmup_steps))


def choose_wan_compression(
    elements: int,
    sites: int,
    wan_gbps: float,
    step_seconds: float,
    *,
    budget: float = 0.1,
    grad_bytes: int = 4,
) -> WanMode:
    """The least lossy WAN mode whose dense ring all-reduce fits in `budget` of a step.

    `elements`: gradient elements synced per step; `step_seconds`: the step's compute time;
    `wan_gbps`: the measured bandwidth of the slowest link between the sites.
    """
    if elements < 0 or sites < 1 or wan_gbps <= 0 or step_seconds <= 0:
        raise ValueError("choose_wan_compression: elements ≥ 0, sites ≥ 1, wan_gbps > 0, step > 0")
    if sites == 1:
        return "none"
    per_leader_elements = 2 * (sites - 1) / sites * elements
    allowed = budget * step_seconds
    for mode, nbytes in (("none", grad_bytes), ("fp16", 2)):
        if per_leader_elements * nbytes * 8 / (wan_gbps * 1e9) <= allowed:
            return mode  # type: ignore[return-value]
    return "topk"
