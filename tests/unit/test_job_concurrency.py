"""Two processes (two control planes on one database) each submit and admit 25 jobs at
once, from several threads: no GPU is ever allocated twice, every admitted job holds its
whole plan, the others wait with nothing held — on SQLite and PostgreSQL."""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import func, select

from cpn.contracts import JobSpec
from cpn.control.settings import ControlSettings
from cpn.orchestration import JobService, Principal
from cpn.orchestration.admission import Admitted, try_admit
from cpn.orchestration.errors import QuotaExceeded
from cpn.orchestration.tenants import create_key
from cpn.registry import Registry
from cpn.registry.models import Allocation, Job, JobState, RendezvousPort, Role, Tenant
from tests.registry_factories import node, register
from tests.service_harness import tiny_job

PER_PROCESS = 25
GPUS = 12  # three sites of four


def _worker(url: str, tenant_id: int, tag: str, start: object, out: object) -> None:
    registry = Registry(url)
    settings = ControlSettings(database_url=url, plan_time_limit_s=2.0)
    service = JobService(registry, settings)
    principal = Principal(tenant_id, "load", Role.USER)
    spec = JobSpec.model_validate(tiny_job("one", dp=1, pp=1))
    start.wait(30)  # type: ignore[attr-defined]

    def one(i: int) -> bool:
        view, _ = service.submit(principal, spec, idempotency_key=f"{tag}-{i}")
        return isinstance(try_admit(registry, settings, view.job.id), Admitted)

    with ThreadPoolExecutor(5) as pool:
        admitted = sum(pool.map(one, range(PER_PROCESS)))
    registry.dispose()
    out.put(admitted)  # type: ignore[attr-defined]


def test_simultaneous_submissions_never_allocate_a_gpu_twice(registry: Registry) -> None:
    for site in ("a", "b", "c"):
        register(registry, site, nodes=(node(f"{site}0", gpus=4, memory_gb=16),),
                 probe_address=f"10.0.0.{ord(site)}:1")  # fmt: skip
    with registry.write() as s:
        create_key(s, "load")
        tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == "load"))
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(registry.url, tenant_id, tag, start, out))
        for tag in ("p", "q")
    ]
    for proc in procs:
        proc.start()
    start.set()
    admitted = out.get(timeout=300) + out.get(timeout=300)
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    # Racing admissions may lose to each other (AllocationConflict: nothing written) and
    # wait; the loop's next tick admits in queue order what still fits.
    settings = ControlSettings(database_url=registry.url, plan_time_limit_s=2.0)
    with registry.read() as s:
        pending = s.scalars(select(Job.id).where(Job.state == JobState.PENDING)).all()
    admitted += sum(isinstance(try_admit(registry, settings, j), Admitted) for j in pending)
    with registry.read() as s:
        gpu_ids = s.scalars(select(Allocation.gpu_id)).all()
        jobs = s.scalars(select(Job)).all()
        ports = s.execute(select(RendezvousPort.host, RendezvousPort.port)).all()
        per_job: dict[str, int] = {
            job_id: n
            for job_id, n in s.execute(
                select(Allocation.job_id, func.count()).group_by(Allocation.job_id)
            )
        }
    assert len(jobs) == 2 * PER_PROCESS
    assert len(gpu_ids) == len(set(gpu_ids)) == GPUS  # every GPU once, none twice
    scheduled = [j for j in jobs if j.state is JobState.SCHEDULED]
    assert admitted == len(scheduled) == GPUS
    for job in jobs:
        assert per_job.get(job.id, 0) == (1 if job.state is JobState.SCHEDULED else 0)
    assert len(ports) == len(set(ports)) == GPUS


def test_racing_submissions_keep_the_quota_and_one_key_makes_one_job(registry: Registry) -> None:
    """Submissions racing from 12 threads: a tenant with a quota of 5 GPUs gets exactly 5
    one-GPU jobs (the tenant's row is locked while it is counted); 12 requests with one
    Idempotency-Key make one job, and all of them get it."""
    register(registry, "a", nodes=(node("a0", gpus=4, memory_gb=16),), probe_address="10.0.0.1:1")
    with registry.write() as s:
        create_key(s, "capped", gpu_quota=5)
        create_key(s, "free")
        ids = {name: tenant_id for name, tenant_id in s.execute(select(Tenant.name, Tenant.id))}
    service = JobService(registry, ControlSettings(database_url=registry.url))
    spec = JobSpec.model_validate(tiny_job("one", dp=1, pp=1))
    capped = Principal(ids["capped"], "capped", Role.USER)
    free = Principal(ids["free"], "free", Role.USER)

    def capped_submit(i: int) -> bool:
        try:
            service.submit(capped, spec, idempotency_key=f"k{i}")
        except QuotaExceeded:
            return False
        return True

    def same_key(_: int) -> tuple[str, bool]:
        view, created = service.submit(free, spec, idempotency_key="the-one")
        return view.job.id, created

    with ThreadPoolExecutor(12) as pool:
        accepted = sum(pool.map(capped_submit, range(12)))
        answers = list(pool.map(same_key, range(12)))
    assert accepted == 5
    assert len({job_id for job_id, _ in answers}) == 1
    assert sum(created for _, created in answers) == 1
    with registry.read() as s:
        rows = s.execute(select(Job.tenant_id, func.count()).group_by(Job.tenant_id))
        per_tenant = {tenant_id: n for tenant_id, n in rows}
    assert per_tenant == {ids["capped"]: 5, ids["free"]: 1}
