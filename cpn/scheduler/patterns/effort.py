"""Deterministic effort: how the pattern search budgets its own work."""

from __future__ import annotations

import time
from dataclasses import dataclass

from cpn.scheduler.patterns.classes import SiteClass

#: Effort of the work below in seconds of one quiet core of the development machine,
#: fitted on the benchmark instances: a pricing call, per cell of its programme, and an LP
#: solve per row and column. Counting effort instead of reading the clock keeps the
#: column generation's result the same on a busy machine (the clock is only a safety net).
PRICING_CALL_S = 2e-4
PRICING_CELL_S = 2e-8
LP_ENTRY_S = 2e-6


@dataclass
class Effort:
    """A budget of deterministic effort, with a wall-clock deadline as a safety net."""

    limit: float  # effort seconds
    deadline: float  # time.perf_counter() value
    spent: float = 0.0

    @classmethod
    def of(cls, seconds: float, wall_seconds: float) -> Effort:
        return cls(seconds, time.perf_counter() + wall_seconds)

    def spend(self, seconds: float) -> None:
        self.spent += seconds

    @property
    def left(self) -> bool:
        return self.spent < self.limit and time.perf_counter() < self.deadline


def pricing_effort(cls: SiteClass) -> float:
    total = min(cls.slots, sum(cls.caps))
    top = min(max(cls.caps, default=0), total)
    width = total + 1 if cls.slots < sum(cls.caps) else 1
    return PRICING_CALL_S + PRICING_CELL_S * len(cls.caps) * (top + 1) * width
