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
from sqlalchemy import delete, select, update
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
#: The shortest time between the starts of two ticks: what a burst of wake-ups may add
#: to a job's submit-to-SCHEDULED time, in exchange for one tick per burst.
MIN_TICK_GAP_S = 0.02
#: Queued jobs whose reason one tick may rewrite (a queue that grew by more gets the rest
#: on later ticks).
REASONS_PER_TICK = 1000


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
        #: The queue's head when it last did not fit (None: it fitted, or no queue).
        self._blocked: str | None = None
        self._last_tick = float("-inf")
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
            # Many wake-ups in a burst (a submission each) make one tick, not one each:
            # ticks start at most every MIN_TICK_GAP_S.
            pause = self._last_tick + MIN_TICK_GAP_S - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            self._wakeup.clear()
            self._last_tick = time.monotonic()
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
        admit_all = False
        if self.control.leases.peers_version != self._peers_version:
            self._peers_version = self.control.leases.peers_version
            admit = admit_all = True  # agents came or went: capacity changed
        sweep = now - self._last_sweep >= SWEEP_S
        if sweep:
            self._last_sweep = now
        freed = self._advance(dirty, sweep)
        self._launch()
        freed |= self._end()
        changed = freed or admit_all or now - self._last_admission >= ADMISSION_RETRY_S
        if admit or changed:
            if changed:
                self._last_admission = now
            self._admit_queue(changed)
        self.ticks += 1

    def _advance(self, dirty: set[str], sweep: bool) -> bool:
        changed = False
        if not sweep and not dirty:
            return False  # before the write: on SQLite it takes the database's lock
        with self.registry.write() as session:
            query = select(Job).where(Job.state.in_(states.ACTIVE))
            if not sweep:
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
            # Ids first: a scheduled job's plan and spec (JSON) are read only once, when
            # its orders go out, not on every tick.
            scheduled = session.scalars(
                select(Job.id).where(Job.state == JobState.SCHEDULED).order_by(Job.scheduled_at)
            ).all()
            todo = [job_id for job_id in scheduled if job_id not in self._launched]
            if not todo:
                return
            jobs = session.scalars(
                select(Job).where(Job.id.in_(todo)).order_by(Job.scheduled_at, Job.id)
            ).all()
            orders = [(j, self._agents(session, j)) for j in jobs if j.state is JobState.SCHEDULED]
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

    def _admit_queue(self, changed: bool) -> None:
        """Admit pending jobs in queue order while they fit; the first that does not keeps
        its reason and every job behind it waits behind it.

        `changed`: capacity may have changed (GPUs freed, agents came or went, or it is time
        to look again). If not, and the queue's head is the job that last failed to fit, it
        still cannot fit (only a job ahead of it, or more capacity, could change that): the
        plan is not tried again, only the newcomers' reasons are set. Without this, every
        submission behind a full cluster cost a topology read and a planning attempt.
        """
        tried: set[str] = set()
        while True:
            head = self._queue_head(tried)
            if head is None:
                self._blocked = None
                return
            job_id, reason, name, priority = head
            if not changed and job_id == self._blocked:
                break
            tried.add(job_id)
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
            self._blocked = job_id
            break
        self._queue_behind(job_id, f"queued behind job {job_id} ({name}, priority {priority})")

    def _queue_head(self, tried: set[str]) -> tuple[str, str, str, int] | None:
        """The first pending job in queue order (priority, then age) not tried this tick:
        four columns of one row, not the whole queue with its specs."""
        with self.registry.read() as session:
            row = session.execute(
                select(Job.id, Job.state_reason, Job.name, Job.priority)
                .where(Job.state == JobState.PENDING, Job.id.not_in(tried))
                .order_by(Job.priority.desc(), Job.created_at, Job.id)
                .limit(1)
            ).first()
        return None if row is None else (row[0], row[1], row[2], row[3])

    def _queue_behind(self, head: str, reason: str) -> None:
        """Every other pending job waits behind `head`: one UPDATE of the rows whose reason
        differs (usually only the newcomers), and no write at all when none does."""
        others = (Job.state == JobState.PENDING, Job.id != head, Job.state_reason != reason)
        with self.registry.read() as session:
            if session.scalar(select(Job.id).where(*others).limit(1)) is None:
                return
        with self.registry.write() as session:
            # Rows locked in id order, skipping any another transaction holds (a cancel, or
            # another control plane's loop): never a deadlock; a skipped row gets its reason
            # on a later tick. At most REASONS_PER_TICK rows per tick.
            ids = session.scalars(
                select(Job.id)
                .where(*others)
                .order_by(Job.id)
                .limit(REASONS_PER_TICK)
                .with_for_update(skip_locked=True)
            ).all()
            if ids:
                session.execute(
                    update(Job).where(Job.id.in_(ids)).values(state_reason=reason),
                    execution_options={"synchronize_session": False},
                )

    def _set_reason(self, job_id: str, old: str, new: str) -> None:
        if old == new:
            return
        with self.registry.write() as session:
            job = session.get(Job, job_id, with_for_update=True)
            if job is not None and job.state is JobState.PENDING:
                job.state_reason = new
