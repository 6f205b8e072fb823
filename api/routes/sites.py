"""Sites, their agents and their nodes, as the registry knows them.

- `GET /v1/sites`: every site in summary (agents alive, GPUs free/allocated/lost) with
  the WAN links its agents measured;
- `GET /v1/sites/{site}/agents`: the site's agents, alive or lost;
- `GET /v1/sites/{site}/nodes`: the site's nodes with their GPUs and RDMA ports.

Each is a page in key order (site name, agent id, node name): `limit` items (default
100, at most 1000) after the key `after`. When more follow, the `Link` header names the
next page (`<…?after=KEY&limit=N>; rel="next"`, as RFC 8288 and GitHub's API do), so the
body stays a plain list. Every page costs a fixed number of queries (cpn.registry.views).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request, Response

from api.deps import SessionDep
from api.schemas import AgentPublic, NodePublic, SitePublic
from cpn.contracts.limits import AGENT_ID_MAX, AGENT_ID_PATTERN, NAME_MAX, NAME_PATTERN
from cpn.registry import views
from cpn.registry.models import utcnow

router = APIRouter(prefix="/v1/sites", tags=["sites"])

DEFAULT_PAGE = 100
MAX_PAGE = 1000

Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description="items per page")]
SiteName = Annotated[
    str, Path(pattern=f"^{NAME_PATTERN}$", max_length=NAME_MAX, description="site name")
]
AfterName = Annotated[
    str | None,
    Query(
        pattern=f"^{NAME_PATTERN}$",
        max_length=NAME_MAX,
        description="start after this name (from the previous page's Link header)",
    ),
]
AfterAgent = Annotated[
    str | None,
    Query(
        pattern=f"^{AGENT_ID_PATTERN}$",
        max_length=AGENT_ID_MAX,
        description="start after this agent id (from the previous page's Link header)",
    ),
]


def _link_next(request: Request, response: Response, after: str | None, limit: int) -> None:
    if after is not None:
        url = request.url.include_query_params(after=after, limit=limit)
        response.headers["Link"] = f'<{url}>; rel="next"'


def _site(session: SessionDep, name: str) -> int:
    found = views.site_id(session, name)
    if found is None:
        raise HTTPException(status_code=404, detail=f"site: no site {name!r}")
    return found


@router.get("", response_model=list[SitePublic])
def list_sites(
    session: SessionDep,
    request: Request,
    response: Response,
    limit: Limit = DEFAULT_PAGE,
    after: AfterName = None,
) -> list[views.SiteView]:
    page = views.sites(session, utcnow(), limit=limit, after=after)
    _link_next(request, response, page.next_after, limit)
    return page.items


@router.get("/{site}/agents", response_model=list[AgentPublic])
def list_agents(
    session: SessionDep,
    request: Request,
    response: Response,
    site: SiteName,
    limit: Limit = DEFAULT_PAGE,
    after: AfterAgent = None,
) -> list[views.AgentView]:
    page = views.agents(session, _site(session, site), utcnow(), limit=limit, after=after)
    _link_next(request, response, page.next_after, limit)
    return page.items


@router.get("/{site}/nodes", response_model=list[NodePublic])
def list_nodes(
    session: SessionDep,
    request: Request,
    response: Response,
    site: SiteName,
    limit: Limit = DEFAULT_PAGE,
    after: AfterName = None,
) -> list[views.NodeView]:
    page = views.nodes(session, _site(session, site), utcnow(), limit=limit, after=after)
    _link_next(request, response, page.next_after, limit)
    return page.items
