"""DT-FM's scheduler as a baseline: a memetic genetic algorithm over device partitions.

DT-FM (Yuan et al., "Decentralized Training of Foundation Models in Heterogeneous
Environments", NeurIPS 2022, §3) places a dp × pp job on N devices in two steps:

  1. *Partition* the devices into pp groups of dp ("data-parallel groups": group members
     hold the same stage and all-reduce its gradients among themselves). The partition
     is searched by a genetic algorithm with local search (GCMA, after Kim & Moon's
     cyclic-partitioning memetic algorithm for balanced graph partitioning): a population
     of random balanced partitions; each trial picks two parents at random, applies a
     five-point crossover to their group strings, restores the group sizes, improves the
     child by cyclic moves (one device per group moved round a cycle of groups, so every
     group keeps its size), and the child replaces the worse parent unless it is worse
     than both.
  2. *Decode* a partition into pipelines: between every two groups the cost of the
     pipeline link is the least bottleneck of a perfect matching of their devices (each
     device of one group sends its activations to one device of the other; the slowest
     matched pair sets the cost); the order of the groups along the pipeline is the
     cheapest open-loop travelling-salesman path over those costs (exact, by dynamic
     programming over subsets, as DT-FM does), and the matchings along the path chain the
     devices into dp pipelines.

What differs here, and why:
  - A *device* is a slot of cpn's instance: tp GPUs of one node (DT-FM has tp = 1, one
    GPU per device). cpn's instances have more slots than the job needs, so the
    partition has a (pp + 1)-th group of spare slots that the crossover and the moves
    treat like any other group.
  - The fitness of a partition is cpn's own cost model (`cpn.costmodel.evaluate` of the
    decoded placement, by the objective being compared), not DT-FM's communication-cost
    estimate: the GA is scored on exactly what cpn minimises, which can only make it a
    stronger baseline.
  - A stage may only sit on devices whose memory fits it: the path's dynamic programme
    only puts a group at pipeline position q if all its devices fit stage q.
  - The local search tries random cycles and keeps a move when the fitness improves
    (DT-FM ranks moves by gains of its pipeline-cost estimate); a trial stops at the time
    limit, as the whole search does.

The algorithm is written from the paper's description (and its public scheduler's
structure: population 100, 4900 trials, five-point crossover, steady-state replacement),
not copied from it.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from ortools.graph.python import linear_sum_assignment

from cpn.contracts.plan import ShardPlacement
from cpn.costmodel import Evaluation, Placement, evaluate
from cpn.scheduler.instance import Instance
from cpn.scheduler.realize import evaluate_shards
from cpn.scheduler.time_flows import hop_coefficients

#: Seconds are matched in integer nanoseconds (the assignment solver takes integers).
NS = 1e9
Key = tuple[float, float]
INFEASIBLE: Key = (math.inf, math.inf)


@dataclass(frozen=True)
class GaSettings:
    """DT-FM's defaults (population 100, 4900 trials), a time limit and a seed."""

    population: int = 100
    trials: int = 4900
    time_limit: float = 10.0
    seed: int = 0
    #: Cyclic moves tried on each child (each costs one evaluation of the cost model).
    local_moves: int = 4
    crossover_points: int = 5


@dataclass(frozen=True)
class Device:
    """One slot: tp GPUs of one node."""

    site: int  # index into inst.sites
    group: int  # node group index
    node: str
    gpus: tuple[int, ...]


@dataclass
class GaResult:
    shards: list[ShardPlacement]
    evaluation: Evaluation
    key: Key
    evaluations: int  # partitions scored with the cost model
    trials: int  # crossover + local search rounds completed
    seconds: float


def devices_of(inst: Instance) -> list[Device]:
    """Every slot of the instance: tp free GPUs of one node, nodes in file order."""
    tp = inst.workload.tp
    out = []
    for g in inst.groups:
        site = inst.site_index[g.site]
        for node in g.nodes:
            free = node.free_gpus
            for i in range(len(free) // tp):
                out.append(Device(site, g.index, node.name, tuple(free[i * tp : (i + 1) * tp])))
    return out


class Decoder:
    """A partition (group per device) → pipelines → cpn's cost model."""

    def __init__(self, inst: Instance, key: Callable[[Evaluation], Key]) -> None:
        self.inst = inst
        self.key = key
        self.devices = devices_of(inst)
        self.dp, self.pp = inst.dp, inst.pp
        self.site = np.array([d.site for d in self.devices], dtype=np.int64)
        # One replica's pipeline hop between two sites (DT-FM: delay + activations / bw).
        alpha, beta = hop_coefficients(inst)
        self.hop = alpha + beta
        # fits[q, device]: stage q's memory fits the device's GPUs.
        self.fits = np.array(
            [[inst.fits[q][d.group] for d in self.devices] for q in range(self.pp)], dtype=bool
        )
        self.evaluations = 0
        self._edges: dict[tuple[bytes, bytes], float] = {}
        self._mates: dict[tuple[bytes, bytes], list[int]] = {}

    # -- step 2: pipelines ----------------------------------------------------------------
    def _matching(
        self, a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]
    ) -> tuple[float, list[int]]:
        """Least-bottleneck perfect matching of devices `a` to `b` (then least total).

        Returns (bottleneck seconds, mate in `b` of each position of `a`); inf if none.
        """
        cost = self.hop[np.ix_(self.site[a], self.site[b])]
        levels = np.unique(cost[np.isfinite(cost)])
        lo, hi = 0, len(levels) - 1
        best: tuple[float, list[int]] = (math.inf, [])
        while lo <= hi:  # the least level under which a perfect matching exists
            mid = (lo + hi) // 2
            mates = self._assign(cost, float(levels[mid]))
            if mates is None:
                lo = mid + 1
            else:
                best = (float(levels[mid]), mates)
                hi = mid - 1
        return best

    def _bottleneck(self, a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> float:
        """The bottleneck of `_matching(a, b)`, from the two groups' sites alone.

        Devices of one site are interchangeable, so a perfect matching under a level
        exists iff the transportation problem between the sites' device counts has a full
        flow on the site pairs under that level. Site pairs are added cheapest first and
        the flow augmented as they come (Ford–Fulkerson on a graph of a few dozen sites):
        the level at which the flow becomes full is the bottleneck.
        """
        sa, ca = np.unique(self.site[a], return_counts=True)
        sb, cb = np.unique(self.site[b], return_counts=True)
        cost = self.hop[np.ix_(sa, sb)]
        order = np.argsort(cost, axis=None, kind="stable")
        flat = cost.ravel()
        nb = len(sb)
        supply, demand = ca.tolist(), cb.tolist()
        need = len(a)
        out: list[list[int]] = [[] for _ in range(len(sa))]
        flow: list[dict[int, int]] = [{} for _ in range(nb)]  # flow[j][i] on arc i → j

        def push(i: int, j: int, amount: int) -> None:
            nonlocal need
            supply[i] -= amount
            demand[j] -= amount
            flow[j][i] = flow[j].get(i, 0) + amount
            need -= amount

        def augment() -> bool:
            """One augmenting path from spare supply to spare demand (BFS)."""
            came_a: dict[int, int] = {i: -1 for i in range(len(sa)) if supply[i] > 0}
            came_b: dict[int, int] = {}
            frontier = list(came_a)
            while frontier:
                nxt = []
                for i in frontier:
                    for j in out[i]:
                        if j in came_b:
                            continue
                        came_b[j] = i
                        if demand[j] > 0:
                            # Walk back: the amount is limited by the end points and by
                            # the flows the path cancels.
                            amount, jj = demand[j], j
                            while True:
                                ii = came_b[jj]
                                if came_a[ii] < 0:
                                    amount = min(amount, supply[ii])
                                    break
                                amount = min(amount, flow[came_a[ii]][ii])
                                jj = came_a[ii]
                            jj = j
                            while True:
                                ii = came_b[jj]
                                flow[jj][ii] = flow[jj].get(ii, 0) + amount
                                if came_a[ii] < 0:
                                    supply[ii] -= amount
                                    break
                                flow[came_a[ii]][ii] -= amount
                                jj = came_a[ii]
                            demand[j] -= amount
                            nonlocal need
                            need -= amount
                            return True
                        for i2, f in flow[j].items():
                            if f > 0 and i2 not in came_a:
                                came_a[i2] = j
                                nxt.append(i2)
                frontier = nxt
            return False

        k = 0
        while k < len(order):
            level = flat[order[k]]
            if not math.isfinite(level):
                break
            while k < len(order) and flat[order[k]] == level:
                i, j = divmod(int(order[k]), nb)
                out[i].append(j)
                if supply[i] and demand[j]:
                    push(i, j, min(supply[i], demand[j]))
                k += 1
            while need and augment():
                pass
            if not need:
                return float(level)
        return math.inf

    @staticmethod
    def _assign(cost: npt.NDArray[np.float64], limit: float) -> list[int] | None:
        n = cost.shape[0]
        ok = cost <= limit
        # Every device needs an arc (the solver sizes itself by the nodes it sees).
        if not (ok.any(axis=0).all() and ok.any(axis=1).all()):
            return None
        rows, cols = np.nonzero(ok)
        lsa = linear_sum_assignment.SimpleLinearSumAssignment()
        lsa.add_arcs_with_cost(rows, cols, np.round(cost[rows, cols] * NS).astype(np.int64))
        if lsa.solve() != lsa.OPTIMAL:
            return None
        return [int(lsa.right_mate(i)) for i in range(n)]

    def pipelines(self, genes: npt.NDArray[np.int64]) -> list[list[int]] | None:
        """Device of each (replica, stage), or None when no stage order fits memory."""
        dp, pp = self.dp, self.pp
        # Devices of a group sorted by site: the bottleneck of a matching depends only on
        # the sites, so it is cached by the two groups' site lists.
        groups = []
        for g in range(pp):
            members = np.flatnonzero(genes == g)
            groups.append(members[np.argsort(self.site[members], kind="stable")])
        names = [self.site[m].tobytes() for m in groups]
        edge = np.zeros((pp, pp))
        for g in range(pp):
            for h in range(g + 1, pp):
                pair = (names[g], names[h])
                if pair not in self._edges:
                    self._edges[pair] = self._bottleneck(groups[g], groups[h])
                edge[g, h] = edge[h, g] = self._edges[pair]
        # Which group may take pipeline position q: all its devices fit stage q.
        allowed = [[bool(self.fits[q, groups[g]].all()) for g in range(pp)] for q in range(pp)]
        order = _open_path(edge, allowed)
        if order is None:
            return None
        # Chain the matchings along the path: replica r starts on device r of the first group.
        out = [[int(groups[order[0]][r])] for r in range(dp)]
        position = list(range(dp))  # position of each replica inside the current group
        for q in range(1, pp):
            prev, cur = order[q - 1], order[q]
            pair = (names[prev], names[cur])
            if pair not in self._mates:  # positions follow the site order: reusable
                self._mates[pair] = self._matching(groups[prev], groups[cur])[1]
            mate = self._mates[pair]
            if not mate:
                return None
            position = [mate[i] for i in position]
            for r in range(dp):
                out[r].append(int(groups[cur][position[r]]))
        return out

    # -- fitness --------------------------------------------------------------------------
    def placements(self, pipes: list[list[int]]) -> list[Placement]:
        sites = self.inst.sites
        return [
            Placement(r, q, sites[self.devices[d].site], self.devices[d].node)
            for r, pipe in enumerate(pipes)
            for q, d in enumerate(pipe)
        ]

    def score(self, genes: npt.NDArray[np.int64]) -> Key:
        self.evaluations += 1
        pipes = self.pipelines(genes)
        if pipes is None:
            return INFEASIBLE
        w, inst = self.inst.workload, self.inst
        try:
            ev = evaluate(w, inst.topology, inst.graph, self.placements(pipes))
        except ValueError:  # two devices of a group or a hop with no WAN path between
            return INFEASIBLE
        return self.key(ev)

    def shards(self, genes: npt.NDArray[np.int64]) -> list[ShardPlacement] | None:
        pipes = self.pipelines(genes)
        if pipes is None:
            return None
        sites = self.inst.sites
        out = [
            ShardPlacement(
                replica=r,
                stage=q,
                site=sites[self.devices[d].site],
                node=self.devices[d].node,
                gpus=list(self.devices[d].gpus),
            )
            for r, pipe in enumerate(pipes)
            for q, d in enumerate(pipe)
        ]
        return sorted(out, key=lambda s: (s.stage, s.replica))


def _open_path(edge: npt.NDArray[np.float64], allowed: list[list[bool]]) -> list[int] | None:
    """Cheapest order of the groups along the pipeline (open-loop TSP, exact).

    Dynamic programme over subsets (Held–Karp), a layer of subsets of one size at a time:
    best[S, g] is the cheapest path through the groups in S ending at g, the groups of S
    taking positions 0 … |S| − 1; a group may take position q only if `allowed[q][g]`.
    """
    n = edge.shape[0]
    full = (1 << n) - 1
    ok = np.array(allowed, dtype=bool)
    best = np.full((full + 1, n), np.inf)
    came = np.full((full + 1, n), -1, dtype=np.int64)
    for g in range(n):
        if ok[0, g]:
            best[1 << g, g] = 0.0
    masks = np.arange(full + 1)
    size = np.array([m.bit_count() for m in range(full + 1)])
    for q in range(1, n):
        layer = masks[size == q]
        # value[k, g, h]: the path through layer[k] ending at g, extended by h.
        value = best[layer][:, :, None] + edge[None, :, :]
        prev = np.argmin(value, axis=1)  # (k, h)
        step = np.take_along_axis(value, prev[:, None, :], axis=1)[:, 0, :]
        for h in range(n):
            if not ok[q, h]:
                continue
            free = (layer >> h & 1) == 0
            # Each (S ∪ {h}, h) has the single predecessor S: plain assignment.
            nxt = layer[free] | (1 << h)
            best[nxt, h] = step[free, h]
            came[nxt, h] = prev[free, h]
    if not np.isfinite(best[full]).any():
        return None
    g = int(np.argmin(best[full]))
    order, mask = [], full
    while g >= 0:
        order.append(g)
        prev_g = int(came[mask, g])
        mask &= ~(1 << g)
        g = prev_g
    return order[::-1]


class _Ga:
    def __init__(self, decoder: Decoder, settings: GaSettings, deadline: float) -> None:
        self.d = decoder
        self.s = settings
        self.deadline = deadline
        self.rng = random.Random(settings.seed)
        n = len(decoder.devices)
        used = decoder.dp * decoder.pp
        # Target size of every group: dp for the pp stage groups, the rest spare (group pp).
        self.sizes = [decoder.dp] * decoder.pp + [n - used]
        self.n = n
        self.best: tuple[Key, npt.NDArray[np.int64]] | None = None

    def expired(self) -> bool:
        return time.perf_counter() >= self.deadline

    def fitness(self, genes: npt.NDArray[np.int64]) -> Key:
        key = self.d.score(genes)
        if self.best is None or key < self.best[0]:
            self.best = (key, genes.copy())
        return key

    def random_partition(self) -> npt.NDArray[np.int64]:
        order = list(range(self.n))
        self.rng.shuffle(order)
        genes = np.empty(self.n, dtype=np.int64)
        start = 0
        for g, size in enumerate(self.sizes):
            genes[order[start : start + size]] = g
            start += size
        return genes

    def crossover(
        self, first: npt.NDArray[np.int64], second: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """Five-point crossover on group strings, then the group sizes restored."""
        child = second.copy()
        points = self.rng.sample(range(self.n), min(self.s.crossover_points, self.n))
        child[points] = first[points]
        count = np.bincount(child, minlength=len(self.sizes))
        for i in range(self.n):
            g = int(child[i])
            if count[g] > self.sizes[g]:
                short = next(h for h in range(len(self.sizes)) if count[h] < self.sizes[h])
                count[g] -= 1
                count[short] += 1
                child[i] = short
        return child

    def cyclic_move(self, genes: npt.NDArray[np.int64], cycle: list[int]) -> npt.NDArray[np.int64]:
        """One device of each group of `cycle` moves to the next group of the cycle.

        DT-FM's cyclic partitioning ranks moves by gains on its pair costs; here the
        device that moves out of a group is the one with the largest gain: the farthest,
        on average, from the rest of its group less the farthest from the group it joins
        (pair cost: one replica's hop between the two sites, DT-FM's link cost).
        """
        hop, site = self.d.hop, self.d.site
        trial = genes.copy()
        for i, g in enumerate(cycle):
            members = np.flatnonzero(genes == g)
            target = np.flatnonzero(genes == cycle[(i + 1) % len(cycle)])
            if len(members) == 0:
                continue
            own = hop[np.ix_(site[members], site[members])]
            there = hop[np.ix_(site[members], site[target])] if len(target) else own
            finite = np.where(np.isfinite(own), own, 0.0).sum(axis=1) / max(1, len(members) - 1)
            away = np.where(np.isfinite(there), there, 1e9).mean(axis=1)
            gain = finite - away
            best = np.flatnonzero(gain >= gain.max() - 1e-12)
            trial[int(members[self.rng.choice(list(best))])] = cycle[(i + 1) % len(cycle)]
        return trial

    def local_search(
        self, genes: npt.NDArray[np.int64], key: Key
    ) -> tuple[npt.NDArray[np.int64], Key]:
        """Cyclic moves (every group keeps its size), kept when the fitness improves.

        Half the moves follow the gains (`cyclic_move`), half move random devices, so the
        search does not only ever try the same move.
        """
        groups = [g for g, size in enumerate(self.sizes) if size > 0]
        for _ in range(self.s.local_moves):
            if self.expired() or len(groups) < 2:
                break
            cycle = self.rng.sample(groups, self.rng.choice([2, 3]) if len(groups) > 2 else 2)
            if self.rng.random() < 0.5:
                trial = self.cyclic_move(genes, cycle)
            else:
                trial = genes.copy()
                for i, g in enumerate(cycle):
                    device = int(self.rng.choice(list(np.flatnonzero(genes == g))))
                    trial[device] = cycle[(i + 1) % len(cycle)]
            value = self.fitness(trial)
            if value < key:
                genes, key = trial, value
        return genes, key

    def run(self) -> int:
        population: list[npt.NDArray[np.int64]] = []
        scores: list[Key] = []
        for _ in range(self.s.population):
            if population and self.expired():
                break
            genes = self.random_partition()
            population.append(genes)
            scores.append(self.fitness(genes))
        trials = 0
        while trials < self.s.trials and not self.expired() and len(population) >= 2:
            i, j = self.rng.sample(range(len(population)), 2)
            child = self.crossover(population[i], population[j])
            child, key = self.local_search(child, self.fitness(child))
            worse = i if scores[i] >= scores[j] else j
            if key <= scores[worse]:
                population[worse], scores[worse] = child, key
            trials += 1
        return trials


def dtfm_ga(
    inst: Instance, key: Callable[[Evaluation], Key], settings: GaSettings | None = None
) -> GaResult | None:
    """DT-FM's GA on `inst`, scored by `key` of cpn's cost model; None if nothing fits."""
    settings = settings or GaSettings()
    start = time.perf_counter()
    decoder = Decoder(inst, key)
    if len(decoder.devices) < inst.dp * inst.pp:
        return None
    ga = _Ga(decoder, settings, start + settings.time_limit)
    trials = ga.run()
    if ga.best is None or not math.isfinite(ga.best[0][0]):
        return None
    genes = ga.best[1]
    shards = decoder.shards(genes)
    assert shards is not None  # the best partition was scored, so it decodes
    ev = evaluate_shards(inst, shards)
    return GaResult(
        shards=shards,
        evaluation=ev,
        key=key(ev),
        evaluations=decoder.evaluations,
        trials=trials,
        seconds=time.perf_counter() - start,
    )
