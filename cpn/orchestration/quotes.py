"""Quotes: ranked candidate plans for a job, with predicted time, WAN bytes and price.

Candidates are real plans from the scheduler on the live network as it is now (GPUs
other jobs hold are left out): the job's own layout (or, with `parallel: auto`, the
layout the scheduler picks) under each objective, then the other layouts of the same
number of GPUs that `parallel: auto` would consider. Identical placements are offered
once. They are ranked by predicted total time, then WAN bytes, then price. A quote
reserves nothing; `POST /v1/jobs` may name one of its candidates, and the job gets that
plan if its GPUs are still free when it is admitted (else it is planned again with the
same layout).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta

from cpn.contracts import JobSpec, ParallelSpec, Plan, Reservations, Topology, WanCompression
from cpn.control.settings import ControlSettings
from cpn.errors import InfeasibleError, InputError
from cpn.orchestration.errors import NeverFits
from cpn.orchestration.tenants import Principal
from cpn.registry import EmptyRegistry, Registry, build_topology
from cpn.registry.models import Quote, utcnow
from cpn.scheduler import Objective, SolverSettings, plan_job

MAX_CANDIDATES = 8


@dataclass(frozen=True)
class Price:
    gpu_hours: float
    gpu: float  # GPU-hours at each site's price
    egress: float  # WAN bytes at each link's price per GB
    total: float


def price_of(plan: Plan, topology: Topology, steps: int) -> Price:
    seconds = plan.predicted_iteration_seconds * steps
    hours = seconds / 3600
    site_price = {s.name: s.gpu_price_per_hour for s in topology.sites}
    gpus_per_site: dict[str, int] = {}
    for shard in plan.shards:
        gpus_per_site[shard.site] = gpus_per_site.get(shard.site, 0) + len(shard.gpus)
    gpu = sum(site_price.get(s, 0.0) * n for s, n in gpus_per_site.items()) * hours
    link_price = {link.key: link.price_per_gb for link in topology.links}
    egress = sum(
        link_price.get(k, 0.0) * b / 1e9 for k, b in plan.bytes_per_iteration.wan_links.items()
    )
    egress *= steps
    return Price(
        gpu_hours=plan.parallel.world_size * hours, gpu=gpu, egress=egress, total=gpu + egress
    )


def _placement(plan: Plan) -> tuple[object, ...]:
    return (
        plan.parallel.dp,
        plan.parallel.tp,
        plan.parallel.pp,
        tuple(sorted((s.replica, s.stage, s.site, s.node, tuple(s.gpus)) for s in plan.shards)),
    )


def candidate_plans(
    topology: Topology, reservations: Reservations, spec: JobSpec, time_limit: float
) -> list[Plan]:
    settings = SolverSettings(time_limit=time_limit)
    plans: list[Plan] = []
    first: Plan | None = None
    for objective in (Objective.WAN_BYTES, Objective.ITERATION_TIME):
        try:
            plan = plan_job(topology, spec, reservations, objective, settings)
        except (InfeasibleError, InputError):
            continue  # the caller says why, from one more solve on the whole network
        plans.append(plan)
        first = first or plan
    if first is None:
        return []
    # Other layouts of the same GPUs, as `parallel: auto` ranks them. Not under `wan:
    # auto`: its codec is chosen for the job's own layout, and a spec cannot ask for both.
    if spec.compression.wan is WanCompression.AUTO:
        return _unique(plans)
    gpus = first.parallel.world_size
    auto = spec.model_copy(update={"parallel": "auto", "gpus": gpus})
    layouts: list[ParallelSpec] = []
    try:
        best = plan_job(
            topology,
            JobSpec.model_validate(auto.model_dump()),
            reservations,
            Objective.WAN_BYTES,
            settings,
        )
        layouts = [best.parallel, *(alt.parallel for alt in best.runners_up)]
    except (InfeasibleError, InputError):
        pass
    for parallel in layouts:
        if parallel == first.parallel:
            continue
        fixed = spec.model_copy(update={"parallel": parallel, "gpus": None})
        try:
            plans.append(
                plan_job(
                    topology,
                    JobSpec.model_validate(fixed.model_dump()),
                    reservations,
                    Objective.WAN_BYTES,
                    settings,
                )
            )
        except (InfeasibleError, InputError):
            continue
    return _unique(plans)


def _unique(plans: list[Plan]) -> list[Plan]:
    unique: dict[tuple[object, ...], Plan] = {}
    for plan in plans:
        unique.setdefault(_placement(plan), plan)
    return list(unique.values())


def make_quote(
    registry: Registry, settings: ControlSettings, principal: Principal, spec: JobSpec
) -> Quote:
    with registry.read() as session:
        try:
            topology, held = build_topology(session)
        except EmptyRegistry as exc:
            raise NeverFits(f"nothing to quote on: {exc}") from None
    plans = candidate_plans(topology, held, spec, settings.plan_time_limit_s)
    fits_now = bool(plans)
    if not plans:  # busy now: quote on the whole network, for when GPUs are freed
        plans = candidate_plans(topology, Reservations(), spec, settings.plan_time_limit_s)
    if not plans:
        try:
            plan_job(topology, spec, Reservations(), settings=SolverSettings(time_limit=1.0))
        except (InfeasibleError, InputError) as exc:
            raise NeverFits(f"the job can never fit: {exc}") from None
        raise NeverFits("the job can never fit on the live network")
    steps = spec.train.steps
    ranked = sorted(
        plans,
        key=lambda p: (
            p.predicted_iteration_seconds,
            p.bytes_per_iteration.wan,
            price_of(p, topology, steps).total,
        ),
    )[:MAX_CANDIDATES]
    candidates = []
    for rank, plan in enumerate(ranked):
        price = price_of(plan, topology, steps)
        candidates.append(
            {
                "rank": rank,
                "objective": plan.objective,
                "fits_now": fits_now,
                "predicted_total_seconds": plan.predicted_iteration_seconds * steps,
                "wan_bytes_total": plan.bytes_per_iteration.wan * steps,
                "price": {
                    "gpu_hours": price.gpu_hours,
                    "gpu": price.gpu,
                    "egress": price.egress,
                    "total": price.total,
                },
                "plan": plan.model_dump(mode="json"),
            }
        )
    now = utcnow()
    quote = Quote(
        id=f"quote-{uuid.uuid4().hex[:12]}",
        tenant_id=principal.tenant_id,
        spec=spec.model_dump(mode="json"),
        candidates=candidates,
        created_at=now,
        expires_at=now + timedelta(seconds=settings.quote_ttl_s),
    )
    with registry.write() as session:
        session.add(quote)
    return quote
