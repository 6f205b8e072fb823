"""The orchestration loop: turns submitted jobs into running training, and ends them.

One asyncio task on the control plane's event loop; every tick runs in one worker thread
(planning and database work never block the gRPC server). A tick:

1. applies the ranks' reports to active jobs (lifecycle.advance): RUNNING, SUCCEEDED,
   FAILED; an active job whose agent was lost fails;
2. sends launch orders for SCHEDULED jobs not launched by this process yet (after a
   restart that is every SCHEDULED job: agents ignore a launch for a job already running);
3. for ended jobs that still hold GPUs: sends stop orders to their agents (once per
   process), and frees the GPUs, WAN reservations and rendezvous port once no rank runs,
   or `stop_grace_s` after the job ended;
4. admits pending jobs in queue order — priority, then age — while they fit (gang
   admission, admission.py). The first that does not fit keeps its reason, and the jobs
   behind it wait behind it: no backfill, so a large job is never starved by small ones.

It wakes on submissions, cancels and task reports, and at least every
`schedule_interval_s`. Admission is retried only when something changed (a job came or
went, GPUs were freed, the set of live agents changed) or every few seconds (WAN
measurements change the topology too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import yaml
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from cpn.contracts import JobSpec, Plan
from cpn.control import ControlServer, TaskReport
from cpn.orchestration import lifecycle, states
from cpn.orchestration.admission import Admitted, try_admit
from cpn.orchestration.metrics import ServiceMetrics
from cpn.registry import Registry, release
from cpn.registry.models import (
    Agent,
    Allocation,
    Job,
    JobState,
    Node,
    RendezvousPort,
    Site,
    utcnow,
)

log = logging.getLogger("cpn.orchestration")

#: Admission is retried at least this often even when nothing seems to have changed.
ADMISSION_RETRY_S = 3.0
#: Every active job is re-read at least this often, not only when its ranks report.
SWEEP_S = 5.0


class Orchestrator:
    def __init__(
        self, control: ControlServer, registry: Registry, metrics: ServiceMetrics | None = None
    ) -> None:
        self.control = control
        self.registry = registry
        self.settings = control.state.settings
        self.metrics = metrics or ServiceMetrics(registry)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="cpn-orchestration")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock = threading.Lock()
        self._dirty: set[str] = set()
        self._admit = True
        self._launched: set[str] = set()
        self._stopped: set[str] = set()
        self._last_admission = 0.0
        self._last_sweep = 0.0
        self._peers_version = -1
        self.ticks = 0
        self.healthy = False

    # ------------------------------------------------------------------ running

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self.control.state.task_listeners.append(self._on_report)
        self._task = asyncio.create_task(self._run(), name="cpn-orchestration")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=True)

    def wake(self, *, admit: bool = True) -> None:
        """Tick soon (thread-safe): a job was submitted or cancelled."""
        with self._lock:
            self._admit = self._admit or admit
        if self._loop is not None and self._wakeup is not None:
            self._loop.call_soon_threadsafe(self._wakeup.set)

    def _on_report(self, report: TaskReport) -> None:
        with self._lock:
            self._dirty.add(report.job_id)
        if self._wakeup is not None:
            self._wakeup.set()

    async def _run(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), self.settings.schedule_interval_s)
            self._wakeup.clear()
            try:
                await loop.run_in_executor(self._executor, self.tick)
                self.healthy = True
            except Exception:
                self.healthy = False
                log.exception("orchestration tick failed; retrying")
                await asyncio.sleep(self.settings.schedule_interval_s)

    # ------------------------------------------------------------------ one tick

    def tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            admit, self._admit = self._admit, False
        if self.control.leases.peers_version != self._peers_version:
            self._peers_version = self.control.leases.peers_version
            admit = True  # agents came or went: capacity changed
        sweep = now - self._last_sweep >= SWEEP_S
        if sweep:
            self._last_sweep = now
        freed = self._advance(dirty, sweep)
        self._launch()
        freed |= self._end()
        if admit or freed or now - self._last_admission >= ADMISSION_RETRY_S:
            self._last_admission = now
            self._admit_queue()
        self.ticks += 1

    def _advance(self, dirty: set[str], sweep: bool) -> bool:
        changed = False
        with self.registry.write() as session:
            query = select(Job).where(Job.state.in_(states.ACTIVE))
            if not sweep:
                if not dirty:
                    return False
                query = query.where(Job.id.in_(dirty))
            jobs = session.scalars(query.with_for_update()).all()
            lost = lifecycle.lost_gpus(session, [j.id for j in jobs])
            for job in jobs:
                if job.id in lost:
                    states.transition(
                        session,
                        job,
                        JobState.FAILED,
                        f"the agent of {lost[job.id]} was lost (lease expired) while the "
                        "job held its GPUs",
                    )
                    changed = True
                elif lifecycle.advance(session, job) in (JobState.FAILED, JobState.SUCCEEDED):
                    changed = True
        return changed

    def _launch(self) -> None:
        with self.registry.read() as session:
            jobs = session.scalars(
                select(Job).where(Job.state == JobState.SCHEDULED).order_by(Job.scheduled_at)
            ).all()
            todo = [j for j in jobs if j.id not in self._launched]
            orders = [(j, self._agents(session, j)) for j in todo]
        for job, agents in orders:
            assert job.plan is not None and job.rendezvous_port is not None
            plan = Plan.model_validate(job.plan)
            spec = JobSpec.model_validate(job.spec)
            fixed = spec.model_copy(update={"parallel": plan.parallel, "gpus": None})
            job_yaml = yaml.safe_dump(fixed.model_dump(mode="json", exclude_none=True))
            for site, agent_id in agents:
                self.control.dispatcher.launch(
                    site,
                    agent_id,
                    job_id=job.id,
                    plan=plan,
                    job_yaml=job_yaml,
                    master_addr=job.rendezvous_host,
                    master_port=job.rendezvous_port,
                )
            self._launched.add(job.id)
            log.info("job %s: launch orders sent to %s", job.id, ", ".join(a for _, a in agents))

    def _agents(self, session: Session, job: Job) -> list[tuple[str, str]]:
        """(site, agent id) of every agent holding a shard of the job's plan."""
        if job.plan is None:
            return []
        nodes = {(s["site"], s["node"]) for s in job.plan["shards"]}
        rows = session.execute(
            select(Site.name, Node.name, Agent.agent_id)
            .join(Node, Node.site_id == Site.id)
            .join(Agent, Node.agent_pk == Agent.id)
            .where(Site.name.in_({site for site, _ in nodes}))
        )
        return sorted({(site, agent) for site, node, agent in rows if (site, node) in nodes})

    def _end(self) -> bool:
        """Stop the workers of ended jobs that hold GPUs; free the GPUs once they are gone."""
        grace = self.settings.stop_grace_s
        freed = False
        with self.registry.read() as session:
            holding = session.scalars(
                select(Job)
                .where(Job.id.in_(select(Allocation.job_id).distinct()))
                .where(Job.state.in_((JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)))
            ).all()
            ended = [
                (j, self._agents(session, j), lifecycle.live_tasks(session, j.id)) for j in holding
            ]
        for job, agents, live in ended:
            if job.id not in self._stopped and job.state is not JobState.SUCCEEDED:
                for site, agent_id in agents:
                    self.control.dispatcher.stop(
                        site, agent_id, job_id=job.id, reason=job.state_reason[:200]
                    )
                log.info("job %s %s: stop orders sent", job.id, job.state.value)
            self._stopped.add(job.id)
            late = (
                job.finished_at is not None and (utcnow() - job.finished_at).total_seconds() > grace
            )
            if live == 0 or late:
                with self.registry.write() as session:
                    gpus = release(session, job.id)
                    session.execute(delete(RendezvousPort).where(RendezvousPort.job_id == job.id))
                log.info("job %s: %d GPUs freed", job.id, gpus)
                self._launched.discard(job.id)
                freed = True
        return freed

    def _admit_queue(self) -> None:
        with self.registry.read() as session:
            queue = session.scalars(
                select(Job)
                .where(Job.state == JobState.PENDING)
                .order_by(Job.priority.desc(), Job.created_at, Job.id)
            ).all()
            waiting = [(j.id, j.state_reason, j.name, j.priority) for j in queue]
        blocked_by: str | None = None
        for job_id, reason, name, priority in waiting:
            if blocked_by is not None:
                self._set_reason(job_id, reason, blocked_by)
                continue
            started = time.perf_counter()
            outcome = try_admit(self.registry, self.settings, job_id)
            self.metrics.admission_seconds.observe(time.perf_counter() - started)
            if isinstance(outcome, Admitted):
                self.metrics.scheduling_latency.observe(outcome.seconds_waited)
                self.wake(admit=False)  # launch it on the next tick, at once
                continue
            if outcome.reason == "no longer pending":
                continue
            self._set_reason(job_id, reason, outcome.reason)
            blocked_by = f"queued behind job {job_id} ({name}, priority {priority})"

    def _set_reason(self, job_id: str, old: str, new: str) -> None:
        if old == new:
            return
        with self.registry.write() as session:
            job = session.get(Job, job_id, with_for_update=True)
            if job is not None and job.state is JobState.PENDING:
                job.state_reason = new
