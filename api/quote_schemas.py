"""The quote family of schemas."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field, model_validator

from api.job_schemas import MAX_GPUS, StorableBody
from cpn.contracts import JobSpec, Plan


class QuoteCreate(JobSpec, StorableBody):
    """The job to price (the job YAML's fields as JSON)."""

    @model_validator(mode="after")
    def _bounded(self) -> QuoteCreate:
        gpus = self.gpus if self.parallel == "auto" else self.fixed_parallel.world_size
        if gpus is not None and gpus > MAX_GPUS:
            raise ValueError(f"gpus: at most {MAX_GPUS} GPUs per job, got {gpus}")
        return self


class PricePublic(BaseModel):
    gpu_hours: float
    gpu: float = Field(description="GPU-hours at each site's price")
    egress: float = Field(description="WAN bytes at each link's price per GB")
    total: float


class CandidatePublic(BaseModel):
    rank: int = Field(description="0 is the best: fastest, then fewest WAN bytes, then cheapest")
    objective: str
    parallel: dict[str, int]
    sites: list[str]
    fits_now: bool = Field(description="False: priced on the whole network; it would wait")
    predicted_iteration_seconds: float
    predicted_total_seconds: float
    wan_bytes_per_iteration: int
    wan_bytes_total: int
    price: PricePublic
    plan: Plan


class QuotePublic(BaseModel):
    id: str
    created_at: datetime
    expires_at: datetime
    job: dict[str, Any]
    candidates: list[CandidatePublic]


def candidate_public(doc: dict[str, Any]) -> CandidatePublic:
    plan = Plan.model_validate(doc["plan"])
    return CandidatePublic(
        rank=doc["rank"],
        objective=doc["objective"],
        parallel=plan.parallel.model_dump(),
        sites=plan.sites_used(),
        fits_now=doc["fits_now"],
        predicted_iteration_seconds=plan.predicted_iteration_seconds,
        predicted_total_seconds=doc["predicted_total_seconds"],
        wan_bytes_per_iteration=plan.bytes_per_iteration.wan,
        wan_bytes_total=doc["wan_bytes_total"],
        price=PricePublic.model_validate(doc["price"]),
        plan=plan,
    )
