"""The registry's tables: what the agents reported, who holds what, and what happened.

The schema is created only by the Alembic migrations in `migrations/`; these classes
describe it for the ORM, and a test checks that the two agree on SQLite and PostgreSQL.

Enumerations are stored as short strings (not database enum types) so that adding a
state is a code change, not an `ALTER TYPE` on PostgreSQL.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend.

    SQLite has no time zones: values are stored as naive UTC and come back aware, so that
    comparisons with `datetime.now(UTC)` never mix naive and aware values.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the registry: use datetime.now(UTC)")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


class AgentStatus(StrEnum):
    ALIVE = "alive"  # registered and its lease was renewed in time (check expiry on read)
    LOST = "lost"  # its lease expired; its GPUs are marked lost


class GpuStatus(StrEnum):
    AVAILABLE = "available"  # reported by a live agent
    LOST = "lost"  # its agent was lost, or it vanished from the inventory while allocated


class JobState(StrEnum):
    """A job's life (DESIGN.md §8). cpn/orchestration drives every transition and writes
    each one as an event row with its reason (cpn/orchestration/states.py)."""

    #: Accepted and queued: waiting for the GPUs it needs (its `state_reason` says which).
    PENDING = "pending"
    #: Admitted: plan, GPU allocations and WAN reservations written in one transaction,
    #: launch orders sent to the agents holding its shards; not every rank runs yet.
    SCHEDULED = "scheduled"
    #: Every rank reported running.
    RUNNING = "running"
    #: Every rank ended with exit code 0.
    SUCCEEDED = "succeeded"
    #: A rank failed (its rank, exit code and last log lines are in `failure`), or the
    #: launch could not be carried out; the other ranks were stopped.
    FAILED = "failed"
    #: Cancelled by its tenant or an admin; every worker was told to stop.
    CANCELLED = "cancelled"
    #: Lost part of its placement (an agent's lease expired) and waits to be planned
    #: again from its last checkpoint. Reserved for the failure-recovery work.
    RESCHEDULING = "rescheduling"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_JOB_STATES


TERMINAL_JOB_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
#: The condition of the partial index on queued jobs' reasons, written as a literal: a
#: query can use a partial index only when its own WHERE holds this very term (a bound
#: parameter in its place does not count, on SQLite nor in PostgreSQL's generic plans).
#: Only queued jobs' reasons are indexed: they are short (what a job waits for), while a
#: failed job's reason may carry a worker's last line.
PENDING_ONLY = "state = 'pending'"


class TaskState(StrEnum):
    """One worker (rank) of a job, as its agent reports it; mirrors cpn.v1.TaskState."""

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # by a stop order, or because another worker failed
    # From a site engine (Slurm, Kubernetes): who ended the work.
    PENDING = "pending"  # queued by the engine, not started yet
    CANCELLED = "cancelled"  # cancelled at the site, not by cpn
    PREEMPTED = "preempted"  # the engine took the nodes back: a loss of infrastructure
    NODE_LOST = "node_lost"  # a node of the launch failed: a loss of infrastructure


#: A rank in one of these has ended: nothing follows for its epoch.
FINAL_TASK_STATES = frozenset(
    {
        TaskState.SUCCEEDED,
        TaskState.FAILED,
        TaskState.STOPPED,
        TaskState.CANCELLED,
        TaskState.PREEMPTED,
        TaskState.NODE_LOST,
    }
)


def _enum(cls: type[StrEnum]) -> Enum:
    return Enum(
        cls,
        native_enum=False,
        create_constraint=False,
        length=16,
        values_callable=lambda e: [m.value for m in e],
    )


NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {datetime: UtcDateTime}  # noqa: RUF012 (SQLAlchemy reads it)


class Site(Base):
    """A datacenter. Created when its first agent registers; settings come from the operator."""

    __tablename__ = "sites"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    gpu_price_per_hour: Mapped[float] = mapped_column(Float, default=0.0)
    #: None: derived from the nodes' RDMA NICs, else a default (see topology.py).
    intra_site_gbps: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    agents: Mapped[list[Agent]] = relationship(back_populates="site", order_by="Agent.agent_id")
    nodes: Mapped[list[Node]] = relationship(back_populates="site", order_by="Node.name")
    links: Mapped[list[WanLink]] = relationship(
        foreign_keys="WanLink.site_id", back_populates="site", order_by="WanLink.peer_site_id"
    )


class Agent(Base):
    __tablename__ = "agents"
    __table_args__ = (UniqueConstraint("site_id", "agent_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    site_id: Mapped[int] = mapped_column(ForeignKey("sites.id", ondelete="CASCADE"))
    agent_id: Mapped[str] = mapped_column(String(128))
    version: Mapped[str] = mapped_column(String(64), default="")
    probe_address: Mapped[str] = mapped_column(String(256), default="")
    health: Mapped[str] = mapped_column(String(16), default="ok")
    status: Mapped[AgentStatus] = mapped_column(_enum(AgentStatus), default=AgentStatus.ALIVE)
    registrations: Mapped[int] = mapped_column(Integer, default=1)
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(nullable=True)
    lost_at: Mapped[datetime | None] = mapped_column(nullable=True)

    site: Mapped[Site] = relationship(back_populates="agents")
    lease: Mapped[Lease | None] = relationship(back_populates="agent", uselist=False)
    nodes: Mapped[list[Node]] = relationship(back_populates="agent", order_by="Node.name")

    def alive_at(self, now: datetime) -> bool:
        """Alive only while its lease has not expired: expiry is checked on every read."""
        return (
            self.status == AgentStatus.ALIVE
            and self.lease is not None
            and self.lease.revoked_at is None
            and self.lease.expires_at > now
        )


class Lease(Base):
    """An agent's lease: renewed by heartbeats, the agent is lost once it expires."""

    __tablename__ = "leases"

    id: Mapped[int] = mapped_column(primary_key=True)
    lease_id: Mapped[str] = mapped_column(String(36), unique=True)
    agent_pk: Mapped[int] = mapped_column(ForeignKey("agents.id", ondelete="CASCADE"), unique=True)
    ttl_ms: Mapped[int] = mapped_column(Integer)
    granted_at: Mapped[datetime] = mapped_column(default=utcnow)
    renewed_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None] = mapped_column(nullable=True)

    agent: Mapped[Agent] = relationship(back_populates="lease")


class Node(Base):
    __tablename__ = "nodes"
    __table_args__ = (UniqueConstraint("site_id", "name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    site_id: Mapped[int] = mapped_column(ForeignKey("sites.id", ondelete="CASCADE"))
    agent_pk: Mapped[int] = mapped_column(ForeignKey("agents.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    intra_node_gbps: Mapped[float | None] = mapped_column(Float, nullable=True)

    site: Mapped[Site] = relationship(back_populates="nodes")
    agent: Mapped[Agent] = relationship(back_populates="nodes")
    gpus: Mapped[list[Gpu]] = relationship(
        back_populates="node", order_by="Gpu.index", cascade="all, delete-orphan"
    )
    rdma_nics: Mapped[list[RdmaNic]] = relationship(
        back_populates="node",
        order_by="(RdmaNic.device, RdmaNic.port)",
        cascade="all, delete-orphan",
    )


class Gpu(Base):
    __tablename__ = "gpus"
    __table_args__ = (UniqueConstraint("node_id", "index"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(64))
    memory_gb: Mapped[float] = mapped_column(Float)
    tflops: Mapped[float] = mapped_column(Float)
    uuid: Mapped[str] = mapped_column(String(64), default="")
    source: Mapped[str] = mapped_column(String(16), default="virtual")
    status: Mapped[GpuStatus] = mapped_column(_enum(GpuStatus), default=GpuStatus.AVAILABLE)
    utilisation: Mapped[float | None] = mapped_column(Float, nullable=True)
    memory_used_gb: Mapped[float | None] = mapped_column(Float, nullable=True)

    node: Mapped[Node] = relationship(back_populates="gpus")
    allocation: Mapped[Allocation | None] = relationship(back_populates="gpu", uselist=False)


class RdmaNic(Base):
    """One port of an RDMA device (mlx5_0 port 1, ...)."""

    __tablename__ = "rdma_nics"
    __table_args__ = (UniqueConstraint("node_id", "device", "port"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    device: Mapped[str] = mapped_column(String(64))
    port: Mapped[int] = mapped_column(Integer)
    transport: Mapped[str] = mapped_column(String(16))  # infiniband | roce | iwarp
    roce_version: Mapped[int] = mapped_column(Integer, default=0)
    rate_gbps: Mapped[float] = mapped_column(Float)
    state: Mapped[str] = mapped_column(String(16))  # down | init | armed | active | ...

    node: Mapped[Node] = relationship(back_populates="rdma_nics")


class WanLink(Base):
    """The latest measurement of the WAN from one site to another (directed)."""

    __tablename__ = "wan_links"
    __table_args__ = (UniqueConstraint("site_id", "peer_site_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    site_id: Mapped[int] = mapped_column(ForeignKey("sites.id", ondelete="CASCADE"))
    peer_site_id: Mapped[int] = mapped_column(ForeignKey("sites.id", ondelete="CASCADE"))
    bandwidth_gbps: Mapped[float] = mapped_column(Float)
    rtt_ms: Mapped[float] = mapped_column(Float)
    measured_at: Mapped[datetime]
    reported_by: Mapped[str] = mapped_column(String(128), default="")

    site: Mapped[Site] = relationship(foreign_keys=[site_id], back_populates="links")
    peer_site: Mapped[Site] = relationship(foreign_keys=[peer_site_id])


class Tenant(Base):
    """Who jobs belong to. A tenant sees only its own jobs; `gpu_quota` caps the GPUs its
    unfinished jobs may ask for together (None: no cap)."""

    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    gpu_quota: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    api_keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant")


class Role(StrEnum):
    USER = "user"  # its own tenant's jobs only
    ADMIN = "admin"  # every tenant's jobs


class ApiKey(Base):
    """An API key: only its SHA-256 digest is stored (the key itself is shown once, when
    made). Keys are 256-bit random strings, so a fast digest is enough: there is nothing
    for a slow password hash to protect against guessing."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16), unique=True)  # shown in lists, revokes
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    role: Mapped[Role] = mapped_column(_enum(Role), default=Role.USER)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(nullable=True)

    tenant: Mapped[Tenant] = relationship(back_populates="api_keys")


class Job(Base):
    """A training job, from submission to its end. The plan, the GPU allocations and the
    WAN reservations are written in one transaction when it is admitted."""

    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key"),
        # The orchestration loop's queries, in time independent of the queue's length (it
        # ticks up to 50 times a second while jobs are submitted): the queue's head, one
        # priority at a time, and the queued jobs whose reason is not yet the current one.
        Index("ix_jobs_queue", "state", "priority", "created_at", "id"),
        Index(
            "ix_jobs_pending_reason",
            "state",
            "state_reason",
            sqlite_where=text(PENDING_ONLY),
            postgresql_where=text(PENDING_ONLY),
        ),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    state: Mapped[JobState] = mapped_column(_enum(JobState), default=JobState.PENDING, index=True)
    #: Why it is in its state: what it waits for, why it failed, who cancelled it.
    state_reason: Mapped[str] = mapped_column(Text, default="")
    spec: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    tenant_id: Mapped[int | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="SET NULL"), nullable=True, index=True
    )
    priority: Mapped[int] = mapped_column(Integer, default=0)
    gpus: Mapped[int] = mapped_column(Integer, default=0)  # asked for: counts to the quota
    idempotency_key: Mapped[str | None] = mapped_column(String(128), nullable=True)
    request_hash: Mapped[str] = mapped_column(String(64), default="")
    #: A quote's plan to use if it still fits (candidate index in the quote).
    quote_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    quote_candidate: Mapped[int | None] = mapped_column(Integer, nullable=True)
    rendezvous_host: Mapped[str] = mapped_column(String(256), default="")
    rendezvous_port: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: Set when a failure ends it: {"rank", "exit_code", "message", "last_lines"}.
    failure: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    #: The current launch's epoch: 0 before the first launch, +1 at every admission
    #: (first, and again after a loss or a restart). Launch orders, task states and
    #: checkpoints belong to one epoch; anything of an older one is stale (fencing).
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    #: The checkpoint the next epoch resumes from: {"epoch", "step", "path"} of the newest
    #: complete step written by an epoch while it was current (None: start at step 0).
    checkpoint: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    #: Launches again after a worker failed in user code, and after infrastructure losses
    #: (an agent lost, a worker stuck): counted apart, only the first uses max_restarts.
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    losses: Mapped[int] = mapped_column(Integer, default=0)
    #: Not admitted again before this time (backoff after a failure); None: at once.
    not_before: Mapped[datetime | None] = mapped_column(nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    scheduled_at: Mapped[datetime | None] = mapped_column(nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)

    allocations: Mapped[list[Allocation]] = relationship(back_populates="job")
    tenant: Mapped[Tenant | None] = relationship()


class Quote(Base):
    """Ranked candidate plans for a job, as offered: nothing is reserved."""

    __tablename__ = "quotes"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[int | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), nullable=True, index=True
    )
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    candidates: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]


class RendezvousPort(Base):
    """The torch.distributed rendezvous endpoint of a live job. UNIQUE (host, port): two
    live jobs never share one, whoever admits them."""

    __tablename__ = "rendezvous_ports"
    __table_args__ = (UniqueConstraint("host", "port"),)

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    host: Mapped[str] = mapped_column(String(256))
    port: Mapped[int] = mapped_column(Integer)


#: Row ids that may grow past 2³¹ on PostgreSQL; SQLite autoincrements only INTEGER keys.
_BIG_ID = BigInteger().with_variant(Integer(), "sqlite")


class JobLogLine(Base):
    """A line a worker printed, forwarded by its agent; the newest lines per rank are kept."""

    __tablename__ = "job_log_lines"
    __table_args__ = (Index("ix_job_log_lines_job_rank", "job_id", "rank", "id"),)

    id: Mapped[int] = mapped_column(_BIG_ID, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    line: Mapped[str] = mapped_column(Text)
    at: Mapped[datetime] = mapped_column(default=utcnow)


class JobStep(Base):
    """One training step of a job, summed over the ranks that reported it: the per-step
    series of GET /v1/jobs/{id}/metrics."""

    __tablename__ = "job_steps"
    __table_args__ = (UniqueConstraint("job_id", "step"),)

    id: Mapped[int] = mapped_column(_BIG_ID, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(BigInteger)
    ranks: Mapped[int] = mapped_column(Integer, default=0)  # how many reported it
    loss_sum: Mapped[float] = mapped_column(Float, default=0.0)
    loss_count: Mapped[int] = mapped_column(Integer, default=0)
    seconds: Mapped[float] = mapped_column(Float, default=0.0)  # the slowest rank's
    bytes_intra_node: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_intra_site: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_wan: Mapped[int] = mapped_column(BigInteger, default=0)
    #: The WAN sync that ran the step ("fp16", "outer H=32 int8"): wan: auto's rung.
    wan_sync: Mapped[str | None] = mapped_column(String(200), nullable=True, default=None)
    at: Mapped[datetime] = mapped_column(default=utcnow)


class Allocation(Base):
    """One GPU held by one job. The unique GPU id is what makes double allocation
    impossible, whatever the schedulers racing for it do."""

    __tablename__ = "allocations"

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpus.id", ondelete="CASCADE"), unique=True)
    allocated_at: Mapped[datetime] = mapped_column(default=utcnow)

    job: Mapped[Job] = relationship(back_populates="allocations")
    gpu: Mapped[Gpu] = relationship(back_populates="allocation")


class LinkReservation(Base):
    """WAN bandwidth a job holds on a link ("a|b", names sorted)."""

    __tablename__ = "link_reservations"
    __table_args__ = (UniqueConstraint("job_id", "link_key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    link_key: Mapped[str] = mapped_column(String(140))
    gbps: Mapped[float] = mapped_column(Float)


class OrderState(StrEnum):
    QUEUED = "queued"  # waiting for the agent's WatchAssignments stream
    DELIVERED = "delivered"  # written to the agent's stream
    DROPPED = "dropped"  # its agent was lost before it was delivered


class Order(Base):
    """A launch or stop order for one agent, from the moment it is decided until the agent's
    stream has taken it: orders outlive a control-plane restart (they are written in the
    transaction that decides them), and UNIQUE (job, epoch, site, agent, kind) makes a
    second launch of one job epoch on one agent impossible, whoever decides it."""

    __tablename__ = "orders"
    __table_args__ = (
        UniqueConstraint("job_id", "epoch", "site", "agent_id", "kind"),
        Index("ix_orders_agent_state", "site", "agent_id", "state", "id"),
    )

    id: Mapped[int] = mapped_column(_BIG_ID, primary_key=True, autoincrement=True)
    order_id: Mapped[str] = mapped_column(String(32), unique=True)
    #: Not a foreign key: the control layer may order work for jobs the service layer did
    #: not create (tools, tests); task reports then refer to the order (references.py).
    job_id: Mapped[str] = mapped_column(String(64), index=True)
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    site: Mapped[str] = mapped_column(String(64))
    agent_id: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(8))  # launch | stop
    #: The serialized cpn.v1.Assignment, exactly as the agent will receive it.
    body: Mapped[bytes] = mapped_column(LargeBinary)
    state: Mapped[OrderState] = mapped_column(_enum(OrderState), default=OrderState.QUEUED)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(nullable=True)


class Task(Base):
    """The last status reported for one rank of a job (in the job's current epoch)."""

    __tablename__ = "tasks"
    __table_args__ = (UniqueConstraint("job_id", "rank"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[str] = mapped_column(String(64), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    site: Mapped[str] = mapped_column(String(64))
    agent_id: Mapped[str] = mapped_column(String(128))
    state: Mapped[TaskState] = mapped_column(_enum(TaskState))
    step: Mapped[int] = mapped_column(BigInteger, default=0)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    bytes_intra_node: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_intra_site: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_wan: Mapped[int] = mapped_column(BigInteger, default=0)
    checkpoint_id: Mapped[str] = mapped_column(String(256), default="")
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    message: Mapped[str] = mapped_column(Text, default="")
    #: Per-step records taken so far (the next step expected): a batch the agent sends
    #: twice (its reply was lost) is not counted twice.
    metrics_steps: Mapped[int] = mapped_column(BigInteger, default=0)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    #: When the rank last moved on: started, or reported a higher step (stuck detection).
    progressed_at: Mapped[datetime | None] = mapped_column(nullable=True)


class Event(Base):
    """Something that happened, for operators and the service layer's job events."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(primary_key=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    kind: Mapped[str] = mapped_column(String(32), index=True)
    site: Mapped[str | None] = mapped_column(String(64), nullable=True)
    agent_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    job_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
