"""A chaos driver: a stream of small jobs on a cluster of real processes (`cluster` of
tests/service_harness.py) while agents, workers and the control plane are killed at random
(SIGKILL), seeded, so that a run can be repeated. It counts what an operator asks after a
bad week: jobs submitted, succeeded, lost (goal 0), restarts (infrastructure losses and
user-code failures apart), and how long each fault took to recover from.

Used by `bench/chaos.py` (a soak of minutes) and by the suite's chaos test (a short run).

A fault is one of
  - `agent`:   a site's agent killed; the site stays down 0..`agent_down_s` s, then its
               agent is started again (a fresh lease: the old one expires, its jobs are
               planned again and resume from their checkpoints);
  - `worker`:  one worker process killed (a crash in user code for the recovery policy);
  - `control`: `cpn serve` killed, down 0..`control_down_s` s, then started again on the
               same database (an outage that outlasts the lease makes the agents fence
               their workers: the jobs resume from their checkpoints).
Time to recover: from the kill until every job the fault touched (placed on the site, the
worker's job, every active job for the control plane) has gone past the step it had
reached at the kill, or ended.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select

from api.job_schemas import JobPublic
from cpn.client import ApiError, CpnClient
from cpn.registry import Registry
from cpn.registry.models import Event, Order, OrderState, Task
from tests.processes import worker_pids
from tests.service_harness import Cluster, cluster, make_key, tiny_job

FAULTS = ("agent", "worker", "control")
TERMINAL = {"succeeded", "failed", "cancelled"}
SITES = {"a": 2, "b": 2, "c": 2}


@dataclass(frozen=True)
class ChaosConfig:
    seed: int = 0
    seconds: float = 60.0  # faults and submissions for this long, then drain
    #: Seconds between faults (uniform in this range), and then until the faults before
    #: are recovered from, for at most `recover_wait_s` more (faults may overlap).
    fault_every_s: tuple[float, float] = (4.0, 10.0)
    weights: tuple[float, float, float] = (0.55, 0.2, 0.25)  # agent, worker, control
    #: Faults in this order (cycled) instead of drawn with `weights`: a short run that
    #: must see each kind.
    schedule: tuple[str, ...] = ()
    #: > 0: inject exactly this many faults (then drain), however long that takes.
    faults: int = 0
    #: Go on after `seconds` until there were at least this many kills of each kind.
    min_kills: tuple[tuple[str, int], ...] = ()
    agent_down_s: float = 3.0
    control_down_s: float = 3.0
    recover_wait_s: float = 15.0
    in_flight: int = 2  # jobs kept submitted and not ended
    steps: tuple[int, int] = (12, 30)
    checkpoint_every: int = 3
    max_restarts: int = 50
    lease_ttl: float = 4.0
    drain_s: float = 300.0


@dataclass
class Fault:
    kind: str
    target: str
    at: float  # monotonic
    touched: dict[str, int]  # job id -> step at the kill
    recovered_s: float | None = None


@dataclass
class ChaosReport:
    seed: int
    submitted: int = 0
    succeeded: int = 0
    failed: int = 0
    unfinished: int = 0
    #: Succeeded jobs whose per-step series is not every step once (a gap or a repeat).
    broken_series: int = 0
    restarts_user: int = 0
    restarts_infra: int = 0
    #: Launch orders delivered (one per job, epoch and agent) and launches the agents'
    #: logs say they started: never more started than delivered (nothing carried out
    #: twice); fewer only by an agent killed between taking an order and starting it.
    launch_orders: int = 0
    launches_started: int = 0
    repeated_orders: int = 0  # (job, epoch, site) with more than one launch order
    kills: Counter[str] = field(default_factory=Counter)
    faults: list[Fault] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # reasons of failed jobs
    #: Per job that never ended: its ranks, events, agents' lines and run files' tails.
    diagnoses: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def lost(self) -> int:
        """Jobs submitted that did not succeed (failed, or not ended after the drain)."""
        return self.submitted - self.succeeded

    def recover_times(self) -> list[float]:
        return sorted(f.recovered_s for f in self.faults if f.recovered_s is not None)

    def recover_p50_max(self) -> tuple[float | None, float | None]:
        times = self.recover_times()
        return (statistics.median(times), times[-1]) if times else (None, None)

    def unrecovered(self) -> int:
        return sum(1 for f in self.faults if f.touched and f.recovered_s is None)


class ChaosRun:
    """One run of the driver against a cluster `c` (see `chaos`)."""

    def __init__(self, c: Cluster, config: ChaosConfig, client: CpnClient) -> None:
        self.c, self.config, self.client = c, config, client
        self.rng = random.Random(config.seed)
        self.report = ChaosReport(config.seed)
        self.jobs: dict[str, JobPublic] = {}  # every job submitted, as last seen
        self._pending_key: tuple[str, dict[str, object]] | None = None
        self._n = 0

    # ------------------------------------------------------------------ jobs

    def _next_spec(self) -> tuple[str, dict[str, object]]:
        cfg = self.config
        self._n += 1
        dp, pp = self.rng.choice([(1, 1), (1, 2), (2, 1), (2, 2)])
        steps = self.rng.randint(*cfg.steps)
        recovery = {
            "checkpoint_every": cfg.checkpoint_every,
            "max_restarts": cfg.max_restarts,
            "on_worker_error": "restart",
        }
        name = f"chaos-{cfg.seed}-{self._n}"
        return name, tiny_job(name, dp=dp, pp=pp, steps=steps, recovery=recovery)

    def _top_up(self) -> None:
        """Keep `in_flight` jobs not ended; a submission that finds the control plane down
        is sent again later with the same Idempotency-Key (never a second job)."""
        active = sum(1 for j in self.jobs.values() if j.state.value not in TERMINAL)
        while active < self.config.in_flight:
            if self._pending_key is None:
                self._pending_key = self._next_spec()
            key, spec = self._pending_key
            try:
                job = self.client.submit(spec, idempotency_key=key)
            except ApiError as exc:
                if exc.status == 0 or exc.status >= 500:
                    return
                raise
            self._pending_key = None
            if job.id not in self.jobs:
                self.report.submitted += 1
            self.jobs[job.id] = job
            active += 1

    def _poll(self) -> bool:
        """Refresh every job not ended; False when the control plane does not answer."""
        try:
            for job_id, job in list(self.jobs.items()):
                if job.state.value not in TERMINAL:
                    self.jobs[job_id] = self.client.job(job_id)
        except ApiError as exc:
            if exc.status == 0 or exc.status >= 500:
                return False
            raise
        return True

    # ------------------------------------------------------------------ faults

    def _active(self) -> list[JobPublic]:
        return [j for j in self.jobs.values() if j.state.value not in TERMINAL]

    def _touched(self, kind: str, target: str, job_id: str | None = None) -> dict[str, int]:
        jobs = self._active()
        if kind == "agent":
            jobs = [j for j in jobs if j.plan is not None and target in j.plan.sites_used()]
        elif kind == "worker":
            jobs = [j for j in jobs if j.id == job_id]
        return {j.id: j.progress.step for j in jobs if j.state.value == "running"}

    def _inject(self) -> Fault | None:
        cfg, c = self.config, self.c
        if cfg.schedule:
            kind = cfg.schedule[len(self.report.faults) % len(cfg.schedule)]
        else:
            kind = self.rng.choices(FAULTS, weights=cfg.weights)[0]
        if kind == "worker":
            pids = worker_pids(str(c.tmp))
            if not pids:
                return None
            pid = self.rng.choice(pids)
            job_id = _job_of(pid)
            fault = Fault(kind, f"pid {pid}", time.monotonic(), self._touched(kind, "", job_id))
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        elif kind == "agent":
            # A site that runs something, if any does: a kill that matters.
            used = {s for j in self._active() if j.plan is not None for s in j.plan.sites_used()}
            site = self.rng.choice(sorted(used & set(c.agents) or c.agents))
            fault = Fault(kind, site, time.monotonic(), self._touched(kind, site))
            c.restart_agent(site, down_s=self.rng.uniform(0, cfg.agent_down_s))
        else:
            fault = Fault(kind, "serve", time.monotonic(), self._touched(kind, ""))
            c.serve.stop(signal.SIGKILL)
            time.sleep(self.rng.uniform(0, cfg.control_down_s))
            c.restart_serve()
        self.report.kills[kind] += 1
        self.report.faults.append(fault)
        return fault

    def _recovered(self, fault: Fault) -> bool:
        for job_id, step in fault.touched.items():
            job = self.jobs[job_id]
            if job.state.value not in TERMINAL and job.progress.step <= step:
                return False
        return True

    def _go_on(self, end: float) -> bool:
        cfg, kills = self.config, self.report.kills
        if cfg.faults:
            return len(self.report.faults) < cfg.faults
        return time.monotonic() < end or any(kills[k] < n for k, n in cfg.min_kills)

    def _settle(self, open_faults: list[Fault], now: float) -> None:
        """Close the faults recovered from (their time is taken now); those still open
        when the drain ends count as unrecovered."""
        for fault in list(open_faults):
            if self._recovered(fault):
                fault.recovered_s = now - fault.at
                open_faults.remove(fault)

    # ------------------------------------------------------------------ the run

    def run(self, on_tick: Callable[[ChaosRun, str], None] | None = None) -> ChaosReport:
        cfg = self.config
        start = time.monotonic()
        end = start + cfg.seconds
        open_faults: list[Fault] = []
        next_fault = start + self.rng.uniform(*cfg.fault_every_s)
        while self._go_on(end):
            if self._poll():
                self._top_up()
            now = time.monotonic()
            self._settle(open_faults, now)
            waited = now - next_fault
            if waited >= 0 and (not open_faults or waited > cfg.recover_wait_s):
                new = self._inject()
                if new is not None and new.touched:
                    open_faults.append(new)
                next_fault = time.monotonic() + self.rng.uniform(*cfg.fault_every_s)
            if on_tick is not None:
                on_tick(self, "chaos")
            time.sleep(0.5)
        # Drain: no more faults or submissions; every job must end.
        drain_end = time.monotonic() + cfg.drain_s
        while time.monotonic() < drain_end:
            if self._poll():
                self._settle(open_faults, time.monotonic())
                if not self._active():
                    break
            if on_tick is not None:
                on_tick(self, "drain")
            time.sleep(0.5)
        self._count()
        self.report.wall_s = time.monotonic() - start
        return self.report

    def _count(self) -> None:
        r = self.report
        registry = Registry(self.c.db_url)
        try:
            with registry.read() as session:
                orders = Counter(
                    (o.job_id, o.epoch, o.site)
                    for o in session.scalars(
                        select(Order).where(
                            Order.kind == "launch", Order.state == OrderState.DELIVERED
                        )
                    )
                )
        finally:
            registry.dispose()
        r.launch_orders = sum(orders.values())
        r.repeated_orders = sum(1 for n in orders.values() if n > 1)
        r.launches_started = sum(p.text().count(": ranks [") for p in self.c.agents.values())
        for job in self.jobs.values():
            r.restarts_user += job.restarts
            r.restarts_infra += job.losses
            state = job.state.value
            if state == "succeeded":
                r.succeeded += 1
                steps = int(job.spec["train"]["steps"])
                series = [s.step for s in self.client.metrics(job.id).steps]
                if series != list(range(steps)):
                    r.broken_series += 1
                    r.failures.append(f"{job.id}: series {series[:5]}… of {len(series)} steps")
            elif state == "failed":
                r.failed += 1
                r.failures.append(f"{job.id} ({job.name}): {job.reason}")
            else:
                r.unfinished += 1
                r.failures.append(f"{job.id} ({job.name}): still {state}: {job.reason}")
                r.diagnoses.append(self._diagnose(job))

    def _diagnose(self, job: JobPublic) -> str:
        """What a job that never ended left behind: its ranks and events as the control
        plane has them, what the agents logged of it, and the tails of its run files — a
        CI failure's only record (its temporary directory is gone)."""
        out = [f"== {job.id} ({job.name}) {job.state.value} epoch {job.epoch}: {job.reason}"]
        registry = Registry(self.c.db_url)
        try:
            with registry.read() as session:
                for t in session.scalars(select(Task).where(Task.job_id == job.id)):
                    out.append(
                        f"task rank {t.rank} epoch {t.epoch} {t.site} {t.state.value} "
                        f"step {t.step} updated {t.updated_at:%H:%M:%S} "
                        f"progressed {t.progressed_at or '-'} {t.message[:200]!r}"
                    )
                for e in session.scalars(
                    select(Event).where(Event.job_id == job.id).order_by(Event.id)
                ):
                    out.append(f"event {e.at:%H:%M:%S.%f} {e.kind} {e.message[:200]}")
        finally:
            registry.dispose()
        serve = [line for line in self.c.serve.text().splitlines() if job.id in line]
        out += [f"serve: {line}" for line in serve[-40:]]
        for site, agent in self.c.agents.items():
            lines = [line for line in agent.text().splitlines() if job.id in line]
            out += [f"agent {site}: {line}" for line in lines[-40:]]
            run_dir = self.c.tmp / f"work-{site}" / job.id
            for path in sorted(run_dir.glob("*")) if run_dir.is_dir() else []:
                if path.suffix in (".log", ".out") or path.name == "result.json":
                    tail = path.read_text(errors="replace").splitlines()[-15:]
                    out += [f"{site}/{path.name}: {line}" for line in tail]
        return "\n".join(out)


def _job_of(pid: int) -> str | None:
    """The job id in a worker's --job path (`…/work-SITE/JOB/…`)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    with suppress(ValueError, IndexError):
        path = Path(cmd[cmd.index("--job") + 1])
        for part in path.parts:
            if part.startswith("work-"):
                return path.parts[path.parts.index(part) + 1]
    return None


@contextmanager
def chaos_cluster(tmp: Path, config: ChaosConfig) -> Iterator[tuple[Cluster, CpnClient]]:
    """The cluster a chaos run needs: three sites of 2 GPUs, a short lease, checkpoints in
    `tmp/checkpoints`, quick restarts; and a tenant's client."""
    env = {
        "CPN_CHECKPOINT_ROOT": str(tmp / "checkpoints"),
        "CPN_STOP_GRACE_S": "3",
        "CPN_RESTART_BACKOFF_S": "0.2",
        "CPN_ORDER_POLL_S": "0.5",
    }
    with (
        cluster(tmp, SITES, env=env, lease_ttl=config.lease_ttl) as c,
        CpnClient(c.url, make_key(c.db_url, "chaos"), timeout=10) as client,
    ):
        yield c, client


def run_chaos(
    tmp: Path, config: ChaosConfig, on_tick: Callable[[ChaosRun, str], None] | None = None
) -> ChaosReport:
    with chaos_cluster(tmp, config) as (c, client):
        return ChaosRun(c, config, client).run(on_tick)


__all__ = ["ChaosConfig", "ChaosReport", "ChaosRun", "chaos_cluster", "run_chaos"]
