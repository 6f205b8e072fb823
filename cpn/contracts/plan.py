"""Plan: where every shard of a job runs, and what the cost model predicts for it.

`cpn plan --json` prints this; the control plane stores it, agents launch workers from it
and the runtime builds its process groups from `ranks()`. Documented in docs/contracts.md.

Rank layout (fixed here so that every layer agrees): tensor-parallel index fastest, then the
data-parallel replica, then the pipeline stage, as in Megatron-LM:

    rank = (stage * dp + replica) * tp + tp_index
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cpn.contracts.job import CompressionSpec, JobSpec, ParallelSpec, WanCompression
from cpn.contracts.limits import INT32_MAX, MAX_GPUS_PER_NODE, Int32, Int64, Name
from cpn.contracts.topology import Topology

#: Seconds, prices and solver figures: finite, never negative unless said otherwise.
_Finite = Annotated[float, Field(ge=0, allow_inf_nan=False)]
_GpuIndex = Annotated[int, Field(ge=0, lt=MAX_GPUS_PER_NODE)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ShardPlacement(_Model):
    replica: Int32
    stage: Int32
    site: Name
    node: Name
    gpus: list[_GpuIndex] = Field(
        min_length=1, description="GPU indices inside the node, tp of them"
    )


class BytesPerIteration(_Model):
    """Bytes sent per training iteration, summed over all senders, by link class.

    `intra_node`: tensor-parallel traffic (NVLink/PCIe). `intra_site`: everything else that
    stays inside a site (pipeline hops, the in-site phase of data-parallel sync). `wan`:
    bytes sent from one site to another, each transfer counted once whatever its route.
    `wan_links`: load per physical WAN link ("a|b", names sorted); a transfer relayed through
    an intermediate site loads every link on its path, so the sum can exceed `wan`.
    """

    intra_node: Int64
    intra_site: Int64
    wan: Int64
    wan_links: dict[str, Int64] = Field(default_factory=dict)
    exchange: ExchangeBytes | None = Field(
        default=None,
        description="wan: outer only: one outer exchange and every iteration besides it, "
        "exactly (intra_site and wan above spread the exchange over H iterations)",
    )

    def segment(self, start: int, end: int, done: int) -> dict[str, int]:
        """Bytes by link class of the steps below `done` of a stretch `[start, end)` of
        the run that syncs this way. Every step sends the per-step bytes; under `wan:
        outer` an exchange ends every H-th step of the stretch and its last step (the
        runtime closes a stretch with an outer step: before it switches sync, and at the
        end of training)."""
        n = max(0, min(done, end) - start)
        e = self.exchange
        if e is None:
            return {"intra_node": self.intra_node * n, "intra_site": self.intra_site * n,
                    "wan": self.wan * n}  # fmt: skip
        closed = 1 if n == end - start and n % e.every else 0
        exchanges = n // e.every + closed
        return {
            "intra_node": self.intra_node * n,
            "intra_site": e.step_intra_site * n + e.intra_site * exchanges,
            "wan": e.step_wan * n + e.wan * exchanges,
        }


class ExchangeBytes(_Model):
    """Under `wan: outer`, exact bytes (all senders): `intra_site` and `wan` of one outer
    exchange (the in-site broadcast of the mean pseudo-gradient, the pseudo-gradients
    across sites), and `step_intra_site` and `step_wan` that every iteration sends
    besides (in-site gradient sync, pipeline hops)."""

    every: int = Field(ge=1, le=INT32_MAX, description="H: iterations per exchange")
    step_intra_site: Int64
    step_wan: Int64
    intra_site: Int64
    wan: Int64


class Breakdown(_Model):
    """Predicted seconds per iteration; the four add up to `predicted_iteration_seconds`."""

    compute: _Finite = Field(description="micro-batches × compute of the slowest stage")
    pipeline: _Finite = Field(description="micro-batches × its activation transfer")
    dp_sync: _Finite = Field(description="exposed data-parallel gradient sync")
    bubble: _Finite = Field(description="(pp − 1) pipeline fill and drain slots")


class SolverReport(_Model):
    status: str = Field(description="OPTIMAL, FEASIBLE, HEURISTIC (baselines) or INFEASIBLE")
    seconds: float = Field(ge=0)
    objective: float = Field(description="value of the primary objective, in its unit")
    bound: float = Field(description="proven lower bound on the primary objective")
    gap: float = Field(ge=0, description="(objective − bound) / objective; 0 when proven optimal")
    objective_name: str = "wan_bytes"
    objective_unit: str = "bytes"
    proved_by: str | None = Field(
        default=None,
        description="what proved `bound`: 'CP-SAT', 'pattern bound' (wan_bytes: column "
        "generation over per-site patterns), 'time bound' (iteration_time: slowest compute "
        "plus the least communication); None when nothing was proved (HEURISTIC)",
    )
    # parallel: auto only: how the layout search went
    layouts_considered: int | None = None
    layouts_solved: int | None = None
    layouts_pruned: int | None = None


class Alternative(_Model):
    """A runner-up layout considered by `parallel: auto`."""

    parallel: ParallelSpec
    predicted_iteration_seconds: float
    wan_bytes: int
    status: str


@dataclass(frozen=True)
class RankInfo:
    """One worker process of a plan."""

    rank: int
    replica: int
    stage: int
    tp_index: int
    site: str
    node: str
    gpu: int


def _digest(doc: Any) -> str:
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


#: Job fields that do not change what a plan predicts: a plan stays valid when they change.
_FREE_TRAIN_FIELDS = ("steps", "lr", "seed")


def job_digest(job: JobSpec) -> str:
    """A fingerprint of what a plan for `job` depends on: its name, model, batch and dtype,
    layout, GPU budget, compression and constraints (not steps, learning rate, seed,
    priority or the recovery policy, which a plan does not predict from)."""
    doc = job.model_dump(mode="json", exclude={"priority", "recovery"})
    for name in _FREE_TRAIN_FIELDS:
        doc["train"].pop(name, None)
    return _digest(doc)


def topology_digest(topology: Topology) -> str:
    return _digest(topology.model_dump(mode="json"))


class Binding(_Model):
    """What a plan was made for: a launch checks it before any process group exists."""

    job_digest: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="`job_digest` of the job the plan places"
    )
    topology_digest: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="the topology the scheduler placed it on"
    )
    sites: list[Name] = Field(max_length=100_000, description="the sites of that topology")

    @classmethod
    def of(cls, job: JobSpec, topology: Topology) -> Binding:
        return cls(
            job_digest=job_digest(job),
            topology_digest=topology_digest(topology),
            sites=[s.name for s in topology.sites],
        )


class WanPhase(_Model):
    """From step `start` on, the run syncs with `compression` (rung `rung` of
    `cpn.wan_schedule.LADDER`)."""

    start: int = Field(ge=0, le=INT32_MAX)
    rung: int = Field(ge=0, le=100)
    compression: CompressionSpec
    bytes_per_iteration: BytesPerIteration | None = Field(
        default=None, description="this phase's bytes on the plan's placement"
    )


class WanAutoChoice(_Model):
    """What `compression: {wan: auto}` resolved to, from the measured WAN (the scheduler's
    `cpn.scheduler.wan_auto`): a schedule of phases (a dense fp16 warm-up, then the rung
    that fits), and the figures the runtime needs to move the rung when the measured
    bandwidth changes (`cpn.wan_schedule`)."""

    compression: CompressionSpec = Field(description="the last phase's: what placement costs")
    summary: str = Field(max_length=200, description="e.g. 'outer H=32 int8'")
    reason: str = Field(max_length=2000, description="the figures the choice rests on")
    wan_gbps: _Finite | None = None
    latency_ms: _Finite | None = None
    share: _Finite | None = Field(
        default=None, description="predicted WAN sync time ÷ compute time per iteration"
    )
    phases: list[WanPhase] = Field(
        default_factory=list, max_length=100, description="the schedule, by start step"
    )
    sites: int = Field(default=1, ge=1, le=1_000_000, description="sites the exchange spans")
    compute_s: _Finite = Field(default=0.0, ge=0, description="compute time per iteration")
    target: _Finite = Field(default=0.1, gt=0, description="the WAN's share of compute")

    @model_validator(mode="after")
    def _a_schedule(self) -> WanAutoChoice:
        if not self.phases:
            return self  # a plan made before wan: auto was a schedule: one phase
        if self.phases[0].start != 0:
            raise ValueError(f"phases: the first starts at step 0, not {self.phases[0].start}")
        starts = [p.start for p in self.phases]
        if any(b <= a for a, b in itertools.pairwise(starts)):
            raise ValueError(f"phases: start steps must increase, got {starts}")
        for p in self.phases:
            if p.compression.wan is WanCompression.AUTO:
                raise ValueError(f"phases: step {p.start} says wan: auto; name the sync")
        if self.phases[-1].compression != self.compression:
            raise ValueError("phases: the last phase must run the choice's compression")
        return self

    def schedule(self) -> list[WanPhase]:
        """The phases; one from step 0 for a choice recorded without them."""
        return self.phases or [WanPhase(start=0, rung=0, compression=self.compression)]

    def phase_at(self, step: int) -> WanPhase:
        """The planned phase that runs step `step`."""
        return [p for p in self.schedule() if p.start <= step][-1]


def predicted_bytes(
    per_iteration: BytesPerIteration, wan_auto: WanAutoChoice | None, done: int, steps: int
) -> dict[str, int]:
    """Bytes by link class (all senders) the plan predicts for the first `done` steps of a
    run of `steps`: per phase of a `wan: auto` schedule whose phases carry their bytes,
    else the plan's own sync throughout. Exact for the sync the plan names (the runtime's
    counts equal it, tested); a run whose measured links moved its `wan: auto` rung sends
    what the rung it moved to sends."""
    phases = wan_auto.schedule() if wan_auto is not None else []
    stretches: list[tuple[int, int, BytesPerIteration]] = [(0, steps, per_iteration)]
    if phases and all(p.bytes_per_iteration is not None for p in phases):
        ends = [p.start for p in phases[1:]] + [steps]
        stretches = [
            (p.start, end, p.bytes_per_iteration)
            for p, end in zip(phases, ends, strict=True)
            if p.bytes_per_iteration is not None
        ]
    total = {"intra_node": 0, "intra_site": 0, "wan": 0}
    for start, end, bytes_ in stretches:
        for key, value in bytes_.segment(start, end, done).items():
            total[key] += value
    return total


class Plan(_Model):
    job: str
    binding: Binding | None = Field(
        default=None, description="the job and topology it was made for (set by the scheduler)"
    )
    objective: str = "wan_bytes"
    parallel: ParallelSpec
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
    wan_auto: WanAutoChoice | None = Field(
        default=None, description="set when the job asked for wan: auto: what was chosen, why"
    )
    micro_batches: int = Field(
        ge=1, le=INT32_MAX, description="micro-batches per replica per iteration"
    )
    shards: list[ShardPlacement]
    bytes_per_iteration: BytesPerIteration
    predicted_iteration_seconds: _Finite
    breakdown: Breakdown
    price_per_hour: _Finite
    solver: SolverReport
    runners_up: list[Alternative] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_shard_per_replica_stage(self) -> Plan:
        par = self.parallel
        want = {(r, p) for r in range(par.dp) for p in range(par.pp)}
        got = [(s.replica, s.stage) for s in self.shards]
        if len(got) != len(set(got)) or set(got) != want:
            raise ValueError(
                f"shards: need exactly one entry per (replica, stage) for dp={par.dp}, "
                f"pp={par.pp}; got {len(got)} entries"
            )
        held: dict[tuple[str, str, int], tuple[int, int]] = {}
        for s in self.shards:
            if len(s.gpus) != par.tp or len(set(s.gpus)) != par.tp:
                raise ValueError(
                    f"shards: replica {s.replica} stage {s.stage} lists {s.gpus}, "
                    f"needs {par.tp} distinct GPUs (tp)"
                )
            for gpu in s.gpus:
                other = held.setdefault((s.site, s.node, gpu), (s.replica, s.stage))
                if other != (s.replica, s.stage):
                    raise ValueError(
                        f"shards: replica {s.replica} stage {s.stage} and replica {other[0]} "
                        f"stage {other[1]} both use GPU {gpu} of {s.site}/{s.node}"
                    )
            if self.binding is not None and s.site not in self.binding.sites:
                raise ValueError(
                    f"shards: replica {s.replica} stage {s.stage} is on site {s.site!r}, "
                    "which is not in the topology the plan was made for"
                )
        return self

    def digest(self) -> str:
        """A fingerprint of the whole plan (checkpoints and launches name it)."""
        return _digest(self.model_dump(mode="json"))

    def problem_with(self, job: JobSpec) -> str | None:
        """Why this plan cannot run `job`, as 'field: reason', or None."""
        if self.job != job.name:
            return f"job: the plan is for job {self.job!r}, the job file is {job.name!r}"
        if self.binding is None:
            return "binding: missing (make the plan with cpn plan, which binds it to its job)"
        if self.binding.job_digest != job_digest(job):
            return (
                "binding.job_digest: the plan was made for another version of job "
                f"{job.name!r} (model, batch, layout, compression or constraints differ); "
                "plan it again"
            )
        return None

    def derived_problem(self, job: JobSpec) -> str | None:
        """Why the fields the scheduler derived from `job` no longer say what it says, as
        'field: reason', or None (check after the layout fits the job). Needed because
        the binding's digest covers the job, not the plan's own copy of what follows from
        it: a hand-edited `micro_batches` would otherwise change how much each step
        trains."""
        train, par = job.train, self.parallel
        per_step = par.dp * train.micro_batch
        if train.global_batch % per_step == 0:  # else layout_problem says why
            want = train.global_batch // per_step
            if self.micro_batches != want:
                return (
                    f"micro_batches: {self.micro_batches}, but the job's batch gives "
                    f"global_batch / (dp × micro_batch) = {train.global_batch} / "
                    f"({par.dp} × {train.micro_batch}) = {want}"
                )
        if job.compression.wan is WanCompression.AUTO:
            # The scheduler resolved `auto` from the measured links: the plan runs that.
            if self.wan_auto is None or self.compression != self.wan_auto.compression:
                return "compression: the job says wan: auto, but the plan has no choice for it"
            last = self.wan_auto.schedule()[-1].start
            if last >= train.steps:
                return (
                    f"wan_auto.phases: a phase starts at step {last}, but the job trains "
                    f"{train.steps} steps"
                )
        elif self.compression != job.compression:
            mine, theirs = (
                c.model_dump(mode="json", exclude_none=True)
                for c in (self.compression, job.compression)
            )
            return f"compression: {mine}, but the job says {theirs}"
        return None

    def shard(self, replica: int, stage: int) -> ShardPlacement:
        for s in self.shards:
            if s.replica == replica and s.stage == stage:
                return s
        raise KeyError((replica, stage))

    def ranks(self) -> list[RankInfo]:
        """Every worker in rank order (see the module docstring for the layout)."""
        par = self.parallel
        by_key = {(s.replica, s.stage): s for s in self.shards}
        out: list[RankInfo] = []
        for stage in range(par.pp):
            for replica in range(par.dp):
                shard = by_key[(replica, stage)]
                for t, gpu in enumerate(shard.gpus):
                    rank = (stage * par.dp + replica) * par.tp + t
                    out.append(RankInfo(rank, replica, stage, t, shard.site, shard.node, gpu))
        return out

    def sites_used(self) -> list[str]:
        seen: dict[str, None] = {}
        for info in self.ranks():
            seen.setdefault(info.site, None)
        return list(seen)


def rank_of(parallel: ParallelSpec, replica: int, stage: int, tp_index: int) -> int:
    """The rank of a worker, by the layout in the module docstring."""
    return (stage * parallel.dp + replica) * parallel.tp + tp_index
