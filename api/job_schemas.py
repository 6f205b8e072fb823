"""The job family of schemas: what clients send (`JobCreate`) and get back (`JobPublic`,
`JobsPublic`, events, metrics, logs). Shared with the typed client (cpn.client)."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field, model_validator

from cpn.contracts import JobSpec, Plan
from cpn.registry.models import JobState

#: Beyond any real job; keeps `parallel: auto`'s layout search bounded.
MAX_GPUS = 65_536


def unstorable(value: object) -> str | None:
    """Why a JSON value cannot be stored as it is, naming its field: a NaN or infinite
    number (Python's JSON parser accepts `NaN` and `Infinity`; PostgreSQL's json type does
    not, and no field means them), or a string with a NUL character (PostgreSQL text
    cannot hold one). None if it can. A loop, not recursion: any depth the JSON parser
    accepts is walked without running out of stack."""
    todo: list[tuple[object, str]] = [(value, "")]
    while todo:
        item, where = todo.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return f"{where or 'body'}: must be a finite number, got {item}"
        if isinstance(item, str) and "\x00" in item:
            return f"{where or 'body'}: must not contain a NUL character"
        if isinstance(item, dict):
            todo.extend((v, f"{where}.{k}" if where else str(k)) for k, v in item.items())
        elif isinstance(item, list):
            todo.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
    return None


class StorableBody(BaseModel):
    """A request body refused (422, the field named) if it holds a value the registry
    cannot store, before any field is validated."""

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        problem = unstorable(data)
        if problem:
            raise ValueError(problem)
        return data


class JobCreate(JobSpec, StorableBody):
    """The job YAML's fields (docs/contracts.md) as JSON, and optionally a quote to use."""

    quote_id: str | None = Field(
        default=None,
        max_length=64,
        description="Run the plan of a quote's candidate (POST /v1/quotes) if it still fits.",
    )
    candidate: int = Field(default=0, ge=0, le=64, description="Which candidate of the quote.")

    @model_validator(mode="after")
    def _bounded(self) -> JobCreate:
        gpus = self.gpus if self.parallel == "auto" else self.fixed_parallel.world_size
        if gpus is not None and gpus > MAX_GPUS:
            field = "gpus" if self.parallel == "auto" else "parallel"
            raise ValueError(f"{field}: at most {MAX_GPUS} GPUs per job, got {gpus}")
        return self

    def spec(self) -> JobSpec:
        """The job without the quote fields. This object was validated as a JobSpec
        already (it is one): its fields are copied, not dumped and validated again."""
        fields = JobSpec.model_fields
        return JobSpec.model_construct(
            self.model_fields_set & fields.keys(), **{name: getattr(self, name) for name in fields}
        )


class LinkBytesPublic(BaseModel):
    measured: int = Field(description="bytes sent, summed over every rank and finished step")
    predicted: int | None = Field(description="the plan's bytes per iteration × those steps")


class ProgressPublic(BaseModel):
    step: int = Field(description="steps every rank has finished")
    steps: int
    ranks: int = Field(description="workers in the plan (0 before one)")
    ranks_reporting: int
    loss: float | None = Field(description="mean loss of the newest finished step")
    tokens_per_s: float | None
    bytes: dict[str, LinkBytesPublic] = Field(description="intra_node, intra_site, wan")


class FailurePublic(BaseModel):
    rank: int
    site: str
    exit_code: int | None
    message: str
    last_lines: list[str]


class JobPublic(BaseModel):
    id: str
    name: str
    tenant: str | None
    state: JobState
    reason: str = Field(description="why it is in its state (what a pending job waits for)")
    priority: int
    gpus: int
    spec: dict[str, Any]
    plan: Plan | None
    quote_id: str | None
    rendezvous: str | None = Field(description="host:port of the job's torch rendezvous")
    progress: ProgressPublic
    failure: FailurePublic | None
    epoch: int = Field(description="launches so far: +1 at every (re)admission; 0: none yet")
    restarts: int = Field(description="launched again after its own workers failed")
    losses: int = Field(description="planned again after losing an agent (infrastructure)")
    checkpoint: dict[str, Any] | None = Field(
        description="where the next launch resumes: {epoch, step, path} of a checkpoint"
    )
    created_at: datetime
    scheduled_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None


class JobsPublic(BaseModel):
    data: list[JobPublic]
    count: int = Field(description="jobs matching the filter, all pages")


class EventPublic(BaseModel):
    id: int
    at: datetime
    kind: str
    message: str
    data: dict[str, Any]


class StepPublic(BaseModel):
    step: int
    loss: float | None
    seconds: float = Field(description="the slowest rank's")
    tokens_per_s: float | None
    ranks: int = Field(description="ranks that reported this step")
    bytes: dict[str, int]
    wan_sync: str | None = Field(
        default=None, description="the WAN sync that ran the step (wan: auto's rung)"
    )
    predicted_bytes: dict[str, int] | None = Field(
        default=None,
        description="the plan's bytes for this step: under wan: outer the pipeline hops, "
        "plus a whole exchange at an outer step; per phase of a wan: auto schedule",
    )


class MetricsPublic(BaseModel):
    job_id: str
    ranks: int
    predicted_bytes_per_step: dict[str, int] | None = Field(
        description="the plan's bytes per iteration (under wan: outer one exchange ÷ H, "
        "rounded up: each step's own is in `steps[].predicted_bytes`)"
    )
    steps: list[StepPublic]


class LogLinePublic(BaseModel):
    id: int = Field(description="increasing: ask for lines after it with ?after=")
    rank: int
    at: datetime
    line: str


class LogsPublic(BaseModel):
    job_id: str
    lines: list[LogLinePublic]
    ended: bool = Field(description="the job has ended and no rank still runs")
