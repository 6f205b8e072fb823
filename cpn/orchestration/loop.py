"""The orchestration loop: turns submitted jobs into running training, and ends them.

One asyncio task on the control plane's event loop; every tick runs in one worker thread
(planning and database work never block the gRPC server). A tick:

1. applies the ranks' reports to active jobs (lifecycle.advance): RUNNING, SUCCEEDED,
   FAILED or a restart by the job's recovery policy; an active job that lost GPUs (their
   agent lost, or a node its site no longer offers) goes RESCHEDULING;
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
from sqlalchemy import bindparam, delete, or_, select, text, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from cpn.contracts import JobSpec, Plan
from cpn.contracts.plan import job_digest
from cpn.control import ControlServer, TaskReport
from cpn.control.dispatch import launch_assignment, queue, stop_assignment
from cpn.orchestration import lifecycle, recovery, states
from cpn.orchestration.admission import ADMITTABLE, Admitted, try_admit
from cpn.orchestration.leader import Leadership
from cpn.orchestration.metrics import ServiceMetrics
from cpn.registry import Registry, release
from cpn.registry.models import (
    PENDING_ONLY,
    Agent,
    Allocation,
    Job,
    JobState,
    Node,
    Order,
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
        self._sweep_now = False
        self._last_admission = 0.0
        #: The queue's head when it last did not fit (None: it fitted, or no queue).
        self._blocked: str | None = None
        self._last_tick = float("-inf")
        self._last_sweep = 0.0
        self._peers_version = -1
        self.ticks = 0
        self.healthy = False
        self.leadership = Leadership(registry)
        #: Whether this process ran the last tick (on PostgreSQL: held the advisory lock).
        self.leading = False
        #: How long a failed rank's job waits before the failure is judged: long enough
        #: for the lease of an agent that died with it to expire and be reaped.
        self._settle_s = self.settings.lease_ttl_s + 2 * self.settings.reaper_interval_s
        #: Whether launch orders may be due (a job admitted since the last look), and
        #: whether a job may be ending (cancelled, ended or lost, or still freeing its
        #: GPUs): ticks that only admit newcomers skip those two queries. Both are looked
        #: at anyway at least every `schedule_interval_s`, as an idle loop would.
        self._launch_due = True
        self._end_due = True
        self._last_full = float("-inf")

    # ------------------------------------------------------------------ running

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self.control.state.task_listeners.append(self._on_report)
        self.control.state.loss_listeners.append(self._on_loss)
        self._task = asyncio.create_task(self._run(), name="cpn-orchestration")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=True)
        self.leadership.release()

    def wake(self, *, admit: bool = True) -> None:
        """Tick soon (thread-safe): something changed — a job was cancelled, admitted…
        The tick looks at everything."""
        with self._lock:
            self._admit = self._admit or admit
            self._launch_due = self._end_due = True
        self._set_wakeup()

    def submitted(self) -> None:
        """Tick soon (thread-safe): a job was queued. Only admission can have work: the
        tick does not look for launches or ends that nothing has made due."""
        with self._lock:
            self._admit = True
        self._set_wakeup()

    def _set_wakeup(self) -> None:
        # Already set: the tick it asks for has not started (it clears the event first),
        # and it reads the flags set above. One self-pipe write per burst, not per job.
        if self._loop is not None and self._wakeup is not None and not self._wakeup.is_set():
            self._loop.call_soon_threadsafe(self._wakeup.set)

    def _on_report(self, report: TaskReport) -> None:
        with self._lock:
            self._dirty.add(report.job_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def _on_loss(self, site: str, agent_id: str) -> None:
        with self._lock:
            self._sweep_now = True
        if self._wakeup is not None:
            self._wakeup.set()

    async def _run(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel that
            # comes as the wait ends, and this loop would then outlive the server's stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.schedule_interval_s):
                    await self._wakeup.wait()
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
        leading = self.leadership.lead()
        if leading != self.leading:
            self.leading = leading
            self._last_sweep = self._last_admission = 0.0  # look at everything again
            self._last_full = float("-inf")
            self._peers_version = -1
            if not leading:
                log.info("orchestration: another control plane leads")
        if not leading:
            self.ticks += 1  # a follower's loop runs too (and /readyz says so)
            return
        now = time.monotonic()
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            admit, self._admit = self._admit, False
        admit_all = False
        agents_changed = self.control.leases.peers_version != self._peers_version
        if agents_changed:
            self._peers_version = self.control.leases.peers_version
            admit = admit_all = True  # agents came or went: capacity changed
        # An agent lost: every active job is looked at now (its placement may be gone).
        with self._lock:
            lost, self._sweep_now = self._sweep_now, False
        sweep = lost or agents_changed or now - self._last_sweep >= SWEEP_S
        if sweep:
            self._last_sweep = now
        full = now - self._last_full >= self.settings.schedule_interval_s
        if full:
            self._last_full = now
        with self._lock:
            launch, self._launch_due = self._launch_due or full, False
            end, self._end_due = self._end_due or full or sweep or bool(dirty), False
        try:
            freed = self._advance(dirty, sweep)
            if launch:
                self._launch()
            if end:
                freed |= self._end()
        except BaseException:
            with self._lock:  # this tick failed: the next one looks again
                self._launch_due = self._launch_due or launch
                self._end_due = self._end_due or end
            raise
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
                    why = (
                        f"{lost[job.id]} was lost (its agent's lease expired, or the site "
                        "no longer offers that node)"
                    )
                    recovery.reschedule(session, self.settings, job, why)
                    changed = True
                elif lifecycle.advance(session, job, self.settings, self._settle_s) in (
                    JobState.FAILED,
                    JobState.SUCCEEDED,
                    JobState.RESCHEDULING,
                ):
                    changed = True
        return changed

    def _launch(self) -> None:
        """Launch orders for every SCHEDULED job whose epoch has none yet: written with the
        job locked, in one transaction, so a restart neither loses nor repeats them (the
        orders table's unique key forbids a second launch of one epoch on one agent)."""
        launched = select(Order.id).where(
            Order.job_id == Job.id, Order.epoch == Job.epoch, Order.kind == "launch"
        )
        with self.registry.read() as session:
            todo = session.scalars(
                select(Job.id)
                .where(Job.state == JobState.SCHEDULED, ~launched.exists())
                .order_by(Job.scheduled_at, Job.id)
            ).all()
        for job_id in todo:
            self._launch_one(job_id)

    def _launch_one(self, job_id: str) -> None:
        with self.registry.write() as session:
            job = session.get(Job, job_id, with_for_update=True)
            if job is None or job.state is not JobState.SCHEDULED:
                return
            assert job.plan is not None and job.rendezvous_port is not None
            plan = Plan.model_validate(job.plan)
            spec = JobSpec.model_validate(job.spec)
            fixed = spec.model_copy(update={"parallel": plan.parallel, "gpus": None})
            job_yaml = yaml.safe_dump(fixed.model_dump(mode="json", exclude_none=True))
            if plan.binding is not None:
                # Workers get the job with the layout the plan chose (not `auto` and a
                # budget): the plan is bound to that job, which is the one it places.
                binding = plan.binding.model_copy(update={"job_digest": job_digest(fixed)})
                plan = plan.model_copy(update={"binding": binding})
            store, every, resume_from = self._checkpointing(job, spec)
            agents = self._agents(session, job)
            for site, agent_id in agents:
                order = launch_assignment(
                    job_id=job.id,
                    plan=plan,
                    job_yaml=job_yaml,
                    master_addr=job.rendezvous_host,
                    master_port=job.rendezvous_port,
                    epoch=job.epoch,
                    checkpoint_store=store,
                    checkpoint_every=every,
                    resume_from=resume_from,
                )
                queue(session, site, agent_id, order)
        for site, agent_id in agents:
            self.control.dispatcher.notify(site, agent_id)
        log.info(
            "job %s epoch %d: launch orders sent to %s%s",
            job_id,
            job.epoch,
            ", ".join(a for _, a in agents),
            f", resuming from {resume_from}" if resume_from else "",
        )

    def _checkpointing(self, job: Job, spec: JobSpec) -> tuple[str, int, str]:
        """(store, every, resume_from) of the job's current epoch: each epoch writes under
        a directory of its own (`ROOT/JOB/eN`), so workers of a fenced epoch can never
        overwrite what a newer one reads."""
        root = self.settings.checkpoint_root
        if root is None:
            return "", 0, ""
        every = spec.recovery.checkpoint_every or self.settings.checkpoint_every
        resume_from = str(job.checkpoint["path"]) if job.checkpoint else ""
        return f"{root.rstrip('/')}/{job.id}/e{job.epoch}", every, resume_from

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
        """Stop the workers of jobs that ended or must be planned again and still hold
        GPUs; free the GPUs once no rank of the epoch runs (ranks of lost agents do not
        count), or `stop_grace_s` after the job left its active state."""
        grace = self.settings.stop_grace_s
        freed = False
        stopped = select(Order.id).where(
            Order.job_id == Job.id, Order.epoch == Job.epoch, Order.kind == "stop"
        )
        with self.registry.read() as session:
            holding = session.scalars(
                select(Job)
                .where(Job.id.in_(select(Allocation.job_id).distinct()))
                .where(Job.state.in_(states.RELEASING))
            ).all()
            ended = [
                (
                    j,
                    self._agents(session, j),
                    lifecycle.live_tasks(session, j),
                    j.state is not JobState.SUCCEEDED
                    and not session.scalar(select(stopped.where(Job.id == j.id).exists())),
                )
                for j in holding
            ]
        released = 0
        for job, agents, live, stop in ended:
            if stop:
                with self.registry.write() as session:
                    for site, agent_id in agents:
                        order = stop_assignment(job.id, job.state_reason[:200], job.epoch)
                        queue(session, site, agent_id, order)
                for site, agent_id in agents:
                    self.control.dispatcher.notify(site, agent_id)
                log.info("job %s %s: stop orders sent", job.id, job.state.value)
            since = job.finished_at or job.updated_at
            late = (utcnow() - since).total_seconds() > grace
            if live == 0 or late:
                with self.registry.write() as session:
                    gpus = release(session, job.id)
                    session.execute(delete(RendezvousPort).where(RendezvousPort.job_id == job.id))
                log.info("job %s: %d GPUs freed", job.id, gpus)
                freed = True
                released += 1
        if released < len(ended):
            with self._lock:  # waiting for workers to stop, or for the grace to pass
                self._end_due = True
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
            try:
                outcome = try_admit(self.registry, self.settings, job_id)
            except SQLAlchemyError:
                raise  # the database: the whole tick is tried again
            except Exception as exc:  # a bug planning this job must not wedge the queue
                log.exception("job %s: planning failed unexpectedly", job_id)
                self._fail_unplannable(job_id, exc)
                continue
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

    def _fail_unplannable(self, job_id: str, exc: Exception) -> None:
        """FAILED with the error's first line: planning it raised what no input should
        (a bug), and trying it again on every tick would keep every job behind it waiting
        for ever."""
        first = (str(exc).splitlines() or [""])[0][:200]
        with self.registry.write() as session:
            job = session.get(Job, job_id, with_for_update=True)
            if job is None or job.state not in ADMITTABLE:
                return
            states.transition(
                session,
                job,
                JobState.FAILED,
                f"cpn could not plan it: internal error ({type(exc).__name__}: {first}); "
                "the control plane's log has the details",
            )

    def _queue_head(self, tried: set[str]) -> tuple[str, str, str, int] | None:
        """The first pending job in queue order (priority, then age) not tried this tick:
        four columns of one row, not the whole queue with its specs.

        Jobs planned again after a loss come before queued ones of the same priority, once
        their last epoch has given its GPUs back and their backoff has passed. Two lookups
        on the indexes, not one query ordering every queued job (which sorted the whole
        queue on every tick): the best such job, and the oldest queued one of the highest
        priority not tried yet (ix_jobs_queue).
        """
        params = {"tried": sorted(tried), "now": utcnow()}
        with self.registry.statements() as connection:
            again = connection.execute(_BEST_AGAIN, params).first()
            queued = connection.execute(_OLDEST_OF_TOP, params).first()
            if queued is None and tried:  # every job of the top priority was tried
                top = connection.scalar(_TOP_PRIORITY)
                while top is not None and queued is None:
                    queued = connection.execute(_OLDEST_AT, {**params, "priority": top}).first()
                    top = connection.scalar(_TOP_BELOW, {"below": top})
        row = again if again is not None and (queued is None or again[3] >= queued[3]) else queued
        return None if row is None else (row[0], row[1], row[2], row[3])

    def _queue_behind(self, head: str, reason: str) -> None:
        """Every other pending job waits behind `head`: one UPDATE of the rows whose reason
        differs (usually only the newcomers), and no write at all when none does.

        "Differs" is read as two ranges of the partial index on queued jobs' reasons
        (below the reason, above it), so that the rows that already have it — nearly the
        whole queue — are never read.
        """
        params = {"head": head, "reason": reason}
        if self.registry.dialect == "postgresql":
            # One statement in autocommit: the rows' locks are taken and the reasons set
            # at once (no write lock to spare, unlike SQLite's).
            with self.registry.statements() as connection:
                connection.execute(_SET_DIFFERING_REASONS, params)
            return
        with self.registry.statements() as connection:
            if all(connection.scalar(q, params) is None for q in _DIFFERS):
                return
        with self.registry.write() as session:
            # Rows locked skipping any another transaction holds (a cancel, or another
            # control plane's loop): nothing waits, so never a deadlock; a skipped row
            # gets its reason on a later tick. At most REASONS_PER_TICK rows per tick.
            connection = session.connection()
            ids: list[str] = []
            for q in _DIFFERING_LOCKED:
                if len(ids) < REASONS_PER_TICK:
                    ids += connection.scalars(q, params).all()
            if ids:
                connection.execute(_SET_REASONS, {"ids": ids[:REASONS_PER_TICK], "reason": reason})

    def _set_reason(self, job_id: str, old: str, new: str) -> None:
        if old == new:
            return
        with self.registry.write() as session:
            job = session.get(Job, job_id, with_for_update=True)
            if job is not None and job.state in ADMITTABLE:
                job.state_reason = new


# The queue's statements, built once (they run on every tick, up to 50 times a second).
_jobs = Job.__table__.c
_HEAD_COLUMNS = (_jobs.id, _jobs.state_reason, _jobs.name, _jobs.priority)
_NOT_TRIED = _jobs.id.not_in(bindparam("tried", expanding=True))
_BEST_AGAIN = (
    select(*_HEAD_COLUMNS)
    .where(
        _jobs.state == JobState.RESCHEDULING,
        ~select(Allocation.job_id).where(Allocation.job_id == _jobs.id).exists(),
        or_(_jobs.not_before.is_(None), _jobs.not_before <= bindparam("now")),
        _NOT_TRIED,
    )
    .order_by(_jobs.priority.desc(), _jobs.created_at, _jobs.id)
    .limit(1)
)
_TOP_PRIORITY = (
    select(_jobs.priority)
    .where(_jobs.state == JobState.PENDING)
    .order_by(_jobs.priority.desc())
    .limit(1)
)
_TOP_BELOW = _TOP_PRIORITY.where(_jobs.priority < bindparam("below"))
_OLDEST = select(*_HEAD_COLUMNS).order_by(_jobs.created_at, _jobs.id).limit(1)
#: The oldest pending job of the highest priority, if not tried this tick: one lookup.
_OLDEST_OF_TOP = _OLDEST.where(
    _jobs.state == JobState.PENDING,
    _jobs.priority == _TOP_PRIORITY.scalar_subquery(),
    _NOT_TRIED,
)
_OLDEST_AT = _OLDEST.where(
    _jobs.state == JobState.PENDING, _jobs.priority == bindparam("priority"), _NOT_TRIED
)
#: Pending, written as the literal term of the partial index ix_jobs_pending_reason (a
#: bound parameter would keep the database from using that index).
_PENDING = text(f"jobs.{PENDING_ONLY}")
_OTHERS = (_PENDING, _jobs.id != bindparam("head"))
_RANGES = (_jobs.state_reason < bindparam("reason"), _jobs.state_reason > bindparam("reason"))
_DIFFERS = tuple(select(_jobs.id).where(*_OTHERS, r).limit(1) for r in _RANGES)
_DIFFERING_LOCKED = tuple(
    select(_jobs.id)
    .where(*_OTHERS, r)
    .order_by(_jobs.id)
    .limit(REASONS_PER_TICK)
    .with_for_update(skip_locked=True)
    for r in _RANGES
)
#: PostgreSQL: every differing row not locked by another transaction, at most
#: REASONS_PER_TICK of each range, in one statement.
_SET_DIFFERING_REASONS = (
    update(Job)
    .where(or_(*(_jobs.id.in_(q.scalar_subquery()) for q in _DIFFERING_LOCKED)))
    .values(state_reason=bindparam("reason"))
)
_SET_REASONS = (
    update(Job)
    .where(_jobs.id.in_(bindparam("ids", expanding=True)))
    .values(state_reason=bindparam("reason"))
)
