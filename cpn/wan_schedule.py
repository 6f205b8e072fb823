"""`compression: {wan: auto}` as a schedule: which WAN sync to run, step by step, for a
measured link. Pure functions, shared by the scheduler (at planning time, from the
registry's measured links) and the runtime (during the run, from the links the site
agents keep measuring), so that both compute the same rung from the same figures.

The ladder goes from the most precise sync to the most aggressive:

    dense (the gradient dtype) → fp16 → outer H=8 fp16 → outer H=32 int8
    → outer H=128 int4 → outer H=128 top-k 1 %

A link's rung is the first whose WAN time per iteration fits in `target` of the
iteration's compute time (the last when none does). Because every rung's WAN time falls
as the bandwidth rises, the rung can only grow (more aggressive) as the bandwidth falls.

A run starts precise and gets more aggressive: `plan_phases` puts a warm-up of dense
fp16 steps (hierarchical: reduced in the site, fp16 across) before the rung, as long as
the whole run still fits its budget — see `warmup_steps` for why the warm-up is derived
from the budget and not a constant.

The outer optimizer follows the number of outer steps the rung will make
(`outer_optimizer`): plain model averaging for few, DiLoCo's Nesterov step for many.

During the run the rung moves with the measured bandwidth (`next_rung`): at once to a
more aggressive rung when the link no longer carries the current one within the target;
back to a more precise rung only when that rung would fit at half the measured bandwidth
(hysteresis, so that one noisy probe does not flap it).

`run_wan_bytes` is the cost model's WAN bytes for the rungs a run actually ran: the
runtime's counted bytes equal it exactly (tested).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cpn.contracts.job import (
    CompressionSpec,
    JobSpec,
    OuterValues,
    ParallelSpec,
    WanCompression,
)
from cpn.contracts.plan import WanPhase
from cpn.costmodel import Workload

LADDER: tuple[CompressionSpec, ...] = (
    CompressionSpec(wan=WanCompression.NONE),
    CompressionSpec(wan=WanCompression.FP16),
    CompressionSpec(wan=WanCompression.OUTER, every=8, values=OuterValues.FP16),
    CompressionSpec(wan=WanCompression.OUTER, every=32, values=OuterValues.INT8),
    CompressionSpec(wan=WanCompression.OUTER, every=128, values=OuterValues.INT4),
    CompressionSpec(wan=WanCompression.OUTER, every=128, values=OuterValues.TOPK, density=0.01),
)
#: The warm-up's rung: dense fp16, hierarchical (bench/README.md: equal to DDP's loss).
WARMUP_RUNG = 1
#: At most this share of the run is warm-up (DGC warms up over the first epochs of many).
MAX_WARMUP_SHARE = 0.1
#: Fewer outer steps than this: plain model averaging (outer lr 1, momentum 0).
NESTEROV_MIN_OUTER_STEPS = 100
#: DiLoCo's outer optimizer (`cpn.comm.outer`'s defaults).
DILOCO_LR, DILOCO_MOMENTUM = 0.7, 0.9
#: A more precise rung is taken back only if it fits at the bandwidth ÷ this.
HYSTERESIS = 2.0


@dataclass(frozen=True)
class Link:
    """The narrowest WAN route between the job's sites, as measured."""

    gbps: float
    latency_ms: float


def outer_optimizer(outer_steps: int) -> tuple[float, float]:
    """(outer lr, outer momentum) for a rung that will make `outer_steps` outer steps.

    The measured frontier (bench/README.md, "WAN sync frontier", AdamW inner steps, three
    seeds) never saw DiLoCo's Nesterov step (lr 0.7, momentum 0.9) beat plain averaging:
    at H = 192 in 512 steps (3 outer steps) averaging ended +0.46…+0.67 % above DDP and
    Nesterov +2.2…+3.1 %; at H = 96 in 192 steps averaging +0.2…+2.0 %, Nesterov
    +2.5…+10 %; Nesterov at H = 8 (24 outer steps) ended +3.9…+11 %. With few outer
    steps the momentum amplifies the sites' mean movement instead of smoothing it;
    DiLoCo tuned 0.7 / 0.9 for runs of well over a hundred outer steps, so cpn keeps it
    for those (`NESTEROV_MIN_OUTER_STEPS`) and averages below.
    """
    if outer_steps < NESTEROV_MIN_OUTER_STEPS:
        return 1.0, 0.0
    return DILOCO_LR, DILOCO_MOMENTUM


def rung_spec(rung: int, steps: int) -> CompressionSpec:
    """LADDER[rung] for a phase of `steps` steps, its outer optimizer chosen."""
    spec = LADDER[rung]
    if spec.wan is not WanCompression.OUTER:
        return spec
    lr, momentum = outer_optimizer(-(-steps // spec.outer_every))
    return spec.model_copy(update={"outer_lr": lr, "outer_momentum": momentum})


def rung_of(spec: CompressionSpec) -> int:
    """The ladder position of `spec` (its outer optimizer aside)."""
    bare = spec.model_copy(update={"outer_lr": None, "outer_momentum": None})
    return LADDER.index(bare)


@dataclass(frozen=True)
class Budget:
    """What the choice compares: a job laid out as `parallel`, its replicas on `sites`
    sites, an iteration's compute time `compute_s` (slowest GPU), and the share `target`
    of it the WAN sync may take."""

    job: JobSpec
    parallel: ParallelSpec
    sites: int
    compute_s: float
    target: float

    def wan_seconds(self, spec: CompressionSpec, link: Link) -> float:
        """WAN time per iteration of `spec` on `link` (an outer step's ÷ H): the slowest
        stage's leader uplink, plus one latency per sequential message."""
        w = Workload.of(self.job.model_copy(update={"compression": spec}), self.parallel)
        latency = w.dp_wan_steps(self.sites) * link.latency_ms / 1e3 / w.outer_every
        per_leader = max(w.dp_wan_per_leader(p, self.sites) for p in range(w.pp))
        return per_leader * 8 / (link.gbps * 1e9) + latency

    def share(self, spec: CompressionSpec, link: Link) -> float:
        if self.compute_s <= 0:
            return math.inf
        return self.wan_seconds(spec, link) / self.compute_s

    def rung(self, link: Link) -> int:
        """The first rung whose WAN time fits `target` of compute (else the last)."""
        if self.sites < 2 or self.parallel.dp < 2:
            return 0
        for i, spec in enumerate(LADDER):
            if self.share(spec, link) <= self.target:
                return i
        return len(LADDER) - 1

    def warmup_steps(self, rung: int, link: Link, steps: int) -> int:
        """Dense fp16 steps before `rung`, from the budget of the whole run.

        The budget is the whole run's WAN time at the target share, `target · compute ·
        steps`; the rung alone spends `steps · wan(rung)` of it, and each warm-up step
        costs `wan(fp16) − wan(rung)` more. The warm-up is as long as the spare budget
        pays for, and at most `MAX_WARMUP_SHARE` of the run. A constant would be wrong
        at both ends: on a link where the aggressive rung is needed at all the spare
        budget is small — at ≥ 1,000× fewer bytes than DDP one hierarchical fp16 step of
        the frontier's model (1.08 MB) costs 2.5 int4 outer exchanges and the whole
        512-step budget is 1.38 MB (bench/README.md), so even 50 dense steps would
        multiply the run's WAN bytes by 40 — while on a link just too narrow for fp16 a
        tenth of the run in fp16 is affordable. 0 when the rung is itself precise
        (fp16 or dense) or nothing is spare.
        """
        if rung <= WARMUP_RUNG or steps < 2:
            return 0
        warm = self.wan_seconds(LADDER[WARMUP_RUNG], link)
        steady = self.wan_seconds(LADDER[rung], link)
        spare = self.target * self.compute_s * steps - steps * steady
        if spare <= 0 or warm <= steady:
            return 0
        return min(int(spare // (warm - steady)), int(steps * MAX_WARMUP_SHARE))

    def next_rung(self, current: int, link: Link) -> int:
        """The rung to run after a measurement of `link` while running `current`:
        more aggressive at once when `current` no longer fits; more precise only when
        the precise rung fits at 1/HYSTERESIS of the measured bandwidth."""
        wanted = self.rung(link)
        if wanted >= current:
            return wanted
        cautious = self.rung(Link(link.gbps / HYSTERESIS, link.latency_ms))
        return min(current, cautious)


@dataclass(frozen=True)
class Phase:
    """Steps from `start` on run `compression` (LADDER[`rung`])."""

    start: int
    rung: int
    compression: CompressionSpec


def plan_phases(budget: Budget, link: Link, steps: int) -> list[Phase]:
    """The schedule for a run of `steps` steps on `link`: a warm-up of dense fp16 steps
    (when the budget affords one), then the rung that fits."""
    rung = budget.rung(link)
    warm = budget.warmup_steps(rung, link, steps)
    phases = []
    if warm:
        phases.append(Phase(0, WARMUP_RUNG, LADDER[WARMUP_RUNG]))
    phases.append(Phase(warm, rung, rung_spec(rung, steps - warm)))
    return phases


def schedule_problem(phases: Sequence[WanPhase]) -> str | None:
    """What the runtime cannot run in a plan's `wan_auto.phases` (None: nothing): a rung
    off the ladder, a compression that is not its rung's (the runtime moves from the
    rung, and the metrics name it), or a phase that starts between two outer steps of the
    phase before (a switch is only possible where every replica holds the same
    parameters: at `start + k·H` of an outer phase). The contract (`WanAutoChoice`)
    checks the order of the starts and the last phase."""
    for before, p in zip([None, *phases], phases, strict=False):
        where = f"wan_auto.phases: the phase from step {p.start}"
        if p.rung >= len(LADDER):
            return f"{where} has rung {p.rung}; the ladder has 0..{len(LADDER) - 1}"
        try:
            rung = rung_of(p.compression)
        except ValueError:
            return f"{where} runs {p.compression.summary}, which is no rung of the ladder"
        if rung != p.rung:
            return f"{where} says rung {p.rung} but runs {p.compression.summary} (rung {rung})"
        if before is not None and before.compression.wan is WanCompression.OUTER:
            every = before.compression.outer_every
            if (p.start - before.start) % every:
                return (
                    f"{where} starts between outer steps of the phase before "
                    f"(H={every} from step {before.start})"
                )
    return None


def run_wan_bytes(
    job: JobSpec,
    parallel: ParallelSpec,
    sites: int,
    segments: Sequence[tuple[CompressionSpec, int]],
) -> int:
    """WAN bytes (all senders) of a run that ran each (compression, steps) segment in
    turn: every step's exchange for per-step modes; under `wan: outer` one exchange per
    H steps and one more for the steps left at the segment's end (the runtime closes an
    outer segment with an outer step before it switches, and at the end of training)."""
    total = 0
    for spec, steps in segments:
        w = Workload.of(job.model_copy(update={"compression": spec}), parallel)
        exchanges = -(-steps // w.outer_every)
        total += exchanges * sum(w.dp_wan_bytes_per_sync(p, sites) for p in range(w.pp))
    return total
