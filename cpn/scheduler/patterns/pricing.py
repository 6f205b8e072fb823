"""Exact pricing: the most valuable pattern of a site class, by dynamic programming.

For prices `stay` (per replica that stays in the site between two stages), `shard[p]` (per
shard of stage p) and `use[p]` (once if the site holds stage p at all), the value of a
pattern a = (a_0, …, a_{pp−1}) is

    stay·Σ_{p<pp−1} min(a_p, a_{p+1})  +  Σ_p shard[p]·a_p  +  Σ_p use[p]·[a_p ≥ 1]

over 0 ≤ a_p ≤ caps[p] and Σ_p a_p ≤ slots. The stays are Σ min(a_p, a_{p+1}) because the
replicas of consecutive stages in one site can always be matched (the flows at a site are
free). The programme walks the stages with state (a_p, shards so far): the value of the
best prefix ending in a_p is, over the previous count a',

    max( max_{a' ≥ a_p} V[a'] + stay·a_p ,  max_{a' < a_p} (V[a'] + stay·a') )

— a suffix and a prefix maximum, so a stage costs O(caps·slots), not O(caps²·slots). When
`slots` cannot bind (Σ caps ≤ slots) the shard total is not tracked at all.

Written by hand because no library solves this: it is the pricing problem of this
formulation (an LP or CP-SAT model per call would be orders of magnitude slower). Integer
prices give an exact integer answer (int64), which the cuts need; float prices are for
column generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from cpn.scheduler.patterns.classes import Pattern, SiteClass, stays

Number = int | float
Array = npt.NDArray[Any]
_INT_FLOOR = -(1 << 62)


@dataclass(frozen=True)
class Priced:
    value: Number
    pattern: Pattern


def pattern_value(
    stay: Number, shard: Sequence[Number], use: Sequence[Number], pattern: Sequence[int]
) -> Number:
    """The value of one pattern (the definition the programme maximises)."""
    return (
        stay * stays(pattern)
        + sum(c * a for c, a in zip(shard, pattern, strict=True))
        + sum(c for c, a in zip(use, pattern, strict=True) if a > 0)
    )


def best_pattern(
    cls: SiteClass, stay: Number, shard: Sequence[Number], use: Sequence[Number]
) -> Priced:
    """The pattern of `cls` (within `caps` and `slots`) with the largest value."""
    integral = all(isinstance(v, int) for v in (stay, *shard, *use))
    pp = len(cls.caps)
    if len(shard) != pp or len(use) != pp:
        raise ValueError(f"need {pp} shard and use prices, got {len(shard)} and {len(use)}")
    total = min(cls.slots, sum(cls.caps))
    binding = cls.slots < sum(cls.caps)
    top = min(max(cls.caps, default=0), total)
    width = total + 1 if binding else 1
    dtype: type[np.generic] = np.int64 if integral else np.float64
    floor: Number = _INT_FLOOR if integral else -np.inf
    if integral:
        biggest = (abs(stay) + max(map(abs, shard))) * max(top, 1) * pp + sum(map(abs, use))
        if biggest >= 1 << 60:
            raise ValueError("integer prices too large for exact int64 pricing")
    counts = np.arange(top + 1)

    def gain(p: int) -> Array:
        g = (counts * shard[p] + np.where(counts > 0, use[p], 0)).astype(dtype)
        g[counts > min(cls.caps[p], total)] = floor
        return g

    if binding:
        # new[a, t] = m[a, t − a] + g[a] where t ≥ a: one gather for all a.
        shift = np.arange(width)[None, :] - counts[:, None]
        reach = shift >= 0
        source = np.where(reach, shift, 0)

    def place(m: Array, g: Array) -> Array:
        """new[a, t] = m[a, t − a] + g[a] (or new[a, 0] = m[a, 0] + g[a] untracked)."""
        moved = np.take_along_axis(m, source, axis=1) if binding else m
        out = moved + g[:, None]
        if binding:
            out[~reach] = floor
        out[g == floor] = floor
        if integral:
            out[out < _INT_FLOOR // 2] = _INT_FLOOR
        return out

    empty = np.full((top + 1, width), floor, dtype=dtype)
    empty[:, 0] = 0  # before stage 0 nothing is placed: only t = 0 is reachable
    tables = [place(empty, gain(0))]
    stay_a = (counts * stay).astype(dtype)[:, None]
    for p in range(1, pp):
        v = tables[-1]
        suffix = np.maximum.accumulate(v[::-1], axis=0)[::-1]
        shifted = v + stay_a
        prefix = np.full_like(v, floor)
        prefix[1:] = np.maximum.accumulate(shifted, axis=0)[:-1]
        best = np.maximum(suffix + stay_a, prefix)
        if integral:
            best[best < _INT_FLOOR // 2] = _INT_FLOOR
        tables.append(place(best, gain(p)))

    last = tables[-1]
    a_last, t_last = np.unravel_index(int(np.argmax(last)), last.shape)
    value = last[a_last, t_last].item()
    pattern = [0] * pp
    pattern[-1] = int(a_last)
    t = int(t_last)
    for p in range(pp - 1, 0, -1):
        a = pattern[p]
        t = t - a if binding else 0
        prev = tables[p - 1][:, t] + np.minimum(counts, a) * stay
        pattern[p - 1] = int(np.argmax(prev))
    return Priced(value, tuple(pattern))
