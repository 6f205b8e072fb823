"""Gang admission: a pending job gets every shard it needs, or nothing.

The plan is made on the live registry (`build_topology`: live agents, GPUs other jobs
hold, WAN bandwidth they reserved); then one transaction re-checks the job is still
pending, allocates every GPU of the plan (the registry's unique allocation per GPU makes
a race with another allocator fail whole), reserves the WAN bandwidth the plan predicts
on each link, takes a rendezvous port, stores the plan and moves the job to SCHEDULED.
Any failure rolls all of it back: there is never a job with half its GPUs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from cpn.contracts import JobSpec, Plan, Reservations, Topology
from cpn.control.settings import ControlSettings
from cpn.errors import InfeasibleError, InputError
from cpn.orchestration import recovery, states
from cpn.registry import (
    AllocationConflict,
    EmptyRegistry,
    Registry,
    allocate_gpus,
    build_topology,
    reserve_link,
)
from cpn.registry.models import Agent, Allocation, Job, JobState, Node, RendezvousPort, Site
from cpn.scheduler import SolverSettings, plan_job

log = logging.getLogger("cpn.orchestration")


@dataclass(frozen=True)
class Admitted:
    job_id: str
    plan: Plan
    seconds_waited: float


@dataclass(frozen=True)
class Waiting:
    reason: str


def probe_host(address: str) -> str:
    """The host part of an agent's `host:port` probe address (IPv6 in brackets or not)."""
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]") or "127.0.0.1"


def _quoted_plan_fits(plan: Plan, topology: Topology, held: Reservations) -> str | None:
    known = {(n.site, n.name) for n in topology.nodes()}
    for shard in plan.shards:
        if (shard.site, shard.node) not in known:
            return f"node {shard.site}/{shard.node} is not live"
        taken = held.held(shard.site, shard.node) & set(shard.gpus)
        if taken:
            return f"GPUs {sorted(taken)} of {shard.site}/{shard.node} are held"
    return None


def _wan_gbps(plan: Plan) -> dict[str, float]:
    """Bandwidth the plan keeps busy on each WAN link: its bytes per iteration spread over
    the predicted iteration (what other jobs' plans must leave to it)."""
    seconds = plan.predicted_iteration_seconds
    if seconds <= 0:
        return {}
    return {
        key: bytes_ * 8 / seconds / 1e9
        for key, bytes_ in plan.bytes_per_iteration.wan_links.items()
        if bytes_ > 0
    }


def _pick_port(
    session: Session, host: str, settings: ControlSettings, avoid: int | None = None
) -> int | None:
    """The lowest rendezvous port no live job uses on `host` (nor `avoid`: a re-planned
    job's previous port, which its fenced workers may still hold)."""
    used = set(session.scalars(select(RendezvousPort.port).where(RendezvousPort.host == host)))
    if avoid is not None:
        used.add(avoid)
    for port in range(settings.rendezvous_port_min, settings.rendezvous_port_max + 1):
        if port not in used:
            return port
    return None


def rank0_host(session: Session, plan: Plan) -> str:
    first = plan.ranks()[0]
    address = session.scalar(
        select(Agent.probe_address)
        .join(Node, Node.agent_pk == Agent.id)
        .join(Site, Node.site_id == Site.id)
        .where(Site.name == first.site, Node.name == first.node)
    )
    return probe_host(address or "")


#: States admission takes jobs from: queued, or waiting to be planned again after a loss.
ADMITTABLE = (JobState.PENDING, JobState.RESCHEDULING)


def try_admit(registry: Registry, settings: ControlSettings, job_id: str) -> Admitted | Waiting:
    with registry.read() as session:
        job = session.get(Job, job_id)
        if job is None or job.state not in ADMITTABLE:
            return Waiting("no longer pending")
        was = job.state
        spec = JobSpec.model_validate(job.spec)
        previous = Plan.model_validate(job.plan) if job.plan is not None else None
        try:
            topology, held = build_topology(session)
        except EmptyRegistry as exc:
            return Waiting(f"waiting: {exc}")
    plan = None
    note = ""
    if was is JobState.RESCHEDULING and previous is not None:
        try:
            plan, how = recovery.replan(spec, previous, topology, held, settings)
        except InfeasibleError as exc:
            return Waiting(f"waiting to be planned again: {exc}")
        note = f"planned again after a loss: {how}"
    elif previous is not None:
        problem = _quoted_plan_fits(previous, topology, held)
        if problem is None:
            plan, note = previous, f"the plan of quote {job.quote_id}"
        else:
            note = f"quote {job.quote_id}'s plan no longer fits ({problem}); planned again"
    if plan is None:
        try:
            plan = plan_job(
                topology, spec, held, settings=SolverSettings(time_limit=settings.plan_time_limit_s)
            )
        except (InfeasibleError, InputError) as exc:
            return Waiting(f"waiting: {exc}")
    wanted: dict[str, dict[str, list[int]]] = {}
    for shard in plan.shards:
        wanted.setdefault(shard.site, {}).setdefault(shard.node, []).extend(shard.gpus)
    try:
        with registry.write() as session:
            job = session.get(Job, job_id, with_for_update=True)
            if job is None or job.state is not was:
                return Waiting("no longer pending")
            if was is JobState.RESCHEDULING:
                if session.scalar(select(Allocation.id).where(Allocation.job_id == job.id)):
                    return Waiting("no longer pending")  # its last epoch still holds GPUs
                recovery.restart_epoch(session, job)
            allocate_gpus(session, job.id, wanted)
            for key, gbps in _wan_gbps(plan).items():
                a, b = key.split("|")
                reserve_link(session, job.id, a, b, gbps)
            host = rank0_host(session, plan)
            previous_port = job.rendezvous_port if job.rendezvous_host == host else None
            port = _pick_port(session, host, settings, previous_port)
            if port is None:
                raise _NoPort(
                    f"waiting: every rendezvous port {settings.rendezvous_port_min}–"
                    f"{settings.rendezvous_port_max} on {host} is taken by live jobs"
                )
            session.add(RendezvousPort(job_id=job.id, host=host, port=port))
            job.plan = plan.model_dump(mode="json")
            job.rendezvous_host, job.rendezvous_port = host, port
            job.epoch += 1
            sites = plan.sites_used()
            reason = (
                f"{plan.parallel.world_size} GPUs on {len(sites)} site"
                f"{'s' if len(sites) != 1 else ''} ({', '.join(sites)}), "
                f"{plan.bytes_per_iteration.wan} WAN bytes per iteration predicted; "
                f"rendezvous {host}:{port}"
            )
            if note:
                reason += f"; {note}"
            if was is JobState.RESCHEDULING:
                point = job.checkpoint
                start = f"step {point['step']} (epoch {point['epoch']})" if point else "step 0"
                reason += f"; epoch {job.epoch} resumes from {start}"
            since = job.updated_at if was is JobState.RESCHEDULING else job.created_at
            states.transition(session, job, JobState.SCHEDULED, reason)
            waited = (job.updated_at - since).total_seconds()
    except AllocationConflict as exc:
        return Waiting(f"waiting: {exc}")
    except _NoPort as exc:
        return Waiting(str(exc))
    log.info("job %s scheduled: %s", job_id, reason)
    return Admitted(job_id, plan, waited)


class _NoPort(Exception):
    pass
