"""/v1/quotes: ranked candidate plans for a job, with predicted time, WAN bytes and price.
A quote reserves nothing; POST /v1/jobs may name one (`quote_id`, `candidate`)."""

from __future__ import annotations

from fastapi import APIRouter, status

from api.deps import PrincipalDep, RegistryDep, SettingsDep
from api.quote_schemas import QuoteCreate, QuotePublic, candidate_public
from cpn.contracts import JobSpec
from cpn.orchestration.quotes import make_quote

router = APIRouter(prefix="/v1/quotes", tags=["quotes"])


@router.post(
    "",
    response_model=QuotePublic,
    status_code=status.HTTP_201_CREATED,
    responses={422: {"description": "A field is invalid, or the job can never fit"}},
)
def create_quote(
    body: QuoteCreate, registry: RegistryDep, settings: SettingsDep, principal: PrincipalDep
) -> QuotePublic:
    """Plan the job several ways on the live network (its layout under each objective,
    and the other layouts of as many GPUs) and rank them: fastest first, then fewest WAN
    bytes, then cheapest."""
    spec = JobSpec.model_validate(body.model_dump())
    quote = make_quote(registry, settings, principal, spec)
    return QuotePublic(
        id=quote.id,
        created_at=quote.created_at,
        expires_at=quote.expires_at,
        job=quote.spec,
        candidates=[candidate_public(c) for c in quote.candidates],
    )
