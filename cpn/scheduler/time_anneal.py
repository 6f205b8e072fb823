"""Simulated annealing over which block position each site holds: iteration time at scale.

On large networks the time objective's best starts are *clustered blocks*
(`heuristics.cluster_blocks`): the stages cut into blocks of L consecutive stages, each
block position on a tight cluster of sites, replicas crossing the WAN between positions.
Those clusters are grown one position at a time, greedily, so a position's cluster may be
tight for its own sync and still poorly joined to the next one; the CP-SAT time model
cannot repair that on 64 sites in the budget (it moves shards, not whole clusters: its
LNS left the clustered start unchanged in every measured run).

This search moves whole sites. Its state gives each site one block position or none; a
position fills its sites with whole blocks, roomiest first, until it holds dp replicas.
A move swaps the positions of two sites (a site for a free one included). The score of a
state is the cost model's iteration time for the per-site counts it implies: each
stage's sync over its sites (the in-site phase where a site holds two replicas, then the
slowest pair's WAN phase, as `costmodel.evaluate`), the hop between positions (the best
flows for those counts, `time_flows.boundary_flows`) and the hop inside a block, through
the site's fabric (the best flows may do slightly better by sending a few of a block's
replicas to another site, so the score may overstate there). Scores are memoised per
position's site set, so a swap recomputes at most two positions and their boundaries.
Written here because no library anneals over this model; the final placement is
evaluated by the cost model itself and kept by the solver only when it beats its start.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cpn.contracts.plan import ShardPlacement
from cpn.scheduler.heuristics import blocks_room, take_blocks
from cpn.scheduler.instance import Instance
from cpn.scheduler.pool import FreeGpus
from cpn.scheduler.time_flows import boundary_flows, hop_coefficients, pair_costs

#: Start and end temperature, as shares of the starting score.
HOT, COLD = 0.05, 0.0005
#: The search counts its own effort, in seconds of this machine (2 cores, idle; fitted on
#: the 64-site bench instances, within a factor 2 of the clock), so that the same input
#: and budget give the same plan on any machine (docs/scheduler.md §9): a boundary's
#: flows (a dozen max-flows), the sync of one stage of a position, a move's bookkeeping.
BOUNDARY_S, POSITION_S, MOVE_S = 0.6e-3, 0.04e-3, 0.02e-3


@dataclass(frozen=True)
class Annealed:
    shards: list[ShardPlacement]
    seconds: float  # the annealer's own score of `shards` (the cost model's formula)
    moves: int  # swaps tried


class _Scorer:
    """The iteration time of a state (site → block position, −1 for none)."""

    def __init__(self, inst: Instance, length: int) -> None:
        self.inst = inst
        self.length = length
        w = inst.workload
        self.w = w
        self.dp, self.pp = inst.dp, inst.pp
        self.positions = self.pp // length
        self.per_msg, self.per_byte = pair_costs(inst)
        self.alpha, self.beta = hop_coefficients(inst)
        sites = inst.sites
        self.fabric = [inst.intra_site_gbps(s) for s in sites]
        free = FreeGpus(inst)
        # room[q][i]: whole blocks of position q that site i holds (alone, from empty).
        self.room = np.array(
            [
                [blocks_room(free, s, self.stages(q), self.dp) for s in sites]
                for q in range(self.positions)
            ],
            dtype=np.int64,
        )
        # compute[p][i]: the slowest node group of site i that fits stage p (a site's
        # blocks may land on any of them).
        self.compute = np.zeros((self.pp, len(sites)))
        for p in range(self.pp):
            for g in inst.groups:
                if g.slots and inst.fits[p][g.index]:
                    i = inst.site_index[g.site]
                    self.compute[p][i] = max(self.compute[p][i], inst.compute[p][g.index])
        self._position_memo: dict[tuple[int, tuple[int, ...]], tuple[float, float, float]] = {}
        self._boundary_memo: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}
        self._counts_memo: dict[tuple[int, tuple[int, ...]], npt.NDArray[np.int64] | None] = {}
        self.effort = 0.0  # seconds of work done, by the model of BOUNDARY_S and POSITION_S

    def stages(self, q: int) -> range:
        return range(q * self.length, (q + 1) * self.length)

    def counts(self, q: int, members: tuple[int, ...]) -> npt.NDArray[np.int64] | None:
        """Replicas per member site (roomiest first, in that order), or None: no room."""
        key = (q, members)
        if key not in self._counts_memo:
            need, out = self.dp, []
            for i in members:
                take = min(int(self.room[q][i]), need)
                out.append(take)
                need -= take
            self._counts_memo[key] = None if need else np.array(out, dtype=np.int64)
        return self._counts_memo[key]

    def order(self, q: int, members: list[int]) -> tuple[int, ...]:
        return tuple(sorted(members, key=lambda i: (-int(self.room[q][i]), i)))

    def position(self, q: int, members: tuple[int, ...]) -> tuple[float, float, float]:
        """(slowest sync of its stages, slowest in-block hop, slowest compute), inf: no room."""
        key = (q, members)
        if key in self._position_memo:
            return self._position_memo[key]
        self.effort += POSITION_S * self.length
        cnt = self.counts(q, members)
        if cnt is None:
            out = (math.inf, math.inf, math.inf)
        else:
            used = [i for i, c in zip(members, cnt, strict=True) if c]
            held = [c for c in cnt if c]
            k = len(used)
            idx = np.ix_(used, used)
            sync = 0.0
            for p in self.stages(q):
                intra = max(
                    (
                        self.w.dp_intra_seconds(p, self.fabric[i])
                        for i, c in zip(used, held, strict=True)
                        if c >= 2
                    ),
                    default=0.0,
                )
                wan = 0.0
                if k >= 2:
                    cost = (
                        self.w.dp_wan_steps(k) * self.per_msg[idx]
                        + self.w.dp_wan_per_leader(p, k) * self.per_byte[idx]
                    )
                    np.fill_diagonal(cost, 0.0)
                    wan = float(cost.max())
                sync = max(sync, intra + wan)
            hop = 0.0
            if self.length > 1:
                hop = max(
                    self.w.hop_seconds(None, c, self.fabric[i])
                    for i, c in zip(used, held, strict=True)
                )
            compute = max(float(self.compute[p][used].max()) for p in self.stages(q))
            out = (sync, hop, compute)
        self._position_memo[key] = out
        return out

    def boundary(self, a: tuple[int, ...], b: tuple[int, ...], qa: int) -> float:
        """Slowest hop of the best flows from position qa's sites `a` to the next's `b`."""
        key = (a, b)
        if key not in self._boundary_memo:
            self.effort += BOUNDARY_S
            supply, demand = self.counts(qa, a), self.counts(qa + 1, b)
            hop = math.inf
            if supply is not None and demand is not None:
                idx = np.ix_(list(a), list(b))
                moves = boundary_flows(self.alpha[idx], self.beta[idx], supply, demand)
                if moves is not None:
                    hop = max(
                        float(self.alpha[a[i], b[j]] + self.beta[a[i], b[j]] * v)
                        for i, j, v in moves
                    )
            self._boundary_memo[key] = hop
        return self._boundary_memo[key]

    def score(self, members: list[tuple[int, ...]], limit: float = math.inf) -> float:
        """The state's iteration time; or, once it is sure to exceed `limit`, some value
        above `limit` (the boundaries' flows, the costly part, are left out then)."""
        parts = [self.position(q, ms) for q, ms in enumerate(members)]
        if any(not math.isfinite(s) for s, _, _ in parts):
            return math.inf
        sync = max(s for s, _, _ in parts)
        slots = self.w.micro_batches + self.pp - 1
        # Inside a block the hop is the fabric's; a block's last stage pays the WAN hop.
        slot = max(compute + (hop if self.length > 1 else 0.0) for _, hop, compute in parts)
        for q in range(self.positions - 1):
            if slots * slot + sync > limit:
                break
            out_hop = self.boundary(members[q], members[q + 1], q)
            slot = max(slot, parts[q][2] + out_hop)
        return slots * slot + sync


def anneal_blocks(
    inst: Instance,
    length: int,
    start: list[ShardPlacement],
    seconds: float,
    seed: int = 0,
    max_moves: int | None = None,
    wall: float | None = None,
) -> Annealed | None:
    """Anneal the block positions of `start` (a `cluster_blocks` placement of `length`).

    Each site takes the position whose shards it holds most of in `start`, and a
    position left short of room takes the free sites nearest to it; None when no free
    site is left for that, or when `length` does not divide pp. Runs for `seconds` of
    counted effort (`BOUNDARY_S`, …), or `max_moves` swaps if given, and stops at `wall`
    seconds of the clock in any case (a safety net; default twice `seconds`).
    """
    if length >= inst.pp or inst.pp % length:
        return None
    scorer = _Scorer(inst, length)
    n, positions = len(inst.sites), scorer.positions
    held = np.zeros((n, positions), dtype=np.int64)
    for sh in start:
        held[inst.site_index[sh.site], sh.stage // length] += 1
    state = np.where(held.sum(axis=1) > 0, held.argmax(axis=1), -1)
    # A site the start splits between positions now serves one: give a position short of
    # room the free sites nearest to its own (by the cheapest hop), roomiest on ties.
    for q in range(positions):
        while int(scorer.room[q][state == q].sum()) < inst.dp:
            spare = np.flatnonzero((state == -1) & (scorer.room[q] > 0))
            if not spare.size:
                return None
            mine = np.flatnonzero(state == q)
            near = (
                scorer.alpha[np.ix_(mine, spare)].min(axis=0) if mine.size else np.zeros(spare.size)
            )
            pick = min(range(spare.size), key=lambda j: (near[j], -scorer.room[q][spare[j]]))
            state[spare[pick]] = q

    def members_of(st: npt.NDArray[np.int64]) -> list[tuple[int, ...]]:
        return [
            scorer.order(q, [int(i) for i in np.flatnonzero(st == q)]) for q in range(positions)
        ]

    members = members_of(state)
    current = scorer.score(members)
    if not math.isfinite(current):
        return None
    best, best_state = current, state.copy()
    rng = random.Random(seed)
    deadline = time.perf_counter() + (2 * seconds if wall is None else wall)
    moves = 0
    hot, cold = HOT * current, COLD * current
    scorer.effort = 0.0
    while time.perf_counter() < deadline:
        # Cooling follows the counted effort, or the moves where they are capped.
        done = scorer.effort / seconds if max_moves is None else moves / max_moves
        if done >= 1:
            break
        temperature = hot * (cold / hot) ** done
        a, b = rng.sample(range(n), 2)
        if state[a] == state[b]:
            continue
        moves += 1
        scorer.effort += MOVE_S
        state[a], state[b] = state[b], state[a]
        trial = members_of(state)
        # Metropolis: accept when score < current − T·ln u, u uniform in (0, 1].
        limit = current - temperature * math.log(1.0 - rng.random())
        score = scorer.score(trial, limit)
        if score <= limit:
            current, members = score, trial
            if score < best:
                best, best_state = score, state.copy()
        else:
            state[a], state[b] = state[b], state[a]
    shards = _place(inst, scorer, members_of(best_state))
    return None if shards is None else Annealed(shards, best, moves)


def _place(
    inst: Instance, scorer: _Scorer, members: list[tuple[int, ...]]
) -> list[ShardPlacement] | None:
    """Whole blocks on each position's sites, roomiest first, replicas numbered in order."""
    free = FreeGpus(inst)
    out: list[ShardPlacement] = []
    for q, sites in enumerate(members):
        cnt = scorer.counts(q, sites)
        if cnt is None:
            return None
        replica = 0
        for i, c in zip(sites, cnt, strict=True):
            if not take_blocks(free, inst.sites[i], scorer.stages(q), int(c), replica, out):
                return None
            replica += int(c)
    return sorted(out, key=lambda s: (s.stage, s.replica))
