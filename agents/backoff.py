"""Exponential backoff with jitter for reconnecting to the control plane."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Backoff:
    """Doubles up to `max_s` (±20 % jitter, so that many agents do not retry in step, but
    never above `max_s`: a control plane that restarts gives agents a grace to register
    again that is sized on this cap, and an agent that waited 20 % past it was declared
    lost on a slow machine); reset after a successful (re)connection."""

    initial_s: float = 0.5
    max_s: float = 30.0
    current_s: float = 0.5

    def next(self) -> float:
        delay = self.current_s * random.uniform(0.8, 1.2)
        if delay > self.max_s:  # at the cap the jitter spreads below it only
            delay = self.max_s * random.uniform(0.8, 1.0)
        self.current_s = min(self.current_s * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self.current_s = self.initial_s
